"""KV snapshots on disk: a long prefill saved once and loaded instead of computed again.

A snapshot holds a session's cache (whatever the backend exports: block store in its kv_type,
anchors, sinks, local window), the token ids it holds, the logits after the last of them, and
a header that says which model and which cache settings made it. Lookup is by token prefix:
a prompt whose first n tokens are a snapshot's n tokens (same model, same settings) starts
from the snapshot and prefills only the rest.

File format (version 1), little-endian, one file per snapshot, named `<id>.kvsnap`:

    offset 0   8 bytes   magic b"KVCHATSS"
           8   u32       format version (1)
          12   u32       CRC-32 of the header bytes
          16   u64       header length H (at most 64 MiB)
          24   H bytes   header: UTF-8 JSON
     then the sections, each at a multiple of 64 bytes, zero bytes between them

The header holds: format, cache_algorithm (`CACHE_ALGORITHM_VERSION`), created (UTC), model
{id, name}, settings (`cache_settings`), tokens (count), tokens_sha256 (of the ids as int32),
prefill_tok_s (the speed of the prefill the snapshot replaces, for estimates), scalars (the
cache's positions and counts; `length`, when there, is the token count), sections (name,
dtype, shape, offset, nbytes, crc32 as 8 hex digits) and file_size. The sections are `tokens`
(int32, one per token), `logits` (float32, one row: after the last token) and
`cache.<layer>.<part>`, one per tensor the backend exports (kv/state.py), each raw
little-endian bytes in C order. A header is checked field by field before anything in it is
used, so a damaged or hostile file is refused, never trusted.
Sections are aligned so a loader maps the file and views each section in place (no second
copy in memory), and checksums are CRC-32 because zlib's runs at several GB/s, a small cost
next to the prefill a snapshot replaces.

A snapshot is written to a temporary file in the same folder, fsynced and renamed, so a crash
never leaves a partial file under a snapshot's name. Snapshots hold the text of documents, so
the folder is mode 0700 and every file in it 0600, whatever the umask. A file that fails a
check is never used: a damaged one (bad header, truncated, bad checksum) is deleted; one from
another model, other settings or another kvchat version is kept for them; one that cannot be
read (permissions, I/O error) is skipped and kept; all are reported as warnings and the caller
prefills. A file that cannot be deleted (a read-only folder) is reported, never raised.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import math
import mmap
import os
import shutil
import struct
import tempfile
import threading
import time
import weakref
import zlib
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch

from kvchat.config import AttentionMode, LongContextSettings, PositionMode
from kvchat.config.home import Place, folder_for, private_folder
from kvchat.kv import host_pages
from kvchat.kv.sparse import RETUNABLE
from kvchat.kv.state import CacheState

from .errors import UserError
from .gguf_header import read_gguf_header
from .model_config import ModelConfig
from .terminal_text import terminal_safe
from .units import format_size

FORMAT_VERSION = 2
# What a prefill leaves in a cache and how a backend exports it (kv/sparse/cache.py, kv/dense.py,
# kv/state.py); bump it whenever either changes. A snapshot of another version has another
# key and is never loaded into this version's cache.
CACHE_ALGORITHM_VERSION = 1
MAGIC = b"KVCHATSS"
SUFFIX = ".kvsnap"
ALIGN = 64
_PREAMBLE = struct.Struct("<8sIIQ")  # magic, version, header CRC-32, header length
_CHUNK = 64 << 20  # bytes per write / checksum call: bounded temporaries, progress between
# Written bytes are flushed to disk this often, so that the closing fsync of a snapshot of
# gigabytes does not hold the writer for tens of seconds with no progress to show.
_SYNC_BYTES = 256 << 20
_STALE_TEMP_S = 600  # a temp file untouched this long belongs to a writer that died
_MAX_HEADER = 64 << 20  # a longer header is damage, refused before it is read
_MAX_DEPTH = 16  # nesting of the header's JSON; the format's own is 4
_MAX_DIMS = 8  # dimensions of a section's shape
_DTYPES = {
    str(t).removeprefix("torch."): t
    for t in (torch.float32, torch.float16, torch.bfloat16, torch.float64)
    + (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
}
# Capacity and threads do not change what a prefill computes, and a built cache takes new
# RETUNABLE values at any time (Engine.apply_settings), so a snapshot does not pin them.
_NOT_SHAPING = ("max_seq_len", "threads_num", *RETUNABLE)
_HEADER_TYPES = {
    "format": int,
    "cache_algorithm": int,
    "created": str,
    "model": dict,
    "settings": dict,
    "tokens": int,
    "tokens_sha256": str,
    "scalars": dict,
    "sections": list,
    "file_size": int,
}

log = logging.getLogger(__name__)


class SnapshotError(UserError, ValueError):
    """A snapshot cannot be written, found or removed; the message says why."""


class _Damaged(Exception):
    """The file under a snapshot's name is not a whole, valid snapshot."""


class _OtherFormat(_Damaged):
    """A snapshot in a format another kvchat version writes: left alone."""


def snapshot_dir() -> Path:
    return folder_for(Place.CACHE) / "snapshots"


def cache_settings(
    lc: LongContextSettings,
    position_mode: PositionMode,
    dtype: str,
    weight_format: str,
    cfg: ModelConfig,
) -> dict[str, object]:
    """The settings that decide what a prefill puts in the cache: a snapshot is used only
    when every one of them is the same now."""
    shaping: dict[str, object] = {
        "attention": lc.attention,
        "position_mode": position_mode,
        "dtype": dtype,
        "weight_format": weight_format,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": asdict(cfg.rope_scaling),
    }
    if lc.attention == AttentionMode.SPARSE:
        for name, value in asdict(lc).items():
            if name not in _NOT_SHAPING and name not in shaping:
                shaping[name] = value
    return shaping


def tokens_digest(ids: Sequence[int]) -> str:
    return hashlib.sha256(np.asarray(ids, dtype="<i4").tobytes()).hexdigest()


# -- model identity ---------------------------------------------------------------------------


def model_identity(source: Path) -> str:
    """A digest of the model's metadata and tensor table (GGUF: key/values and tensor infos;
    Hugging Face folder: config.json and the safetensors headers), of the file sizes, and of a
    few small samples of the weights, so a fine-tune with identical headers differs too.
    Reads a few MB at most, never the whole weights."""
    source = Path(source)
    if source.is_dir():
        digest = hashlib.sha256(b"hf\0")
        digest.update((source / "config.json").read_bytes())
        for path in sorted(source.glob("*.safetensors")):
            digest.update(path.name.encode() + b"\0")
            digest.update(_weights_file_digest(path, _safetensors_header_end(path)))
        return digest.hexdigest()
    stat = source.stat()
    return _gguf_identity(str(source.resolve()), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _gguf_identity(path: str, size: int, mtime_ns: int) -> str:
    # Keyed on size and mtime too, so a file replaced in place is hashed again.
    end = read_gguf_header(Path(path)).end
    return hashlib.sha256(b"gguf\0" + _weights_file_digest(Path(path), end)).hexdigest()


def _weights_file_digest(path: Path, header_end: int, samples: int = 16) -> bytes:
    """sha256 of the header bytes, the file size and `samples` 4 KiB pieces of the data."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        size = os.fstat(f.fileno()).st_size
        digest.update(struct.pack("<QQ", size, header_end))
        digest.update(f.read(header_end))
        span = max(size - header_end, 0)
        for i in range(samples):
            f.seek(header_end + span * i // samples)
            digest.update(f.read(4096))
    return digest.digest()


def _safetensors_header_end(path: Path) -> int:
    with path.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
    return 8 + length


# -- what callers see -------------------------------------------------------------------------


@dataclass(frozen=True)
class SnapshotInfo:
    """One snapshot file as listed: from its header, or why the header is unusable."""

    id: str
    path: Path
    size_bytes: int
    last_used: float  # the file's mtime, refreshed on every use (LRU eviction order)
    tokens: int = 0
    model_id: str = ""
    model_name: str = ""
    settings: dict[str, object] = field(default_factory=dict)
    prefill_tok_s: float | None = None  # speed of the prefill it replaces, for estimates
    created: str = ""
    header: dict = field(default_factory=dict, repr=False)
    problem: str | None = None  # set when the file cannot be used at all
    damaged: bool = False  # the problem is damage (not another format version)

    @property
    def kv_type(self) -> str:
        if self.settings.get("attention") == AttentionMode.DENSE:
            return f"dense {self.settings.get('dtype', '?')}"
        return str(self.settings.get("kv_type", "?"))


@dataclass(frozen=True)
class LoadedSnapshot:
    """A verified snapshot, its tensors mapped from the file (views, not copies)."""

    info: SnapshotInfo
    tokens: list[int]
    logits: torch.Tensor
    state: CacheState


@dataclass(frozen=True)
class Lookup:
    snapshot: LoadedSnapshot | None
    warnings: tuple[str, ...] = ()


@dataclass(frozen=True)
class PrefillReport:
    """What one prefill did: tokens computed, a snapshot loaded or saved, and warnings about
    snapshots that could not be used. Front ends show it (CLI: stderr; app: notifications)."""

    prefilled: int = 0
    restored: SnapshotInfo | None = None
    restore_seconds: float = 0.0
    saved: SnapshotInfo | None = None
    warnings: tuple[str, ...] = ()

    def describe_restore(self) -> str | None:
        """e.g. "loaded 32,768 tokens from snapshot 3f2a9c1e in 0.4 s (prefill would take
        ~2 min)"; None when no snapshot was used."""
        info = self.restored
        if info is None:
            return None
        text = (
            f"loaded {info.tokens:,} tokens from snapshot {info.id} in {self.restore_seconds:.1f} s"
        )
        if info.prefill_tok_s:
            text += f" (prefill would take ~{format_duration(info.tokens / info.prefill_tok_s)})"
        return text


def format_duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


# -- the store --------------------------------------------------------------------------------


def cap_bytes(max_gib: float) -> int | None:
    """cache.snapshot_max_gib in bytes; None for 0, the cap that follows the disk."""
    return None if max_gib == 0 else int(max_gib * 2**30)


class SnapshotStore:
    """The snapshot files of one folder, at most `max_bytes` in all (least recently used go).
    `max_bytes` None: half of the disk space the snapshots could use (what they take now plus
    what is free), so they never take more than half of the free disk."""

    def __init__(self, directory: Path, max_bytes: int | None) -> None:
        self.directory = Path(directory)
        self.max_bytes = max_bytes

    def cap(self) -> int:
        """The bytes the snapshots may take in all, now."""
        if self.max_bytes is not None:
            return self.max_bytes
        return (self.total_bytes() + shutil.disk_usage(_existing(self.directory)).free) // 2

    def describe_cap(self) -> str:
        if self.max_bytes is not None:
            return f"{format_size(self.max_bytes)} (cache.snapshot_max_gib)"
        return (
            f"{format_size(self.cap())} (half of the disk space they could use; "
            "cache.snapshot_max_gib sets a fixed cap)"
        )

    # listing and removal
    def entries(self) -> list[SnapshotInfo]:
        """Every snapshot file, most recently used first; unreadable ones say why."""
        found = [self._read_info(p) for p in _listing(self.directory, f"*{SUFFIX}")]
        return sorted(found, key=lambda info: info.last_used, reverse=True)

    def remove(self, prefix: str) -> SnapshotInfo:
        """Delete the one snapshot whose id starts with `prefix`."""
        matches = [i for i in self.entries() if prefix and i.id.startswith(prefix)]
        if len(matches) != 1:
            what = "no snapshot" if not matches else f"{len(matches)} snapshots"
            raise SnapshotError(
                f"{what} with an id starting with {prefix!r} in {self.directory} "
                "(see `kvchat cache list`)"
            )
        error = _delete(matches[0].path)
        if error is not None:
            raise SnapshotError(f"cannot delete snapshot {matches[0].id}: {error}")
        return matches[0]

    def clear(self) -> list[SnapshotInfo]:
        """Delete every snapshot, and temporary files that writers left behind; returns the
        snapshots deleted (one that cannot be is logged and kept)."""
        removed = [info for info in self.entries() if _delete(info.path) is None]
        for tmp in self._temp_files():
            _delete(tmp)
        return removed

    def total_bytes(self) -> int:
        return sum(info.size_bytes for info in self.entries())

    # saving
    def save(
        self,
        state: CacheState,
        tokens: Sequence[int],
        logits: torch.Tensor,
        model_id: str,
        model_name: str,
        settings: dict[str, object],
        prefill_tok_s: float | None = None,
        on_progress: Callable[[int, int], None] | None = None,
        cancel: threading.Event | None = None,
    ) -> SnapshotInfo:
        """Write a snapshot (or refresh the identical one already there) and return it.

        Makes room first by deleting the least recently used snapshots; refuses, before
        writing anything, a snapshot larger than the cap or than the free disk space.
        `on_progress(bytes written, file size)` follows the write; `cancel` stops it, leaving
        no file (SnapshotError).
        """
        if not tokens:
            raise SnapshotError("nothing to save: the cache holds no tokens")
        token_hash = tokens_digest(tokens)
        snap_id = _snapshot_id(model_id, settings, token_hash)
        path = self.directory / f"{snap_id}{SUFFIX}"
        existing = self._read_info(path) if path.exists() else None
        if existing is not None and existing.problem is None:
            os.utime(path)
            return self._read_info(path)
        sections = [
            ("tokens", torch.tensor(list(tokens), dtype=torch.int32)),
            ("logits", logits.detach().float().reshape(-1)),
            *((f"cache.{name}", t) for name, t in state.tensors.items()),
        ]
        header = {
            "format": FORMAT_VERSION,
            "cache_algorithm": CACHE_ALGORITHM_VERSION,
            "created": datetime.now(UTC).isoformat(timespec="seconds"),
            "model": {"id": model_id, "name": model_name},
            "settings": settings,
            "tokens": len(tokens),
            "tokens_sha256": token_hash,
            "prefill_tok_s": prefill_tok_s,
            "scalars": dict(state.scalars),
        }
        header = _layout(header, sections)
        size = header["file_size"]
        cap = self.cap()
        if size > cap:
            raise SnapshotError(
                f"the snapshot would take {format_size(size)}, more than the snapshots may "
                f"take: {self.describe_cap()}"
            )
        private_folder(self.directory)
        self._make_room(size, cap)
        free = shutil.disk_usage(self.directory).free
        if size > free:
            raise SnapshotError(
                f"the snapshot would take {format_size(size)} but {self.directory} has "
                f"{format_size(free)} free"
            )
        _write_atomically(path, header, sections, on_progress, cancel)
        return self._read_info(path)

    def _make_room(self, incoming: int, cap: int) -> None:
        entries = self.entries()  # most recently used first
        total = sum(info.size_bytes for info in entries)
        while entries and total + incoming > cap:
            victim = entries.pop()
            if _delete(victim.path) is None:
                total -= victim.size_bytes
        now = time.time()
        for tmp in self._temp_files():
            with contextlib.suppress(OSError):
                if now - tmp.stat().st_mtime > _STALE_TEMP_S:
                    tmp.unlink()

    def _temp_files(self) -> list[Path]:
        return _listing(self.directory, f".*{SUFFIX}.*.tmp")

    # lookup and loading
    def find(
        self,
        ids: Sequence[int],
        model_id: str,
        settings: dict[str, object],
        longer_than: int = 0,
    ) -> Lookup:
        """The longest valid snapshot whose tokens start `ids` and hold more than
        `longer_than` tokens, verified and mapped; warnings for every snapshot of these tokens
        that cannot be used (the damaged ones are deleted, unreadable ones kept)."""
        warnings: list[str] = []
        digests: dict[int, str] = {}
        usable: list[SnapshotInfo] = []
        for info in self.entries():
            if info.damaged:
                warnings.append(_discard(info, info.problem or "unreadable"))
            if info.problem is not None:
                continue
            n = info.tokens
            if n <= longer_than or n > len(ids):
                continue
            if n not in digests:
                digests[n] = tokens_digest(ids[:n])
            if digests[n] != info.header.get("tokens_sha256"):
                continue  # a snapshot of another text
            if info.model_id != model_id:
                warnings.append(
                    f"snapshot {info.id} of these {n:,} tokens was made with another model "
                    f"({info.model_name or 'unknown'}, id {info.model_id[:12]}); ignored"
                )
                continue
            differences = _differences(info.settings, settings)
            if differences:
                warnings.append(
                    f"snapshot {info.id} of these {n:,} tokens was made with other cache "
                    f"settings ({differences}); ignored"
                )
                continue
            usable.append(info)
        for info in sorted(usable, key=lambda i: i.tokens, reverse=True):
            try:
                loaded = _load(info)
            except _Damaged as e:
                warnings.append(_discard(info, str(e)))
                continue
            except OSError as e:  # the file may be good: kept for when it can be read
                warnings.append(f"snapshot {info.id} cannot be read ({e}); skipped")
                continue
            if loaded.tokens != list(ids[: info.tokens]):
                warnings.append(_discard(info, "its token ids differ from its header's digest"))
                continue
            with contextlib.suppress(OSError):
                os.utime(info.path)
            return Lookup(loaded, tuple(warnings))
        return Lookup(None, tuple(warnings))

    def _read_info(self, path: Path) -> SnapshotInfo:
        snap_id = path.name.removesuffix(SUFFIX)
        try:
            stat = path.stat()
        except OSError as e:
            return SnapshotInfo(snap_id, path, 0, 0.0, problem=f"cannot be read ({e})")
        base = SnapshotInfo(snap_id, path, stat.st_size, stat.st_mtime)
        try:
            header = _read_header(path)
        except _Damaged as e:
            return replace(base, problem=str(e), damaged=not isinstance(e, _OtherFormat))
        except OSError as e:  # the file may be good: kept for when it can be read
            log.warning("snapshot %s cannot be read (%s); skipped", snap_id, e)
            return replace(base, problem=f"cannot be read ({e})")
        return replace(
            base,
            tokens=header["tokens"],
            model_id=header["model"]["id"],
            model_name=terminal_safe(header["model"]["name"]),  # listed and warned about
            settings=header["settings"],
            prefill_tok_s=header.get("prefill_tok_s"),
            created=header["created"],
            header=header,
        )


def _existing(path: Path) -> Path:
    """`path`, or its nearest parent that exists (a folder not made yet has its disk's space)."""
    while not path.exists() and path.parent != path:
        path = path.parent
    return path


def _listing(directory: Path, pattern: str) -> list[Path]:
    """The files in `directory` matching `pattern`; none when the folder cannot be read."""
    try:
        return list(directory.glob(pattern)) if directory.is_dir() else []
    except OSError as e:
        log.warning("cannot list %s (%s)", directory, e)
        return []


def _delete(path: Path) -> str | None:
    """Delete a file; None when it is gone, else why it cannot be (a read-only folder)."""
    try:
        path.unlink(missing_ok=True)
    except OSError as e:
        log.warning("cannot delete %s (%s)", path, e)
        return str(e)
    return None


def _discard(info: SnapshotInfo, why: str) -> str:
    """Delete a damaged snapshot (it can never be used) and say so."""
    error = _delete(info.path)
    done = "deleted it" if error is None else f"cannot delete it ({error})"
    return f"snapshot {info.id} is damaged ({why}); {done}"


def _differences(saved: dict[str, object], now: dict[str, object]) -> str:
    keys = [k for k in dict.fromkeys([*saved, *now]) if saved.get(k) != now.get(k)]
    return ", ".join(f"{k} {_show(saved.get(k))}, now {_show(now.get(k))}" for k in keys)


def _show(value: object) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {v}" for k, v in value.items()) + "}"
    return "none" if value is None else str(value)


def _snapshot_id(model_id: str, settings: dict[str, object], token_hash: str) -> str:
    # The versions are part of the key: a snapshot of another layout is never the same file.
    versions = [FORMAT_VERSION, CACHE_ALGORITHM_VERSION]
    key = json.dumps([*versions, model_id, settings, token_hash], sort_keys=True).encode()
    return hashlib.sha256(key).hexdigest()[:16]


# -- the file ---------------------------------------------------------------------------------


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _rows(shape: list[int], nbytes: int) -> tuple[int, int]:
    """A section's rows (its first dimension) and the bytes of each."""
    rows = shape[0] if shape else 1
    return rows, (nbytes // rows if rows else 0)


def _pitch(t: torch.Tensor) -> int:
    """The bytes from one row of `t` to the next in the file: the row's size, plus a gap that
    puts every row at the same place in a page as it is in memory when the rows are strided
    (a cache's blocks per KV head), so a restore into the same layout can map the file's pages
    instead of copying them."""
    row = t[0].numel() * t.element_size() if t.dim() else t.element_size()
    if t.dim() < 2 or t.shape[0] < 2 or row < host_pages.PAGE or not t[0].is_contiguous():
        return row
    stride = t.stride(0) * t.element_size()
    return row + (stride - row) % host_pages.PAGE if stride > row else row


def _start(offset: int, t: torch.Tensor) -> int:
    """The first aligned offset from `offset` where a section of `t` starts at the same place
    in a page as `t` does in memory (just aligned for sections under a page)."""
    offset = _align(offset)
    at = t.data_ptr() % host_pages.PAGE
    if t.numel() * t.element_size() < host_pages.PAGE or at % ALIGN:
        return offset
    return offset + (at - offset) % host_pages.PAGE


def _end(entry: dict) -> int:
    rows, row = _rows(entry["shape"], entry["nbytes"])
    return entry["offset"] + (rows - 1) * entry["pitch"] + row if rows and row else entry["offset"]


def _layout(header: dict, sections: list[tuple[str, torch.Tensor]]) -> dict:
    """The header with every section's offset and the file's size filled in. CRCs are written
    as 8 hex digits whatever their value, so the header's length is final before the data."""
    table = [
        {
            "name": name,
            "dtype": str(t.dtype).removeprefix("torch."),
            "shape": list(t.shape),
            "offset": 0,
            "pitch": _pitch(t),
            "nbytes": t.numel() * t.element_size(),
            "crc32": "00000000",
        }
        for name, t in sections
    ]
    for entry in table:
        if entry["dtype"] not in _DTYPES:
            raise SnapshotError(f"section {entry['name']}: dtype {entry['dtype']} not supported")
    header = {**header, "sections": table, "file_size": 0}
    # The offsets depend on the header's length, which depends on the offsets' digits.
    length = -1
    while length != (encoded := len(_encode(header))):
        length = encoded
        offset = _PREAMBLE.size + length
        for entry, (_, t) in zip(table, sections, strict=True):
            entry["offset"] = _start(offset, t)
            offset = _end(entry)
        header["file_size"] = offset
    return header


def _encode(header: dict) -> bytes:
    return json.dumps(header, separators=(",", ":"), sort_keys=True).encode()


def _write_atomically(
    path: Path,
    header: dict,
    sections: list[tuple[str, torch.Tensor]],
    on_progress: Callable[[int, int], None] | None = None,
    cancel: threading.Event | None = None,
) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o600)  # the owner's alone, whatever the umask
            f.seek(header["sections"][0]["offset"])
            for entry, (_, tensor) in zip(header["sections"], sections, strict=True):
                crc = _write_section(f, entry, tensor, header["file_size"], on_progress, cancel)
                entry["crc32"] = f"{crc:08x}"
            if f.tell() != header["file_size"]:
                raise SnapshotError(f"wrote {f.tell()} bytes, expected {header['file_size']}")
            encoded = _encode(header)
            f.seek(0)
            f.write(_PREAMBLE.pack(MAGIC, FORMAT_VERSION, zlib.crc32(encoded), len(encoded)))
            f.write(encoded)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # makes the rename durable where the OS allows it
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def _write_section(
    f: BinaryIO,
    entry: dict,
    tensor: torch.Tensor,
    size: int,
    on_progress: Callable[[int, int], None] | None,
    cancel: threading.Event | None,
) -> int:
    """Write a section's rows at their offsets (zeros in the gaps); returns its CRC-32."""
    _, row = _rows(entry["shape"], entry["nbytes"])
    crc = 0
    for i, part in enumerate(tensor if entry["pitch"] != row else [tensor]):
        f.write(b"\0" * (entry["offset"] + i * entry["pitch"] - f.tell()))
        for piece in _byte_pieces(part):
            start = f.tell()
            f.write(piece)
            crc = zlib.crc32(piece, crc)
            if cancel is not None and cancel.is_set():
                raise SnapshotError("stopped before it was written whole")
            if start // _SYNC_BYTES != f.tell() // _SYNC_BYTES:
                f.flush()
                os.fsync(f.fileno())
            if on_progress is not None:
                on_progress(f.tell(), size)
    return crc


def _byte_pieces(t: torch.Tensor) -> Iterator[np.ndarray]:
    """The tensor's bytes in C order, as uint8 arrays of at most _CHUNK bytes, without copying
    a strided tensor whole (each contiguous sub-tensor is read in place; a strided one that
    fits in a piece is copied)."""
    if t.numel() == 0:
        return
    if not t.is_contiguous() and t.numel() * t.element_size() <= _CHUNK:
        t = t.contiguous()
    if not t.is_contiguous():
        for sub in t:
            yield from _byte_pieces(sub)
        return
    data = t.detach().cpu().reshape(-1).view(torch.uint8).numpy()
    for start in range(0, len(data), _CHUNK):
        yield data[start : start + _CHUNK]


def _read_header(path: Path) -> dict:
    """The checked header of the file at `path`. Raises _Damaged for a file that is not a whole,
    valid snapshot, _OtherFormat for another version's, OSError when it cannot be read."""
    with path.open("rb") as f:
        preamble = f.read(_PREAMBLE.size)
        if len(preamble) < _PREAMBLE.size:
            raise _Damaged(f"truncated: {len(preamble)} bytes")
        magic, version, crc, length = _PREAMBLE.unpack(preamble)
        if magic != MAGIC:
            raise _Damaged("not a kvchat snapshot (bad magic)")
        if version != FORMAT_VERSION:
            raise _OtherFormat(
                f"format {version} (another kvchat version; this one reads {FORMAT_VERSION})"
            )
        if length > _MAX_HEADER:
            raise _Damaged(f"a header of {length:,} bytes, more than {_MAX_HEADER:,}")
        size = os.fstat(f.fileno()).st_size
        if _PREAMBLE.size + length > size:
            raise _Damaged(f"truncated: {size} bytes, the header alone needs more")
        encoded = f.read(length)
    if zlib.crc32(encoded) != crc:
        raise _Damaged("the header fails its checksum")
    try:
        header = _parse_header(encoded)
    except (ValueError, TypeError, KeyError, RecursionError) as e:
        raise _Damaged(f"unreadable header: {e}") from e
    expected = header["file_size"]
    if expected != size:
        what = "truncated" if size < expected else "wrong size"
        raise _Damaged(f"{what}: {size:,} bytes, the header says {expected:,}")
    return header


def _parse_header(encoded: bytes) -> dict:
    """The header JSON, every field checked for type and range, so nothing downstream meets a
    value it does not expect. Raises ValueError for a bad one, _OtherFormat for a header of
    another cache algorithm."""
    header = json.loads(encoded)
    if not isinstance(header, dict):
        raise ValueError("not a JSON object")
    algorithm = header.get("cache_algorithm")
    if algorithm != CACHE_ALGORITHM_VERSION:
        shown = algorithm if type(algorithm) is int else "unknown"
        raise _OtherFormat(
            f"cache algorithm {shown} (another kvchat version; this one uses "
            f"{CACHE_ALGORITHM_VERSION})"
        )
    if not _shallow(header, _MAX_DEPTH):
        raise ValueError(f"nested deeper than {_MAX_DEPTH}")
    for key, kind in _HEADER_TYPES.items():
        if type(header.get(key)) is not kind:  # `type`, as bool is an int
            raise ValueError(f"{key} is not a {kind.__name__}")
    tokens, file_size, scalars = header["tokens"], header["file_size"], header["scalars"]
    if not (_count(tokens) and _count(file_size) and all(map(_count, scalars.values()))):
        raise ValueError("a negative count")
    if scalars.get("length", tokens) != tokens:
        raise ValueError(f"{tokens} tokens in a cache of length {scalars['length']}")
    if not all(type(header["model"].get(k)) is str for k in ("id", "name")):
        raise ValueError("no model id and name")
    rate = header.get("prefill_tok_s")
    if rate is not None and not (type(rate) in (int, float) and 0 < rate < math.inf):
        raise ValueError("prefill_tok_s is not a speed")
    table = {}
    end = _PREAMBLE.size + len(encoded)
    for i, entry in enumerate(header["sections"]):
        entry = entry if type(entry) is dict else {}
        name, dtype, shape = entry.get("name"), entry.get("dtype"), entry.get("shape")
        offset, nbytes, pitch = entry.get("offset"), entry.get("nbytes"), entry.get("pitch")
        if not (
            type(name) is str
            and name not in table
            and type(dtype) is str
            and dtype in _DTYPES
            and type(shape) is list
            and len(shape) <= _MAX_DIMS
            and all(map(_count, shape))
            and _count(offset)
            and _count(nbytes)
            and _count(pitch)
            and type(entry.get("crc32")) is str
        ):
            raise ValueError(f"section {i}: bad table entry")
        itemsize = _DTYPES[dtype].itemsize
        if math.prod(shape) * itemsize != nbytes:
            raise ValueError(f"section {name}: shape {shape} does not match {nbytes} bytes")
        rows, row = _rows(shape, nbytes)
        if rows and row and (pitch < row or pitch % itemsize):
            raise ValueError(f"section {name}: rows of {row} bytes {pitch} bytes apart")
        if offset % ALIGN or offset < end or _end(entry) > file_size:
            raise ValueError(f"section {name}: {nbytes} bytes at {offset} are not in the file")
        table[name] = (dtype, shape)
    if table.get("tokens") != ("int32", [tokens]):
        raise ValueError(f"no tokens section of {tokens} tokens")
    logits = table.get("logits")
    if logits is None or logits[0] != "float32" or len(logits[1]) != 1 or not logits[1][0]:
        raise ValueError("no logits section of one row")
    return header


def _count(value: object) -> bool:
    return type(value) is int and value >= 0


def _shallow(value: object, depth: int) -> bool:
    """Whether `value` nests lists and objects at most `depth` deep (the recursion is bounded
    by `depth`, so a hostile header cannot exhaust the stack here or later)."""
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, list):
        return depth > 0 and all(_shallow(v, depth - 1) for v in value)
    return True


def _load(info: SnapshotInfo) -> LoadedSnapshot:
    """Map the file, check every section's checksum, and view the sections as tensors."""
    header = _read_header(info.path)
    pages = _FilePages(info.path, header["file_size"])
    entries = header["sections"]  # every entry checked by _parse_header
    sections = [pages.section(e) for e in entries]
    # One section per core at a time: zlib's checksum runs on one core at ~2 GB/s and lets
    # go of the GIL.
    with ThreadPoolExecutor(max(1, min(torch.get_num_threads(), len(sections)))) as workers:
        checksums = list(workers.map(_crc32, sections))
    tensors: dict[str, torch.Tensor] = {}
    for entry, data, crc in zip(entries, sections, checksums, strict=True):
        if f"{crc:08x}" != entry["crc32"]:
            raise _Damaged(f"section {entry['name']} fails its checksum")
        tensors[entry["name"]] = data.view(_DTYPES[entry["dtype"]]).view(entry["shape"])
    tokens, logits = tensors.pop("tokens"), tensors.pop("logits")
    cache = {name.removeprefix("cache."): t for name, t in tensors.items()}
    state = CacheState(dict(header["scalars"]), cache, copy_into=pages.copy_into)
    return LoadedSnapshot(info, tokens.tolist(), logits, state)


class _FilePages:
    """A snapshot file mapped privately (reads come from the page cache, writes stay in this
    process), and kept open so that restores can map its pages into a cache."""

    def __init__(self, path: Path, size: int) -> None:
        self.fd = os.open(path, os.O_RDONLY)
        weakref.finalize(self, os.close, self.fd)
        if os.fstat(self.fd).st_size != size:  # replaced since its header was read
            raise OSError(f"{path.name} changed while it was read")
        region = mmap.mmap(self.fd, size, access=mmap.ACCESS_COPY)
        self.raw = torch.frombuffer(region, dtype=torch.uint8)
        self.base = self.raw.data_ptr()

    def section(self, entry: dict) -> torch.Tensor:
        """A section's bytes: [rows, row] (strided when its rows are pitched), or flat."""
        rows, row = _rows(entry["shape"], entry["nbytes"])
        if not (rows and row) or entry["pitch"] == row:
            return self.raw[entry["offset"] : entry["offset"] + entry["nbytes"]]
        return self.raw.as_strided((rows, row), (entry["pitch"], 1), entry["offset"])

    def copy_into(self, dest: torch.Tensor, src: torch.Tensor) -> None:
        """dest.copy_(src) for a view `src` of this file, mapping the pages that line up."""
        if src.is_contiguous() and dest.is_contiguous():
            host_pages.copy_from_file(dest, src, self.fd, src.data_ptr() - self.base)
        elif src.dim() > 1:
            for d, s in zip(dest, src, strict=True):
                self.copy_into(d, s)
        else:
            dest.copy_(src)


def _crc32(data: torch.Tensor) -> int:
    crc = 0
    for row in [data.reshape(-1)] if data.is_contiguous() else data:
        array = row.numpy()
        for start in range(0, len(array), _CHUNK):
            crc = zlib.crc32(array[start : start + _CHUNK], crc)
    return crc
