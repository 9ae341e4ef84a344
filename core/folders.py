"""A folder read as a code base: every file under it in order of relative path, each after a
header line that names it, and what is left out, and why.

Left out: what git ignores (.gitignore files at any level; .git itself), hidden folders,
binary or non-UTF-8 files, files over MAX_FILE_BYTES, links that leave the folder or point at
a folder, and FIFOs, devices and sockets (never opened). A PDF or DOCX is read as its text;
HTML is read as written, the source it is in a code base.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

from pathspec import GitIgnoreSpec

from .conversion import (
    MAX_CONVERTED_FILE_BYTES,
    ExtraMissingError,
    Format,
    convert,
    format_of,
    sniff,
)
from .documents import (
    DocumentError,
    DocumentTooLongError,
    NotRegularFileError,
    NotTextError,
    Skipped,
    decode_text,
    read_bytes,
)

# A source file is rarely larger: bigger ones are data, logs or generated code (lock files,
# minified bundles) that would crowd the sources out of the context.
MAX_FILE_BYTES = 2 << 20


class Reason(StrEnum):
    """Why a file or folder is left out, as the document card counts it."""

    IGNORED = ".gitignore"
    HIDDEN = "hidden"
    BINARY = "binary"
    TOO_LARGE = "too large"
    LINK = "link"  # out of the folder, or to a folder: its files are read where they are
    SPECIAL = "not a file"  # a FIFO, device or socket
    NEEDS_EXTRA = "needs the documents extra"
    UNREADABLE = "unreadable"


def header(name: str) -> str:
    """The line before each file's text: the header `head` and `tail` print between files, a
    form models have seen around many files and that no source line looks like."""
    return f"==> {name} <=="


@dataclass
class Listing:
    """The text of the files read, each after its header, and what was left out."""

    pieces: list[str] = field(default_factory=list)
    size_bytes: int = 0
    files: list[str] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)

    def add(self, name: str, text: str, max_bytes: int | None, source: Path) -> None:
        """Add a file's text; DocumentTooLongError once all the text passes `max_bytes`."""
        piece = f"{header(name)}\n{text}" + ("" if text.endswith("\n") or not text else "\n")
        self.size_bytes += len(piece.encode()) + 1
        if max_bytes is not None and self.size_bytes > max_bytes:
            raise DocumentTooLongError(source, self.size_bytes)
        self.pieces.append(piece)
        self.files.append(name)

    def joined(self) -> str:
        return "\n".join(self.pieces)


def skip_summary(skipped: Sequence[Skipped]) -> str:
    """E.g. "skipped 3 (.gitignore 2, binary 1)"; empty when nothing was."""
    if not skipped:
        return ""
    counts = Counter(s.reason for s in skipped)
    parts = ", ".join(f"{reason} {counts[reason]}" for reason in Reason if reason in counts)
    return f"skipped {len(skipped)} ({parts})"


def read_folder(
    root: Path, listing: Listing, max_bytes: int | None = None, prefix: str = ""
) -> None:
    """Add the files under `root` to `listing`, named `prefix` + their path under root."""
    _Walk(root, listing, max_bytes, prefix).folder(root, "", ())


# (folder under the root, its .gitignore), outermost first
_Rules = tuple[tuple[str, GitIgnoreSpec], ...]


class _Walk:
    def __init__(self, root: Path, listing: Listing, max_bytes: int | None, prefix: str) -> None:
        self.root, self.listing, self.max_bytes, self.prefix = root, listing, max_bytes, prefix
        self.real_root = root.resolve()

    def skip(self, rel: str, reason: Reason) -> None:
        self.listing.skipped.append(Skipped(self.prefix + rel, reason))

    def folder(self, path: Path, rel: str, rules: _Rules) -> None:
        try:
            with os.scandir(path) as scan:
                entries = sorted(scan, key=lambda e: e.name)
        except OSError as e:
            if not rel:
                raise DocumentError(f"{path}: cannot be read ({e.strerror or e})") from e
            self.skip(rel, Reason.UNREADABLE)
            return
        if (spec := _gitignore(path / ".gitignore")) is not None:
            rules = (*rules, (rel, spec))
        for entry in entries:
            name = rel + entry.name
            is_dir = entry.is_dir(follow_symlinks=False)
            if entry.name == ".git" or (is_dir and entry.name.startswith(".")):
                self.skip(name + "/" if is_dir else name, Reason.HIDDEN)
            elif _ignored(rules, name, is_dir):
                self.skip(name + "/" if is_dir else name, Reason.IGNORED)
            elif is_dir:
                self.folder(Path(entry.path), name + "/", rules)
            elif entry.is_symlink():
                self.link(Path(entry.path), name)
            elif entry.is_file(follow_symlinks=False):
                self.file(Path(entry.path), name)
            else:
                self.skip(name, Reason.SPECIAL)

    def link(self, path: Path, name: str) -> None:
        try:
            target = path.resolve()
        except (OSError, RuntimeError):  # a loop of links
            return self.skip(name, Reason.UNREADABLE)
        if not target.is_relative_to(self.real_root) or target.is_dir():
            self.skip(name, Reason.LINK)
        else:
            self.file(path, name)

    def file(self, path: Path, name: str) -> None:
        fmt = format_of(path)
        fmt = None if fmt is Format.HTML else fmt
        try:
            data = read_bytes(path, MAX_CONVERTED_FILE_BYTES if fmt else MAX_FILE_BYTES)
            fmt = fmt or sniff(data)
            text = convert(path, data, fmt) if fmt else decode_text(path, data)
        except DocumentTooLongError:
            return self.skip(name, Reason.TOO_LARGE)
        except NotRegularFileError:
            return self.skip(name, Reason.SPECIAL)
        except NotTextError:
            return self.skip(name, Reason.BINARY)
        except ExtraMissingError:
            return self.skip(name, Reason.NEEDS_EXTRA)
        except DocumentError:
            return self.skip(name, Reason.UNREADABLE)
        self.listing.add(self.prefix + name, text, self.max_bytes, self.root)


def _gitignore(path: Path) -> GitIgnoreSpec | None:
    try:
        lines = decode_text(path, read_bytes(path, MAX_FILE_BYTES)).splitlines()
    except DocumentError:
        return None  # missing or unusable: it ignores nothing
    try:
        return GitIgnoreSpec.from_lines(lines)
    except ValueError:  # git skips a pattern it cannot parse and keeps the others
        return GitIgnoreSpec.from_lines(line for line in lines if _parses(line))


def _parses(line: str) -> bool:
    try:
        GitIgnoreSpec.from_lines([line])
    except ValueError:
        return False
    return True


def _ignored(rules: _Rules, name: str, is_dir: bool) -> bool:
    """Whether git ignores `name`: the deepest .gitignore with a pattern for it decides, as
    its last matching pattern says."""
    for base, spec in reversed(rules):
        result = spec.check_file(name.removeprefix(base) + ("/" if is_dir else ""))
        if result.include is not None:
            return result.include
    return False
