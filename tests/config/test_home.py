"""Where kvchat keeps files: the platform's config, data and cache folders (XDG on Linux),
$KVCHAT_HOME as one folder, and the one-time move of what an earlier kvchat kept in
~/.kvchat. Real folders and files in a temporary home."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from kvchat.config import default_config_path, load_settings
from kvchat.config.home import Place, folder_for, move_legacy_home, private_folder
from kvchat.core.history import History, SavedMessage
from kvchat.core.snapshot import snapshot_dir


@pytest.fixture
def xdg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A home with the XDG folders in it and no $KVCHAT_HOME."""
    monkeypatch.delenv("KVCHAT_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    for name, sub in (("CONFIG", ".config"), ("DATA", ".local/share"), ("CACHE", ".cache")):
        monkeypatch.setenv(f"XDG_{name}_HOME", str(tmp_path / sub))
    return tmp_path


def test_without_kvchat_home_each_kind_of_file_has_the_platforms_folder(xdg: Path) -> None:
    assert folder_for(Place.CONFIG) == xdg / ".config" / "kvchat"
    assert folder_for(Place.DATA) == xdg / ".local" / "share" / "kvchat"
    assert folder_for(Place.CACHE) == xdg / ".cache" / "kvchat"
    assert default_config_path() == xdg / ".config" / "kvchat" / "config.yaml"
    assert History().path == xdg / ".local" / "share" / "kvchat" / "conversations.sqlite3"
    assert snapshot_dir() == xdg / ".cache" / "kvchat" / "snapshots"
    load_settings()  # creates the settings file, private
    folder = xdg / ".config" / "kvchat"
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert stat.S_IMODE((folder / "config.yaml").stat().st_mode) == 0o600


def test_kvchat_home_holds_everything_caches_under_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVCHAT_HOME", str(tmp_path / "one"))
    assert folder_for(Place.CONFIG) == folder_for(Place.DATA) == tmp_path / "one"
    assert folder_for(Place.CACHE) == tmp_path / "one" / "cache"
    assert move_legacy_home(tmp_path / "one") is None  # never moves out of $KVCHAT_HOME


def test_a_kvchat_folder_others_can_open_is_closed(xdg: Path) -> None:
    data = xdg / ".local" / "share" / "kvchat"
    data.mkdir(parents=True)
    data.chmod(0o755)
    (xdg / ".local").chmod(0o755)
    private_folder(data / "exports")
    assert stat.S_IMODE(data.stat().st_mode) == 0o700
    assert stat.S_IMODE((xdg / ".local").stat().st_mode) == 0o755  # the user's own: as it was


def test_an_earlier_kvchat_home_is_moved_once_and_used(xdg: Path) -> None:
    legacy = xdg / ".kvchat"
    (legacy / "cache" / "snapshots").mkdir(parents=True)
    (legacy / "cache" / "snapshots" / "abc.kvs").write_bytes(b"snapshot")
    (legacy / "models").mkdir()
    (legacy / "models" / "qwen.gguf").write_bytes(b"GGUF")
    (legacy / "config.yaml").write_text("long_context:\n  kv_type: INT8\n")
    (legacy / ".config.yaml.lock").write_text("")
    History(legacy / "conversations.sqlite3").create("SmolLM2-135M", None, None)

    notice = move_legacy_home(legacy)
    assert notice is not None and notice.startswith(f"moved {legacy} to the platform's folders")
    assert not legacy.exists()
    assert load_settings().settings.long_context.kv_type == "INT8"
    assert (xdg / ".cache" / "kvchat" / "snapshots" / "abc.kvs").read_bytes() == b"snapshot"
    assert (xdg / ".local" / "share" / "kvchat" / "models" / "qwen.gguf").exists()
    history = History()
    assert [s.model for s in history.summaries()] == ["SmolLM2-135M"]
    history.add_message(history.summaries()[0].id, SavedMessage("user", "Still here?"))
    assert move_legacy_home(legacy) is None  # once


def test_a_file_already_in_the_new_place_is_never_overwritten(xdg: Path) -> None:
    legacy = xdg / ".kvchat"
    legacy.mkdir()
    (legacy / "config.yaml").write_text("generation:\n  seed: 1\n")
    (legacy / "notes.txt").write_text("mine")
    new = xdg / ".config" / "kvchat" / "config.yaml"
    new.parent.mkdir(parents=True)
    new.write_text("generation:\n  seed: 2\n")
    notice = move_legacy_home(legacy)
    assert notice is not None
    assert f"left in place (already there): {legacy / 'config.yaml'}" in notice
    assert new.read_text() == "generation:\n  seed: 2\n"
    assert (legacy / "config.yaml").exists()  # kept for the user to look at
    assert (xdg / ".local" / "share" / "kvchat" / "notes.txt").read_text() == "mine"
