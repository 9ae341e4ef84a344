"""What a user points kvchat at, read as one document: a text file; a PDF, DOCX or HTML file
(core/conversion.py); a folder (core/folders.py); standard input, "-"; or several of these,
each file then after a header line, as in a folder. All of the text is bounded by max_bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import BinaryIO

from .conversion import (
    MAX_CONVERTED_FILE_BYTES,
    Format,
    convert,
    format_of,
    require_converter,
    sniff,
)
from .documents import (
    Document,
    DocumentError,
    DocumentTooLongError,
    check_document,
    decode_text,
    read_bounded,
    read_bytes,
    sha256_of,
)
from .folders import Listing, read_folder, skip_summary

STDIN = "-"
STDIN_NAME = "stdin"


def check_sources(paths: Sequence[str | Path]) -> None:
    """Refuse, without reading anything, what cannot be a document: no path, "-" twice, a
    missing path, a file that check_document refuses, a format whose extra is missing."""
    if not paths:
        raise DocumentError("no document given")
    if sum(str(path) == STDIN for path in paths) > 1:
        raise DocumentError("-: standard input can be read only once")
    for path in paths:
        if str(path) == STDIN or _is_folder(path):
            continue
        p = check_document(path)
        if (fmt := format_of(p)) is not None:
            require_converter(p, fmt)


def read_sources(
    paths: Sequence[str | Path], max_bytes: int | None = None, stdin: BinaryIO | None = None
) -> Document:
    """The document `paths` make: one file's text as it is, or the files of a folder or of
    several paths, each after its header line. `stdin` is what "-" reads (None: "-" is
    refused). DocumentTooLongError as soon as the text passes `max_bytes`."""
    check_sources(paths)
    if len(paths) == 1 and not _is_folder(paths[0]):
        p = Path(paths[0]).expanduser()
        text, data = _stdin_text(stdin, max_bytes) if str(p) == STDIN else _file_text(p, max_bytes)
        name = STDIN_NAME if str(p) == STDIN else p.name
        return Document((p,), name, text, len(data), sha256_of(data))
    listing = Listing()
    for path in paths:
        p = Path(path).expanduser()
        if _is_folder(path):
            read_folder(p, listing, max_bytes, "" if len(paths) == 1 else _folder_prefix(path))
        elif str(p) == STDIN:
            listing.add(STDIN_NAME, _stdin_text(stdin, max_bytes)[0], max_bytes, p)
        else:
            listing.add(str(path), _file_text(p, max_bytes)[0], max_bytes, p)
    first = Path(paths[0]).expanduser()
    if not listing.files:
        summary = skip_summary(listing.skipped)
        raise DocumentError(f"{first}: no file to read in it" + (f"; {summary}" if summary else ""))
    text = listing.joined()
    data = text.encode()
    return Document(
        tuple(Path(path).expanduser() for path in paths),
        _name(paths),
        text,
        len(data),
        sha256_of(data),
        tuple(listing.files),
        tuple(listing.skipped),
    )


def _name(paths: Sequence[str | Path]) -> str:
    """A folder's name with a slash; the first path's and how many more, for several."""
    first = Path(paths[0]).expanduser()
    name = STDIN_NAME if str(first) == STDIN else first.resolve().name or str(first)
    name += "/" if _is_folder(first) and not name.endswith("/") else ""
    return name if len(paths) == 1 else f"{name} and {len(paths) - 1} more"


def _is_folder(path: str | Path) -> bool:
    return str(path) != STDIN and Path(path).expanduser().is_dir()


def _folder_prefix(path: str | Path) -> str:
    return str(path).rstrip("/") + "/"


def _file_text(p: Path, max_bytes: int | None) -> tuple[str, bytes]:
    """The text of the file at `p` (converted, for PDF, DOCX and HTML) and its bytes."""
    fmt = format_of(p)
    data = read_bytes(p, MAX_CONVERTED_FILE_BYTES if fmt else max_bytes)
    return _text(p, data, fmt or sniff(data), max_bytes), data


def _stdin_text(stream: BinaryIO | None, max_bytes: int | None) -> tuple[str, bytes]:
    p = Path(STDIN)
    if stream is None:
        raise DocumentError("-: there is no standard input to read here")
    data = read_bounded(stream, p, max_bytes, "standard input cannot be read")
    if not data.strip():
        raise DocumentError("-: standard input is empty")
    return _text(p, data, sniff(data), max_bytes), data


def _text(p: Path, data: bytes, fmt: Format | None, max_bytes: int | None) -> str:
    if not data.strip():
        raise DocumentError(f"{p}: the file is empty")
    if fmt is None:
        return decode_text(p, data)  # within max_bytes: the read is bounded
    text = convert(p, data, fmt)
    if not text.strip():
        scan = " (a scan: images of text, which only OCR reads)" if fmt is Format.PDF else ""
        raise DocumentError(f"{p}: holds no text{scan}")
    if max_bytes is not None and len(text.encode()) > max_bytes:
        raise DocumentTooLongError(p, len(text.encode()))
    return text
