"""Private by default: what kvchat writes for the user (settings, conversations, exports,
caches, KV snapshots) only the user can read, whatever the umask."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sqlite3
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvchat.config import Settings, default_config_path, save_settings
from kvchat.core.history import DB_NAME, History, SavedMessage, export_markdown
from kvchat.core.snapshot import SUFFIX, SnapshotStore, snapshot_dir
from kvchat.core.tokenizer import _cache_file, _write_atomically
from kvchat.kv.state import CacheState

pytestmark = pytest.mark.skipif(os.name != "posix", reason="POSIX file modes")


@contextlib.contextmanager
def umask(mask: int) -> Iterator[None]:
    before = os.umask(mask)
    try:
        yield
    finally:
        os.umask(before)


def _open_to_others(paths: list[Path]) -> dict[str, str]:
    """The paths that give their group or others any access, with their modes."""
    modes = {path: stat.S_IMODE(path.stat().st_mode) for path in paths}
    return {str(path): oct(mode) for path, mode in modes.items() if mode & 0o077}


def test_everything_kvchat_writes_is_private_under_the_usual_umask(tmp_path, monkeypatch):
    home = tmp_path / "home"  # made by kvchat, as on a first run
    monkeypatch.setenv("KVCHAT_HOME", str(home))
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")
    with umask(0o022):
        settings = Settings()
        save_settings(
            dataclasses.replace(settings, ui=dataclasses.replace(settings.ui, theme="light")),
            default_config_path(),
        )
        history = History()
        cid = history.create("SmolLM2-135M", None, None)
        # A second connection keeps the -wal and -shm files: the last one to close deletes them.
        with contextlib.closing(sqlite3.connect(history.path)) as reader:
            reader.execute("SELECT COUNT(*) FROM messages").fetchone()
            history.add_message(cid, SavedMessage("user", "What does my contract say?"))
            export_markdown(history.load(cid))
            elsewhere = export_markdown(history.load(cid), tmp_path / "chats" / "mine.md")
            _write_atomically(_cache_file(model), "{}")
            state = CacheState({"length": 2}, {"x": torch.zeros(64)})
            SnapshotStore(snapshot_dir(), 1 << 30).save(state, [1, 2], torch.zeros(4), "m", "m", {})
            written = [home, *home.rglob("*")]
            names = {path.name for path in written}
            assert {"config.yaml", DB_NAME, f"{DB_NAME}-wal", f"{DB_NAME}-shm"} <= names
            assert {"exports", "cache", "tokenizers", "snapshots"} <= names
            assert len(list(snapshot_dir().glob(f"*{SUFFIX}"))) == 1
            assert len(list((home / "exports").iterdir())) == 1
            assert len(list((home / "cache" / "tokenizers").iterdir())) == 1
            assert _open_to_others([*written, elsewhere, elsewhere.parent]) == {}


def test_an_open_home_is_closed_and_a_users_own_folder_left_as_it_is(tmp_path, monkeypatch):
    home = tmp_path / "home"
    home.mkdir(mode=0o755)
    home.chmod(0o755)
    mine = tmp_path / "mine"
    mine.mkdir()
    mine.chmod(0o755)
    monkeypatch.setenv("KVCHAT_HOME", str(home))
    with umask(0o022):
        History().create("SmolLM2-135M", None, None)
        exported = export_markdown(History().load(1), mine)
    assert stat.S_IMODE(home.stat().st_mode) == 0o700
    assert stat.S_IMODE(mine.stat().st_mode) == 0o755
    assert stat.S_IMODE(exported.stat().st_mode) == 0o600
