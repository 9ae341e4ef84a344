"""Saving: atomic replacement, and the user's comments survive."""

from __future__ import annotations

import dataclasses
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvchat.config import (
    AttentionMode,
    ConfigError,
    KvType,
    Settings,
    load_settings,
    replace_key,
    save_changes,
    save_settings,
    settings_file_text,
)
from kvchat.config.store import default_yaml, set_values


def _changed(settings: Settings) -> Settings:
    return dataclasses.replace(
        settings,
        generation=dataclasses.replace(settings.generation, temperature=0.7, seed=-1),
        long_context=dataclasses.replace(
            settings.long_context, kv_type="INT8", preselect_block=True
        ),
        ui=dataclasses.replace(settings.ui, show_panels=False),
    )


def test_save_to_a_new_path_renders_the_commented_file(tmp_path):
    path = tmp_path / "new" / "config.yaml"
    settings = _changed(Settings())
    save_settings(settings, path)
    text = path.read_text(encoding="utf-8")
    assert text == settings_file_text(settings)
    # The changed keys are live; the others are commented out, so they follow the defaults.
    lines = text.splitlines()
    assert {"  temperature: 0.7", "  kv_type: INT8", "  show_panels: false"} <= set(lines)
    assert {"  # top_p: 1.0", "  # max_seq_len: 131072", "  # theme: dark"} <= set(lines)
    assert load_settings(path).settings == settings
    assert sorted(os.listdir(path.parent)) == [".config.yaml.lock", "config.yaml"]


def test_user_comments_and_unknown_keys_survive_a_save(home):
    path = load_settings().path
    user_text = (
        default_yaml()
        .replace("# Which model", "# my laptop setup\n# Which model")
        .replace(
            "  # kv_type: FP16", "  # kv_type: FP16   # INT4 was too lossy for me\n  my_note: 1"
        )
        .replace("  # theme: dark", "  # I like it dark\n  theme: dark")
    )
    path.write_text(user_text, encoding="utf-8")
    settings = _changed(load_settings().settings)

    save_settings(settings, path)

    saved = path.read_text(encoding="utf-8")
    expected = (
        user_text.replace("  # temperature: 0.0", "  temperature: 0.7")
        .replace("  # seed: 0", "  seed: -1")
        .replace("  # kv_type: FP16   #", "  kv_type: INT8   #")
        .replace("  # preselect_block: false", "  preselect_block: true")
        .replace("  # show_panels: true", "  show_panels: false")
    )
    assert saved == expected  # only the changed values differ; `theme: dark` stays live
    assert load_settings().settings == settings


def test_enum_members_are_saved_as_their_plain_strings(home):
    path = load_settings().path
    before = path.read_text(encoding="utf-8")
    settings = load_settings().settings
    lc = dataclasses.replace(
        settings.long_context, kv_type=KvType.INT4, attention=AttentionMode.DENSE
    )
    changed = dataclasses.replace(settings, long_context=lc)
    save_changes(path, settings, changed)  # the line editor
    expected = before.replace("  # kv_type: FP16", "  kv_type: INT4").replace(
        "  # attention: sparse", "  attention: dense"
    )
    assert path.read_text(encoding="utf-8") == expected
    fresh = path.with_name("fresh.yaml")
    save_settings(changed, fresh)  # the rendered file
    assert "  kv_type: INT4\n" in fresh.read_text(encoding="utf-8")
    for saved in (path, fresh):
        assert load_settings(saved).settings.long_context.kv_type is KvType.INT4


def test_save_adds_missing_keys_and_sections_with_comments(write_config):
    path = write_config(
        """\
        # written by kvchat 0.0.9
        model:
          path: /models/qwen.gguf  # the big one
        long_context:
          kv_type: INT8
        """
    )
    settings = _changed(load_settings().settings)
    save_settings(settings, path)

    saved = path.read_text(encoding="utf-8")
    assert saved.startswith(
        "# written by kvchat 0.0.9\nmodel:\n  path: /models/qwen.gguf  # the big one\n"
    )
    lines = saved.splitlines()
    for line in ("  kv_type: INT8", "generation:", "  temperature: 0.7", "  seed: -1", "ui:"):
        assert line in lines
    assert "  preselect_block: true" in lines
    assert "# After prefill, preselect once" in saved  # added keys come with their comments
    # Keys at their defaults are not added: they follow kvchat's defaults.
    assert not {"  dtype: auto", "  top_p: 1.0", "  theme: dark"} & set(lines)
    reloaded = load_settings()
    assert (reloaded.settings, reloaded.warnings) == (settings, [])


@pytest.mark.parametrize(
    "text",
    [
        "model: {path: x, dtype: auto}\n",  # flow style
        "model:\n  path: >-\n    my\n    model\n",  # multi-line scalar
    ],
    ids=["flow-style", "folded-scalar"],
)
def test_layouts_the_line_editor_cannot_handle_are_re_rendered(write_config, text):
    path = write_config(text)
    settings = _changed(load_settings().settings)
    settings = dataclasses.replace(settings, model=dataclasses.replace(settings.model, path="y"))
    save_settings(settings, path)
    assert path.read_text(encoding="utf-8") == settings_file_text(settings)


@pytest.mark.parametrize(
    "value",
    ["true", "my: model #1", "C:\\models\\x.gguf", "  padded", "", "line\nbreak", "café"],
)
def test_strings_that_need_quoting_survive_both_save_paths(tmp_path, value):
    path = tmp_path / "config.yaml"
    settings = Settings()
    settings = dataclasses.replace(settings, model=dataclasses.replace(settings.model, path=value))
    save_settings(settings, path)  # rendered afresh
    assert load_settings(path).settings.model.path == value
    save_settings(Settings(), path)
    save_settings(settings, path)  # edited in place
    assert load_settings(path).settings.model.path == value
    assert len(path.read_text(encoding="utf-8").splitlines()) == len(default_yaml().splitlines())


def test_invalid_settings_are_refused_and_the_file_is_untouched(home):
    path = load_settings().path
    before = path.read_bytes()
    s = Settings()
    bad = dataclasses.replace(s, model=dataclasses.replace(s.model, path=object()))
    with pytest.raises(ConfigError, match=r"model\.path = .*: expected a string"):
        save_settings(bad, path)
    assert path.read_bytes() == before
    assert sorted(os.listdir(home)) == [".config.yaml.lock", "config.yaml"]


def test_a_failed_replace_leaves_no_temp_file_and_the_target_untouched(tmp_path):
    # os.replace cannot put a file over a non-empty directory: the failure comes after
    # the temp file was fully written and synced.
    target = tmp_path / "config.yaml"
    target.mkdir()
    (target / "keep").write_text("mine", encoding="utf-8")
    with pytest.raises(OSError):
        save_settings(Settings(), target)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".config.yaml.lock", "config.yaml"]
    assert (target / "keep").read_text(encoding="utf-8") == "mine"


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root ignores permissions")
def test_a_read_only_directory_leaves_the_original_untouched(home):
    path = load_settings().path
    before = path.read_bytes()
    home.chmod(0o500)
    try:
        with pytest.raises(PermissionError):
            save_settings(_changed(Settings()), path)
    finally:
        home.chmod(0o700)
    assert path.read_bytes() == before
    assert sorted(os.listdir(home)) == [".config.yaml.lock", "config.yaml"]


@pytest.mark.skipif(os.name != "posix", reason="POSIX file modes")
def test_save_keeps_the_file_mode(home):
    path: Path = load_settings().path
    path.chmod(0o600)
    save_settings(_changed(Settings()), path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_a_users_nested_mapping_is_not_mistaken_for_settings(write_config):
    text = (
        "long_context:\n"
        "  presets:  # my own notes, not read by kvchat\n"
        "    kv_type: INT4\n"
        "  kv_type: FP16\n"
    )
    path = write_config(text)
    settings = load_settings().settings
    changed = dataclasses.replace(
        settings, long_context=dataclasses.replace(settings.long_context, kv_type="INT8")
    )
    save_settings(changed, path)
    saved = path.read_text(encoding="utf-8")
    assert saved.startswith(text.replace("  kv_type: FP16", "  kv_type: INT8"))
    assert load_settings().settings == changed


def test_save_changes_writes_only_what_changed(home, monkeypatch):
    path = load_settings().path
    path.write_text(default_yaml().replace("  # seed: 0", "  seed: 7  # mine"), encoding="utf-8")
    # This run's settings carry a --set override and a $KVCHAT_MODEL the file must not receive.
    monkeypatch.setenv("KVCHAT_MODEL", "smollm2-135m")
    old = load_settings(overrides=["generation.max_new_tokens=8"]).settings
    new = dataclasses.replace(
        old, long_context=dataclasses.replace(old.long_context, second_select_num=8)
    )
    save_changes(path, old, new)
    assert path.read_text(encoding="utf-8") == default_yaml().replace(
        "  # seed: 0", "  seed: 7  # mine"
    ).replace("  # second_select_num: 16", "  second_select_num: 8")


def test_save_changes_refuses_a_file_the_change_breaks(home):
    path = load_settings().path
    small = default_yaml().replace("  # max_seq_len: 131072", "  max_seq_len: 2048")
    path.write_text(small.replace("  # chunk_size: 2048", "  chunk_size: 1024"))
    before = path.read_bytes()
    # The run raised max_seq_len by --set; a larger chunk_size fits the run, not the file.
    old = load_settings(overrides=["long_context.max_seq_len=8192"]).settings
    new = dataclasses.replace(
        old, long_context=dataclasses.replace(old.long_context, chunk_size=4096)
    )
    with pytest.raises(ConfigError, match=r"chunk_size = 4096: expected at most .*\(2048\)"):
        save_changes(path, old, new)
    assert path.read_bytes() == before


# A kvchat process that saves one setting `rounds` times, as the settings screen does: it loads
# the file, changes its key and saves the change. The key holds the value it saved last
# unless a save by the other process lost it.
SAVER = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from kvchat.config import load_settings, replace_key, save_changes
    path, key, rounds = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    section, name = key.split(".")
    print("ready", flush=True)
    sys.stdin.readline()
    for value in range(1, rounds + 1):
        old = load_settings(path).settings
        found = getattr(getattr(old, section), name)
        if found != value - 1:
            sys.exit(f"{key} is {found} in the file after this process saved {value - 1}")
        save_changes(path, old, replace_key(old, key, value))
    """
)


def test_two_processes_saving_at_once_keep_both_changes(home):
    rounds = 100
    path = load_settings().path
    keys = ["generation.seed", "generation.top_k"]
    children = [
        subprocess.Popen(
            [sys.executable, "-c", SAVER, str(path), key, str(rounds)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for key in keys
    ]
    for child in children:
        assert child.stdout is not None and child.stdout.readline() == "ready\n"
    for child in children:  # both start saving together
        assert child.stdin is not None
        child.stdin.write("go\n")
        child.stdin.flush()
    errors = [child.communicate(timeout=120)[1].strip() for child in children]
    assert errors == ["", ""]
    saved = load_settings().settings.generation
    assert (saved.seed, saved.top_k) == (rounds, rounds)


def test_a_key_saved_at_its_default_is_commented_out_with_its_comment(home):
    path = load_settings().path
    path.write_text(
        default_yaml().replace("  # temperature: 0.0", "  temperature: 0.7  # warmer"),
        encoding="utf-8",
    )
    old = load_settings().settings
    save_changes(path, old, replace_key(old, "generation.temperature", 0.0))
    # The file is the default file again, but for the user's comment.
    assert path.read_text(encoding="utf-8") == default_yaml().replace(
        "  # temperature: 0.0", "  # temperature: 0.0  # warmer"
    )


def test_a_key_the_user_set_to_the_default_stays_when_others_are_saved(home):
    path = load_settings().path
    path.write_text(default_yaml().replace("  # top_p: 1.0", "  top_p: 1.0"), encoding="utf-8")
    old = load_settings().settings
    save_changes(path, old, replace_key(old, "generation.seed", 3))
    lines = path.read_text(encoding="utf-8").splitlines()
    assert "  top_p: 1.0" in lines and "  seed: 3" in lines


def test_config_set_never_writes_the_model_kvchat_model_names(home, monkeypatch):
    path = load_settings().path
    monkeypatch.setenv("KVCHAT_MODEL", "smollm2-135m")
    assert set_values(path, ["generation.seed=3"]) == [("generation.seed", 0, 3)]
    assert path.read_text(encoding="utf-8") == default_yaml().replace("  # seed: 0", "  seed: 3")
