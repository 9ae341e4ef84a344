"""Reading one text file a user wants to question, with clear refusals for what is not text.

Folders, standard input, several paths and PDF, DOCX or HTML files are core/sources.py's;
it builds on the pieces here.
"""

from __future__ import annotations

import hashlib
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from .errors import UserError

# git's binary test looks at the first 8000 bytes; a longer look costs nothing next to a read.
BINARY_PROBE_BYTES = 65536


class DocumentError(UserError, ValueError):
    """The file cannot be used as a document; the message says why, naming the file."""


class NotRegularFileError(DocumentError):
    """A FIFO, a device or a socket: reading one can block or never end."""


class NotTextError(DocumentError):
    """A binary file, or one that is not UTF-8."""


@dataclass(frozen=True)
class Skipped:
    """A file or folder that a folder holds and the document leaves out."""

    path: str  # as its header line would name it; a folder's ends in /
    reason: str


@dataclass(frozen=True)
class Document:
    paths: tuple[Path, ...]  # as given: files, folders, or "-" for standard input
    name: str  # what the chat calls it
    text: str
    size_bytes: int
    sha256: str  # of the bytes read: tells whether the source changed since it was read
    files: tuple[str, ...] = ()  # with header lines (a folder, several paths): the files read
    skipped: tuple[Skipped, ...] = ()

    @property
    def path(self) -> Path:
        """The path read; the first, when several are."""
        return self.paths[0]


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
    _check_regular(p, info)
    if info.st_size == 0:
        raise DocumentError(f"{p}: the file is empty")
    return p


def read_bytes(path: Path, max_bytes: int | None = None) -> bytes:
    """The bytes of the regular file at `path`; a file of more than `max_bytes` is refused
    (DocumentTooLongError) before it is read."""
    try:
        # O_NONBLOCK: opening a FIFO swapped in after a check returns at once, and the
        # fstat below refuses it; on a regular file the flag changes nothing.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise DocumentError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise DocumentError(f"{path}: is a directory, not a text file") from None
    except OSError as e:
        raise DocumentError(f"{path}: cannot be read ({e.strerror or e})") from e
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(fd)
        _check_regular(path, info)
        if max_bytes is not None and info.st_size > max_bytes:
            raise DocumentTooLongError(path, info.st_size)
        # A file that grows after the fstat is still read no further than the bound.
        return read_bounded(f, path, max_bytes, "cannot be read")


def read_bounded(stream: BinaryIO, path: Path, max_bytes: int | None, failure: str) -> bytes:
    """What `stream` holds, refused (DocumentTooLongError) past `max_bytes` without reading
    further; a read error becomes a DocumentError saying `failure`."""
    try:
        data = stream.read() if max_bytes is None else stream.read(max_bytes + 1)
    except OSError as e:
        raise DocumentError(f"{path}: {failure} ({e.strerror or e})") from e
    if max_bytes is not None and len(data) > max_bytes:
        raise DocumentTooLongError(path, len(data))
    return data


def decode_text(path: Path, data: bytes) -> str:
    """`data` as text, without a byte order mark; NotTextError for a binary or non-UTF-8
    file."""
    if b"\x00" in data[:BINARY_PROBE_BYTES]:
        raise NotTextError(f"{path}: looks like a binary file (it contains NUL bytes), not text")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise NotTextError(
            f"{path}: is not UTF-8 text (invalid byte 0x{data[e.start]:02x} at offset {e.start})"
        ) from e
    return text.removeprefix("\ufeff")


def read_document(path: str | Path, max_bytes: int | None = None) -> Document:
    """Read a UTF-8 text file whole; refuse what check_document refuses, a binary file, and
    (before reading it) a file of more than `max_bytes`."""
    p = Path(path).expanduser()
    data = read_bytes(p, max_bytes)
    if not data.strip():
        raise DocumentError(f"{p}: the file is empty")
    return Document((p,), p.name, decode_text(p, data), len(data), sha256_of(data))


def sha256_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class DocumentTooLongError(DocumentError):
    """The text is larger than any that fits the context; the caller words the refusal."""

    def __init__(self, path: Path, size_bytes: int) -> None:
        super().__init__(f"{path}: {size_bytes:,} bytes is too long")
        self.path, self.size_bytes = path, size_bytes


def _check_regular(p: Path, info: os.stat_result) -> None:
    if stat.S_ISDIR(info.st_mode):
        raise DocumentError(f"{p}: is a directory, not a text file")
    if not stat.S_ISREG(info.st_mode):
        raise NotRegularFileError(
            f"{p}: is not a regular file (a pipe, device or socket), not text"
        )
