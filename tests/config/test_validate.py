"""Every way a value can be wrong gives one message naming the file, the dotted key, the
value and what is allowed."""

from __future__ import annotations

import dataclasses

import pytest

from kvchat.config import ConfigError, Settings, Theme, load_settings, validate_settings

THEMES = ", ".join(Theme)  # every theme the setting allows, as the message lists them

# (section, key, value as written in YAML, message after "FILE: ")
SINGLE_VALUE_ERRORS = [
    # wrong type, per kind
    (
        "long_context",
        "block_size",
        '"abc"',
        'long_context.block_size = "abc": expected an integer from 32 to 4096 that is a multiple '
        "of 32 (got a string)",
    ),
    (
        "long_context",
        "chunk_size",
        "true",
        "long_context.chunk_size = true: expected an integer from 16 to 65536 (got a boolean)",
    ),
    (
        "generation",
        "top_k",
        "1.5",
        "generation.top_k = 1.5: expected an integer from 0 to 1000000 (got a decimal number)",
    ),
    (
        "generation",
        "seed",
        "",
        "generation.seed = null: expected an integer from -1 to 2147483647 (got an empty value)",
    ),
    (
        "generation",
        "temperature",
        "false",
        "generation.temperature = false: expected a number from 0 to 5 (got a boolean)",
    ),
    (
        "generation",
        "temperature",
        "hot",
        'generation.temperature = "hot": expected a number from 0 to 5 (got a string)',
    ),
    ("ui", "show_panels", "1", "ui.show_panels = 1: expected true or false (got an integer)"),
    (
        "long_context",
        "preselect_block",
        '"true"',
        'long_context.preselect_block = "true": expected true or false (got a string)',
    ),
    ("model", "path", "123", "model.path = 123: expected a string (got an integer)"),
    (
        "long_context",
        "kv_type",
        "[INT8]",
        'long_context.kv_type = ["INT8"]: expected one of FP16, INT8, INT4 (got a list)',
    ),
    (
        "model",
        "dtype",
        "{a: 1}",
        'model.dtype = {"a": 1}: expected one of auto, float32, bfloat16 (got a mapping)',
    ),
    # out of range, low and high
    (
        "long_context",
        "block_size",
        "0",
        "long_context.block_size = 0: expected an integer from 32 to 4096 that is a multiple of 32",
    ),
    (
        "long_context",
        "block_size",
        "8192",
        "long_context.block_size = 8192: expected an integer from 32 to 4096 that is a multiple "
        "of 32",
    ),
    (
        "generation",
        "temperature",
        "-0.5",
        "generation.temperature = -0.5: expected a number from 0 to 5",
    ),
    (
        "generation",
        "temperature",
        "5.5",
        "generation.temperature = 5.5: expected a number from 0 to 5",
    ),
    (
        "generation",
        "temperature",
        ".nan",
        "generation.temperature = nan: expected a number from 0 to 5",
    ),
    ("generation", "top_p", "0", "generation.top_p = 0.0: expected a number from 0.01 to 1"),
    ("generation", "seed", "-2", "generation.seed = -2: expected an integer from -1 to 2147483647"),
    (
        "generation",
        "max_new_tokens",
        "0",
        "generation.max_new_tokens = 0: expected an integer from 1 to 1048576",
    ),
    (
        "ui",
        "stats_refresh_hz",
        "60",
        "ui.stats_refresh_hz = 60.0: expected a number from 0.5 to 30",
    ),
    (
        "long_context",
        "local_windows_len",
        "0",
        "long_context.local_windows_len = 0: expected an integer from 128 to 1048576",
    ),
    # not a multiple
    (
        "long_context",
        "block_size",
        "100",
        "long_context.block_size = 100: expected an integer from 32 to 4096 that is a multiple "
        "of 32",
    ),
    # unknown enum value (case matters, as in KTransformers)
    (
        "long_context",
        "kv_type",
        "INT3",
        'long_context.kv_type = "INT3": expected one of FP16, INT8, INT4',
    ),
    (
        "long_context",
        "kv_type",
        "fp16",
        'long_context.kv_type = "fp16": expected one of FP16, INT8, INT4',
    ),
    (
        "long_context",
        "anchor_type",
        "MEAN",
        'long_context.anchor_type = "MEAN": expected one of DYNAMIC, FIXED, BLOCK_MEAN, '
        "BLOCK_MAX, QUEST",
    ),
    ("model", "device", "gpu", 'model.device = "gpu": expected one of auto, cpu, cuda'),
    ("ui", "theme", "solarized", f'ui.theme = "solarized": expected one of {THEMES}'),
]


@pytest.mark.parametrize(
    ("section", "key", "raw", "message"),
    SINGLE_VALUE_ERRORS,
    ids=[f"{s}.{k}={r}" for s, k, r, _ in SINGLE_VALUE_ERRORS],
)
def test_a_bad_value_is_one_clear_message(write_config, section, key, raw, message):
    path = write_config(f"{section}:\n  {key}: {raw}\n")
    with pytest.raises(ConfigError) as exc:
        load_settings()
    assert str(exc.value) == f"{path}: {message}"


# (long_context lines, message after "FILE: ")
CROSS_FIELD_ERRORS = [
    *[
        (
            f"anchor_type: {kind}\nanchor_num: 2",
            f"long_context.anchor_num = 2: expected 1 when long_context.anchor_type is {kind}",
        )
        for kind in ("BLOCK_MEAN", "BLOCK_MAX", "QUEST")
    ],
    (
        "anchor_type: FIXED\nblock_size: 32\nanchor_num: 64",
        "long_context.anchor_num = 64: expected at most long_context.block_size (32)",
    ),
    (
        "chunk_size: 8192\nmax_seq_len: 4096",
        "long_context.chunk_size = 8192: expected at most long_context.max_seq_len (4096)",
    ),
    (
        "local_windows_len: 4160",
        "long_context.local_windows_len = 4160: expected a multiple of long_context.block_size "
        "(128)",
    ),
    (
        "block_size: 4096\nlocal_windows_len: 2048",
        "long_context.local_windows_len = 2048: expected a multiple of long_context.block_size "
        "(4096)",
    ),
    (
        "preselect_block: true\npreselect_block_count: 16\nsecond_select_num: 32",
        "long_context.preselect_block_count = 16: expected at least "
        "long_context.second_select_num (32) when long_context.preselect_block is true",
    ),
]


def _long_context(lines: str) -> str:
    return "long_context:\n" + "".join(f"  {line}\n" for line in lines.splitlines())


@pytest.mark.parametrize(
    ("lines", "message"), CROSS_FIELD_ERRORS, ids=[m.split(":")[0] for _, m in CROSS_FIELD_ERRORS]
)
def test_cross_field_rules(write_config, lines, message):
    path = write_config(_long_context(lines))
    with pytest.raises(ConfigError) as exc:
        load_settings()
    assert str(exc.value) == f"{path}: {message}"


@pytest.mark.parametrize(
    "lines",
    [
        "anchor_type: DYNAMIC\nanchor_num: 4",
        "anchor_type: FIXED\nanchor_num: 128",
        "chunk_size: 4096\nmax_seq_len: 4096",
        "block_size: 256\nlocal_windows_len: 512",
        "preselect_block: false\npreselect_block_count: 1\nsecond_select_num: 32",
        "preselect_block: true\npreselect_block_count: 32\nsecond_select_num: 32",
    ],
)
def test_cross_field_rules_accept_valid_combinations(write_config, lines):
    write_config(_long_context(lines))
    load_settings()


def test_several_bad_values_are_reported_together(write_config):
    path = write_config("generation:\n  top_k: -1\nui:\n  theme: blue\n")
    with pytest.raises(ConfigError) as exc:
        load_settings()
    assert str(exc.value) == (
        f"{path}: 2 invalid settings:\n"
        "  generation.top_k = -1: expected an integer from 0 to 1000000\n"
        f'  ui.theme = "blue": expected one of {THEMES}'
    )


def test_validate_settings_checks_settings_built_in_code():
    validate_settings(Settings(), "settings screen")
    s = Settings()
    bad = dataclasses.replace(s, ui=dataclasses.replace(s.ui, show_panels=0))
    with pytest.raises(ConfigError) as exc:
        validate_settings(bad, "settings screen")
    assert str(exc.value) == (
        "settings screen: ui.show_panels = 0: expected true or false (got an integer)"
    )
    crossed = dataclasses.replace(
        s, long_context=dataclasses.replace(s.long_context, anchor_type="QUEST", anchor_num=2)
    )
    with pytest.raises(ConfigError, match=r"^settings screen: long_context\.anchor_num = 2: "):
        validate_settings(crossed, "settings screen")


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (
            "stop: ctrl+o",
            'keys.stop = "ctrl+o": expected a key no other action has (ctrl+o is keys.load_file)',
        ),
        (
            "help: f5, f2",
            'keys.help = "f5, f2": expected a key no other action has (f2 is keys.toggle_panels)',
        ),
        (
            "settings: ctrl+p",
            'keys.settings = "ctrl+p": expected a key other than ctrl+p, which '
            "opens the command palette",
        ),
        (
            'stop: ""',
            'keys.stop = "": expected a key name such as ctrl+o or f2, or several '
            "separated by commas",
        ),
        (
            "stop: escape,",
            'keys.stop = "escape,": expected a key name such as ctrl+o or f2, or '
            "several separated by commas",
        ),
        (
            "stop: ctrl x",
            'keys.stop = "ctrl x": expected a key name such as ctrl+o or f2, or '
            "several separated by commas",
        ),
    ],
    ids=["taken", "taken-in-a-list", "reserved", "empty", "empty-in-a-list", "blank"],
)
def test_key_bindings_are_checked(write_config, lines, message):
    path = write_config(f"keys:\n  {lines}\n")
    with pytest.raises(ConfigError) as exc:
        load_settings()
    assert str(exc.value) == f"{path}: {message}"


def test_key_bindings_may_swap_and_list_several_keys(write_config):
    write_config("keys:\n  stop: f2, ctrl+x\n  toggle_panels: escape\n")
    keys = load_settings().settings.keys
    assert (keys.stop, keys.toggle_panels, keys.load_file) == ("f2, ctrl+x", "escape", "ctrl+o")


def test_an_unknown_action_is_a_warning(write_config):
    path = write_config("keys:\n  lod_file: ctrl+k\n")
    loaded = load_settings()
    assert loaded.warnings == [
        f"{path}: unknown key keys.lod_file ignored (did you mean load_file?)"
    ]
    assert loaded.settings.keys == Settings().keys
