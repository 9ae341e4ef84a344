"""Loading the user's file: first run, merging with newer defaults, warnings, and the
errors for files that are not settings at all."""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

import pytest

from kvchat.config import (
    AnchorType,
    AttentionMode,
    ConfigError,
    HeadSelectMode,
    KvType,
    LoadedSettings,
    ModelDevice,
    ModelDtype,
    PositionMode,
    Settings,
    Theme,
    load_settings,
)
from kvchat.config.store import default_yaml
from kvchat.config.yamltext import HEADER


def test_first_run_creates_the_file_from_the_packaged_default(home):
    loaded = load_settings()
    assert isinstance(loaded, LoadedSettings)
    assert loaded.created is True
    assert loaded.path == home / "config.yaml"
    assert loaded.path.read_text(encoding="utf-8") == default_yaml()
    assert loaded.settings == Settings()
    assert loaded.warnings == []
    assert sorted(p.name for p in home.iterdir()) == [".config.yaml.lock", "config.yaml"]

    again = load_settings()
    assert (again.created, again.settings) == (False, Settings())


def test_an_explicit_path_is_created_with_its_folders(tmp_path):
    path = tmp_path / "a" / "b" / "settings.yaml"
    loaded = load_settings(path)
    assert loaded.created and path.read_text(encoding="utf-8") == default_yaml()


def test_create_false_uses_defaults_and_writes_nothing(home):
    loaded = load_settings(create=False)
    assert (loaded.created, loaded.settings) == (False, Settings())
    assert loaded.warnings == [f"{home / 'config.yaml'}: not found; using the built-in defaults"]
    assert not home.exists()


def test_old_file_missing_keys_and_a_section_takes_the_defaults(write_config):
    # As written by an older kvchat: fewer long_context keys and no `ui` section.
    write_config(
        """\
        model:
          path: /models/qwen.gguf
        generation:
          temperature: 0.7
        long_context:
          kv_type: INT8
          block_size: 64
          local_windows_len: 2048
        """
    )
    loaded = load_settings()
    defaults = Settings()
    assert loaded.warnings == []
    assert loaded.settings == dataclasses.replace(
        defaults,
        model=dataclasses.replace(defaults.model, path="/models/qwen.gguf"),
        generation=dataclasses.replace(defaults.generation, temperature=0.7),
        long_context=dataclasses.replace(
            defaults.long_context, kv_type="INT8", block_size=64, local_windows_len=2048
        ),
    )
    assert loaded.settings.ui == defaults.ui


@pytest.mark.parametrize(
    "text",
    ["", "# only a comment\n", "model:\n  # path: x\nui:\n"],
    ids=["empty", "comments-only", "empty-sections"],
)
def test_files_without_values_give_the_defaults(write_config, text):
    write_config(text)
    assert load_settings().settings == Settings()


def test_unknown_keys_and_sections_are_warnings_not_errors(write_config):
    path = write_config(
        """\
        long_context:
          kv_typ: INT8
          block_size: 64
          local_windows_len: 4096
          retired_option: 3
        modle:
          path: x
        """
    )
    loaded = load_settings()
    assert loaded.settings.long_context.block_size == 64
    assert loaded.settings.long_context.kv_type == "FP16"
    assert loaded.warnings == [
        f"{path}: unknown key long_context.kv_typ ignored (did you mean kv_type?)",
        f"{path}: unknown key long_context.retired_option ignored",
        f"{path}: unknown section modle ignored (did you mean model?)",
    ]


def test_numbers_are_read_as_their_field_type(write_config):
    write_config(
        """\
        generation:
          temperature: 1
          top_p: 1e-1
          max_new_tokens: 1024.0
        ui:
          stats_refresh_hz: 10
        """
    )
    s = load_settings().settings
    assert (s.generation.temperature, type(s.generation.temperature)) == (1.0, float)
    assert (s.generation.top_p, type(s.generation.top_p)) == (0.1, float)
    assert (s.generation.max_new_tokens, type(s.generation.max_new_tokens)) == (1024, int)
    assert (s.ui.stats_refresh_hz, type(s.ui.stats_refresh_hz)) == (10.0, float)


def test_enumerated_values_are_read_as_their_enum_members(write_config):
    write_config(
        """\
        model:
          device: cpu
        long_context:
          anchor_type: DYNAMIC
          anchor_num: 4
          kv_type: INT4
          head_select_mode: SEPARATE
          attention: dense
          position_mode: extrapolate
        ui:
          theme: light
        """
    )
    s = load_settings().settings
    lc = s.long_context
    got = [s.model.device, s.model.dtype, lc.anchor_type, lc.kv_type, lc.head_select_mode]
    got += [lc.attention, lc.position_mode, s.ui.theme]
    assert [(value, type(value)) for value in got] == [
        (ModelDevice.CPU, ModelDevice),
        (ModelDtype.AUTO, ModelDtype),
        (AnchorType.DYNAMIC, AnchorType),
        (KvType.INT4, KvType),
        (HeadSelectMode.SEPARATE, HeadSelectMode),
        (AttentionMode.DENSE, AttentionMode),
        (PositionMode.EXTRAPOLATE, PositionMode),
        (Theme.LIGHT, Theme),
    ]
    # A member is its string: it compares, hashes and formats as the file's text.
    assert lc.kv_type == "INT4" and {"INT4": 1}[lc.kv_type] == 1 and f"{lc.kv_type}" == "INT4"


@pytest.mark.parametrize(
    ("text", "line", "column"),
    [
        ("model:\n  path: smollm2\n dtype: auto\n", 3, 2),
        ("model:\n  path: [unclosed\n", 3, 1),
        ("ui:\n  theme: a: b\n", 2, 11),
    ],
    ids=["indentation", "unclosed-list", "nested-colon"],
)
def test_malformed_yaml_names_file_and_line(write_config, text, line, column):
    path = write_config(text)
    with pytest.raises(ConfigError) as exc:
        load_settings()
    message = str(exc.value)
    assert message.startswith(f"{path}: line {line}, column {column}: not valid YAML (")


@pytest.mark.parametrize(
    ("text", "got"),
    [("- model\n- ui\n", "a list"), ("just text\n", "a string"), ("42\n", "an integer")],
)
def test_top_level_must_be_a_mapping(write_config, text, got):
    path = write_config(text)
    with pytest.raises(ConfigError) as exc:
        load_settings()
    assert str(exc.value) == (
        f"{path}: expected a mapping with the sections model, generation, long_context, ui, keys, "
        f"cache at the top level (got {got})"
    )


def test_a_section_must_be_a_mapping(write_config):
    path = write_config("generation: fast\n")
    with pytest.raises(ConfigError) as exc:
        load_settings()
    assert str(exc.value) == (
        f'{path}: generation = "fast": expected a mapping of generation settings (got a string)'
    )


def test_an_unreadable_path_is_a_config_error(home):
    path = home / "config.yaml"
    path.mkdir(parents=True)
    with pytest.raises(ConfigError, match="cannot read the settings file") as exc:
        load_settings()
    assert str(exc.value).startswith(f"{path}: ")


def test_a_file_that_is_not_utf8_is_a_config_error(home):
    path = home / "config.yaml"
    home.mkdir()
    path.write_bytes(b"model:\n  path: caf\xe9\n")
    with pytest.raises(ConfigError, match="cannot read the settings file"):
        load_settings()


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root ignores permissions")
def test_a_home_that_cannot_be_written_gives_defaults_and_a_warning(home):
    home.mkdir(mode=0o500)
    try:
        loaded = load_settings()
    finally:
        home.chmod(0o700)
    assert (loaded.created, loaded.settings) == (False, Settings())
    assert loaded.warnings[0].startswith(f"{home / 'config.yaml'}: could not create it (")
    assert not (home / "config.yaml").exists()


WRITTEN_WHOLE = Path(__file__).parents[1] / "fixtures" / "config-written-whole.yaml"


def test_a_file_written_whole_is_upgraded_once_so_new_defaults_reach_it(write_config):
    # A file as earlier releases wrote it: every key with its value, second_select_num at
    # the default of then (32); the user warmed the temperature and added a note.
    text = (
        WRITTEN_WHOLE.read_text(encoding="utf-8")
        .replace("  temperature: 0.0", "  temperature: 0.7  # warmer")
        .replace("# Which model", "# my laptop\n# Which model")
    )
    assert "  second_select_num: 32\n" in text
    path = write_config(text)
    assert load_settings(create=False).settings.long_context.second_select_num == 32
    assert path.read_text(encoding="utf-8") == text  # a read-only load writes nothing

    loaded = load_settings()
    assert loaded.settings.long_context.second_select_num == 16
    assert loaded.settings.generation.temperature == 0.7
    assert loaded.warnings == [
        f"{path}: the keys at their defaults are now commented out, so kvchat's defaults "
        "reach you; now model.path: smollm2-135m -> qwen2.5-coder-0.5b, "
        "long_context.second_select_num: 32 -> 16, cache.snapshot_max_gib: 20.0 -> 0.0"
    ]
    saved = path.read_text(encoding="utf-8")
    assert saved.startswith(HEADER)
    lines = saved.splitlines()
    assert "# my laptop" in lines and "  # second_select_num: 16" in lines
    assert [line for line in lines if re.match(r"  \w+:", line)] == ["  temperature: 0.7  # warmer"]

    again = load_settings()
    assert (again.settings, again.warnings) == (loaded.settings, [])
    assert path.read_text(encoding="utf-8") == saved


def test_a_whole_file_the_editor_cannot_handle_is_kept_and_said_once(write_config):
    text = WRITTEN_WHOLE.read_text(encoding="utf-8")
    header = "".join(text.splitlines(keepends=True)[:3])
    path = write_config(header + "model: {path: smollm2-135m, dtype: auto}\n")
    loaded = load_settings()
    [warning] = loaded.warnings
    assert "cannot be edited line by line" in warning and "delete the keys" in warning
    assert path.read_text(encoding="utf-8") == HEADER + "model: {path: smollm2-135m, dtype: auto}\n"
    assert load_settings().warnings == []  # said once


def test_kvchat_model_names_the_model_over_the_file_and_under_set(write_config, monkeypatch):
    write_config("model:\n  path: from-the-file.gguf\n")
    assert load_settings().settings.model.path == "from-the-file.gguf"
    monkeypatch.setenv("KVCHAT_MODEL", "smollm2-135m")
    assert load_settings().settings.model.path == "smollm2-135m"
    assert load_settings(overrides=["model.path=x.gguf"]).settings.model.path == "x.gguf"
    monkeypatch.setenv("KVCHAT_MODEL", "")
    assert load_settings().settings.model.path == "from-the-file.gguf"
