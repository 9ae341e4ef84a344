"""Where kvchat keeps the user's files, and the private folders and files it makes:
conversations, settings, caches and exports are the user's alone to read.

Settings go to the platform's config folder, conversations, exports and joined models to its
data folder, snapshots and other caches to its cache folder (platformdirs: ~/.config/kvchat,
~/.local/share/kvchat and ~/.cache/kvchat on Linux, XDG variables honoured). $KVCHAT_HOME puts
everything in that one folder instead, caches under its cache/.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
from enum import StrEnum
from pathlib import Path

import platformdirs

APP = "kvchat"


class Place(StrEnum):
    CONFIG = "config"  # config.yaml
    DATA = "data"  # conversations, exports, joined models
    CACHE = "cache"  # snapshots, the tokenizer cache, measured rates


def kvchat_home() -> Path | None:
    """$KVCHAT_HOME when it is set and not empty."""
    value = os.environ.get("KVCHAT_HOME")
    return Path(value).expanduser() if value else None


def folder_for(place: Place) -> Path:
    """The folder kvchat keeps `place`'s files in."""
    home = kvchat_home()
    if home is not None:
        return home / "cache" if place == Place.CACHE else home
    find = {
        Place.CONFIG: platformdirs.user_config_dir,
        Place.DATA: platformdirs.user_data_dir,
        Place.CACHE: platformdirs.user_cache_dir,
    }[place]
    return Path(find(APP, appauthor=False))


def _roots() -> list[Path]:
    """The folders that are kvchat's own: $KVCHAT_HOME, or the three platform folders."""
    home = kvchat_home()
    return [home] if home is not None else [folder_for(place) for place in Place]


def private_folder(folder: Path) -> Path:
    """Make `folder` and its missing parents, each 0700 whatever the umask; returns it.

    When `folder` is in one of kvchat's folders (or is one), that folder, if others can
    open it (made 0755 under the usual umask), is closed to them too: even the names in it
    say what the user asked (an export is named from its conversation's title).
    """
    missing = [p for p in (folder, *folder.parents) if not p.exists()]
    for path in reversed(missing):
        # mkdir's mode can only lose bits to the umask, so no one else ever gets in.
        with contextlib.suppress(FileExistsError):  # another process made it first
            path.mkdir(mode=0o700)
    for root in (r.absolute() for r in _roots()):
        if root == folder.absolute() or root in folder.absolute().parents:
            info = root.stat()
            if info.st_uid == os.getuid() and stat.S_IMODE(info.st_mode) & 0o077:
                root.chmod(stat.S_IMODE(info.st_mode) & 0o700)
    return folder


def create_private_file(path: Path) -> None:
    """Create `path` empty and 0600 unless it exists. SQLite gives the -wal and -shm files
    it makes beside a database the database's mode, so a database created here first
    keeps those private too."""
    with contextlib.suppress(FileExistsError):
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))


# What an earlier kvchat kept in ~/.kvchat, and where each now lives (caches: cache/'s
# entries go to the cache folder).
_LEGACY_PLACES = {
    "config.yaml": Place.CONFIG,
    "conversations.sqlite3": Place.DATA,
    "conversations.sqlite3-wal": Place.DATA,
    "conversations.sqlite3-shm": Place.DATA,
    "exports": Place.DATA,
    "models": Place.DATA,
}


def move_legacy_home(legacy: Path | None = None) -> str | None:
    """Move what ~/.kvchat holds to the platform's folders, once (never with $KVCHAT_HOME
    set, never over a file already there); returns a notice saying so, or None."""
    legacy = legacy or Path.home() / ".kvchat"
    if kvchat_home() is not None or not legacy.is_dir():
        return None
    moved: list[str] = []
    kept: list[str] = []
    for entry in sorted(legacy.iterdir()):
        if entry.name.startswith("."):  # lock files: their holders are gone or recreate them
            continue
        if entry.name == "cache":
            targets = [(child, folder_for(Place.CACHE) / child.name) for child in entry.iterdir()]
        else:
            targets = [(entry, folder_for(_LEGACY_PLACES.get(entry.name, Place.DATA)) / entry.name)]
        for source, target in targets:
            if target.exists():
                kept.append(str(source))
                continue
            try:
                private_folder(target.parent)
                shutil.move(source, target)
            except OSError:
                kept.append(str(source))
            else:
                moved.append(source.name)
    if not moved:
        return None
    with contextlib.suppress(OSError):
        for leftover in (legacy / "cache", legacy):
            for lock in leftover.glob(".*.lock"):
                lock.unlink()
            leftover.rmdir()  # only when empty
    where = ", ".join(
        f"{what} {folder_for(place)}"
        for what, place in (
            ("settings", Place.CONFIG),
            ("data", Place.DATA),
            ("caches", Place.CACHE),
        )
    )
    note = f"moved {legacy} to the platform's folders: {where}"
    return note + (f"; left in place (already there): {', '.join(kept)}" if kept else "")
