"""Reading the long text a user wants to question, with clear refusals for what is not text."""

from __future__ import annotations

import hashlib
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


def read_document(path: str | Path) -> Document:
    """Read a UTF-8 text file whole; refuse a missing, empty, directory or binary file."""
    p = Path(path).expanduser()
    if not p.exists():
        raise DocumentError(f"{p}: no such file")
    if p.is_dir():
        raise DocumentError(f"{p}: is a directory, not a text file")
    try:
        data = p.read_bytes()
    except OSError as e:
        raise DocumentError(f"{p}: cannot be read ({e.strerror or e})") from e
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
