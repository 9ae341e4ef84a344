"""$KVCHAT_HOME, where kvchat keeps the user's data, and the private folders and files it
makes: conversations, settings, caches and exports are the user's alone to read."""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path


def kvchat_home() -> Path:
    """$KVCHAT_HOME, or ~/.kvchat when it is unset or empty."""
    value = os.environ.get("KVCHAT_HOME")
    return Path(value).expanduser() if value else Path.home() / ".kvchat"


def private_folder(folder: Path) -> Path:
    """Make `folder` and its missing parents, each 0700 whatever the umask; returns it.

    When `folder` is in $KVCHAT_HOME (or is it), a home that others can open, such as
    one made 0755 under the usual umask, is closed to them too: even the names in it
    say what the user asked (an export is named from its conversation's title).
    """
    missing = [p for p in (folder, *folder.parents) if not p.exists()]
    for path in reversed(missing):
        # mkdir's mode can only lose bits to the umask, so no one else ever gets in.
        with contextlib.suppress(FileExistsError):  # another process made it first
            path.mkdir(mode=0o700)
    home = kvchat_home().absolute()
    if home == folder.absolute() or home in folder.absolute().parents:
        info = home.stat()
        if info.st_uid == os.getuid() and stat.S_IMODE(info.st_mode) & 0o077:
            home.chmod(stat.S_IMODE(info.st_mode) & 0o700)
    return folder


def create_private_file(path: Path) -> None:
    """Create `path` empty and 0600 unless it exists. SQLite gives the -wal and -shm files
    it makes beside a database the database's mode, so a database created here first
    keeps those private too."""
    with contextlib.suppress(FileExistsError):
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
