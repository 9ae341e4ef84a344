"""Reading the long text a user wants to question, with clear refusals for what is not text."""

from __future__ import annotations

import hashlib
import os
import stat
from dataclasses import dataclass
from pathlib import Path


class DocumentError(ValueError):
    """The file cannot be used as a document; the message says why, naming the file."""


@dataclass(frozen=True)
class Document:
    path: Path
    text: str
    size_bytes: int
    sha256: str  # of the bytes: tells whether the file changed since it was read

    @property
    def name(self) -> str:
        return self.path.name


def check_document(path: str | Path) -> Path:
    """Refuse, without reading it, a path that is missing, a folder, not a regular file (a
    FIFO, a device such as /dev/zero, a socket: reading one can block or never end) or empty."""
    p = Path(path).expanduser()
    try:
        info = p.stat()
    except FileNotFoundError:
        raise DocumentError(f"{p}: no such file") from None
    except OSError as e:
        raise DocumentError(f"{p}: cannot be read ({e.strerror or e})") from e
    _check_kind(p, info)
    return p


def read_document(path: str | Path, max_bytes: int | None = None) -> Document:
    """Read a UTF-8 text file whole; refuse what check_document refuses, a binary file, and
    (before reading it) a file of more than `max_bytes`."""
    p = Path(path).expanduser()
    try:
        # O_NONBLOCK: opening a FIFO swapped in after a check returns at once, and the
        # fstat below refuses it; on a regular file the flag changes nothing.
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise DocumentError(f"{p}: no such file") from None
    except IsADirectoryError:
        raise DocumentError(f"{p}: is a directory, not a text file") from None
    except OSError as e:
        raise DocumentError(f"{p}: cannot be read ({e.strerror or e})") from e
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(fd)
        _check_kind(p, info)
        if max_bytes is not None and info.st_size > max_bytes:
            raise DocumentTooLongError(p, info.st_size)
        try:
            # A file that grows after the fstat is still read no further than the bound.
            data = f.read() if max_bytes is None else f.read(max_bytes + 1)
        except OSError as e:
            raise DocumentError(f"{p}: cannot be read ({e.strerror or e})") from e
    if max_bytes is not None and len(data) > max_bytes:
        raise DocumentTooLongError(p, len(data))
    if not data.strip():
        raise DocumentError(f"{p}: the file is empty")
    if b"\x00" in data[:65536]:
        raise DocumentError(f"{p}: looks like a binary file (it contains NUL bytes), not text")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DocumentError(
            f"{p}: is not UTF-8 text (invalid byte 0x{data[e.start]:02x} at offset {e.start})"
        ) from e
    return Document(
        path=p,
        text=text.removeprefix("\ufeff"),
        size_bytes=len(data),
        sha256=hashlib.sha256(data).hexdigest(),
    )


class DocumentTooLongError(DocumentError):
    """The file is larger than any text that fits the context; the caller words the refusal."""

    def __init__(self, path: Path, size_bytes: int) -> None:
        super().__init__(f"{path}: {size_bytes:,} bytes is too long")
        self.path, self.size_bytes = path, size_bytes


def _check_kind(p: Path, info: os.stat_result) -> None:
    if stat.S_ISDIR(info.st_mode):
        raise DocumentError(f"{p}: is a directory, not a text file")
    if not stat.S_ISREG(info.st_mode):
        raise DocumentError(f"{p}: is not a regular file (a pipe, device or socket), not text")
    if info.st_size == 0:
        raise DocumentError(f"{p}: the file is empty")
