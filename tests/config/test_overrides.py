"""Command-line overrides (`--set SECTION.KEY=VALUE`): YAML scalars, validated like file
values, with messages that name the override."""

from __future__ import annotations

import pytest

from kvchat.config import ConfigError, KvType, Settings, apply_overrides, load_settings


@pytest.mark.parametrize(
    ("override", "section", "key", "value"),
    [
        ("long_context.kv_type=INT8", "long_context", "kv_type", KvType.INT8),
        ("generation.temperature=0.7", "generation", "temperature", 0.7),
        ("generation.temperature=1", "generation", "temperature", 1.0),
        ("generation.temperature=1e-1", "generation", "temperature", 0.1),
        ("long_context.preselect_block=true", "long_context", "preselect_block", True),
        ("ui.show_panels=false", "ui", "show_panels", False),
        ("generation.max_new_tokens=2048", "generation", "max_new_tokens", 2048),
        ("generation.seed=-1", "generation", "seed", -1),
        (" generation.top_k = 40 ", "generation", "top_k", 40),
        ("model.path=/models/a=b.gguf", "model", "path", "/models/a=b.gguf"),
        ("model.path='123'", "model", "path", "123"),
    ],
)
def test_override_values_are_yaml_scalars_of_the_field_type(override, section, key, value):
    before = Settings()
    after = apply_overrides(before, [override])
    got = getattr(getattr(after, section), key)
    assert (got, type(got)) == (value, type(value))
    assert before == Settings()  # a new object; the input is unchanged


def test_no_overrides_and_later_overrides_win():
    s = Settings()
    assert apply_overrides(s, []) == s
    after = apply_overrides(s, ["ui.theme=light", "ui.theme=dark", "long_context.kv_type=INT4"])
    assert (after.ui.theme, after.long_context.kv_type) == ("dark", "INT4")


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "long_context.kv_type=INT3",
            '--set long_context.kv_type=INT3: long_context.kv_type = "INT3": '
            "expected one of FP16, INT8, INT4",
        ),
        (
            "long_context.preselect_block=1",
            "--set long_context.preselect_block=1: long_context.preselect_block = 1: "
            "expected true or false (got an integer)",
        ),
        (
            "generation.top_k=2.5",
            "--set generation.top_k=2.5: generation.top_k = 2.5: expected an integer from 0 to "
            "1000000 (got a decimal number)",
        ),
        (
            "generation.top_k=true",
            "--set generation.top_k=true: generation.top_k = true: expected an integer from 0 to "
            "1000000 (got a boolean)",
        ),
        (
            "generation.temperature=warm",
            '--set generation.temperature=warm: generation.temperature = "warm": '
            "expected a number from 0 to 5 (got a string)",
        ),
        (
            "generation.temperature=9",
            "--set generation.temperature=9: generation.temperature = 9.0: "
            "expected a number from 0 to 5",
        ),
        (
            "model.path=",
            "--set model.path=: model.path = null: expected a string (got an empty value)",
        ),
        (
            "long_context.block_size=96",
            "--set long_context.block_size=96: long_context.local_windows_len = 2048: "
            "expected a multiple of long_context.block_size (96)",
        ),
    ],
)
def test_bad_override_values(override, message):
    with pytest.raises(ConfigError) as exc:
        apply_overrides(Settings(), [override])
    assert str(exc.value) == message


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "long_context.kv_typ=INT8",
            "--set long_context.kv_typ=INT8: unknown key 'long_context.kv_typ' "
            "(did you mean long_context.kv_type?)",
        ),
        (
            "kv_type=INT8",
            "--set kv_type=INT8: unknown key 'kv_type' (did you mean long_context.kv_type?)",
        ),
        ("nothing.here=1", "--set nothing.here=1: unknown key 'nothing.here'"),
    ],
)
def test_unknown_override_keys(override, message):
    with pytest.raises(ConfigError) as exc:
        apply_overrides(Settings(), [override])
    assert str(exc.value) == message


def test_an_override_without_equals_sign():
    with pytest.raises(ConfigError) as exc:
        apply_overrides(Settings(), ["long_context.kv_type"])
    assert str(exc.value) == (
        "--set long_context.kv_type: expected SECTION.KEY=VALUE, e.g. long_context.kv_type=INT8"
    )


def test_an_override_value_that_is_not_yaml():
    with pytest.raises(ConfigError) as exc:
        apply_overrides(Settings(), ["model.path=[unclosed"])
    assert str(exc.value).startswith(
        "--set model.path=[unclosed: value '[unclosed' is not valid YAML ("
    )


def test_cross_field_errors_name_all_overrides():
    overrides = ["long_context.anchor_type=QUEST", "long_context.anchor_num=4"]
    with pytest.raises(ConfigError) as exc:
        apply_overrides(Settings(), overrides)
    assert str(exc.value) == (
        "--set long_context.anchor_type=QUEST --set long_context.anchor_num=4: "
        "long_context.anchor_num = 4: expected 1 when long_context.anchor_type is QUEST"
    )


def test_load_settings_applies_overrides_over_the_file(write_config):
    path = write_config("long_context:\n  kv_type: INT4\ngeneration:\n  temperature: 0.2\n")
    loaded = load_settings(overrides=["long_context.kv_type=INT8"])
    assert loaded.settings.long_context.kv_type == "INT8"
    assert loaded.settings.generation.temperature == 0.2
    assert "INT4" in path.read_text(encoding="utf-8")  # overrides are never written back

    with pytest.raises(ConfigError) as exc:
        load_settings(overrides=["ui.theme=blue"])
    assert str(exc.value).startswith("--set ui.theme=blue: ")
    assert str(path) not in str(exc.value)
