"""A bounded walk over a GGUF file's header, before any library parses it.

gguf-py (and transformers through it) trusts the counts a header gives: an array or string
count near 2^63 makes it loop or allocate without bound. This walk reads the header itself,
checks that every count and length fits in the bytes that remain, that a tensor has at most
4 dimensions and that the layer count matches the tensors present, and refuses the file in
one line otherwise. Each step advances by at least one byte, so the walk ends within the
file's size.

The same walk, keeping every value, is how kvchat reads a GGUF file's metadata and tensor
table (read_gguf_layout): numeric arrays as one numpy read each, a string a slice. gguf-py's
reader makes a numpy view per array item, ~4 s for SmolLM2's 49K-token vocabulary.
"""

from __future__ import annotations

import mmap
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .weights import WeightsError

_SCALAR_FORMATS = {
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
    10: "<Q", 11: "<q", 12: "<d",
}  # fmt: skip
_STRING, _ARRAY = 8, 9
_FLOAT32 = 6
_ARRAY_DTYPES = {
    0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?",
    10: "<u8", 11: "<i8", 12: "<f8",
}  # fmt: skip
_MIN_VALUE_BYTES = {**{k: struct.calcsize(f) for k, f in _SCALAR_FORMATS.items()}, 8: 8, 9: 12}
_MAX_ARRAY_DEPTH = 4
_MAX_DIMS = 4
_KEPT_STRING_BYTES = 4096  # longer strings (chat templates, merges) are skipped, not kept
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.")


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]  # as the file lists them: the fastest-varying first
    type_id: int  # a GGMLQuantizationType value
    offset: int  # from the start of the data section


@dataclass(frozen=True)
class GgufHeader:
    version: int
    end: int  # offset just past the key/values and tensor infos
    scalars: dict[str, int | float | bool | str]  # the non-array values, short strings only
    tensor_names: tuple[str, ...]


@dataclass(frozen=True)
class GgufLayout:
    """Every key/value of a GGUF file (arrays as lists, float32 scalars as their shortest
    decimal) and its tensor table."""

    metadata: dict[str, object]
    tensors: tuple[TensorInfo, ...]
    data_start: int  # where the tensor data begins: the header's end, aligned


def read_gguf_header(path: Path) -> GgufHeader:
    """The header of the GGUF file at `path`, or WeightsError saying what is wrong."""
    try:
        with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            header = _Walk(buf, path).header()
    except (OSError, ValueError) as exc:  # mmap of an empty file raises ValueError
        if isinstance(exc, WeightsError):
            raise
        raise WeightsError(f"{path} is not a readable GGUF file ({exc})") from exc
    _check_layers(header, path)
    return header


def read_gguf_layout(buf: mmap.mmap, path: Path) -> GgufLayout:
    """The metadata and tensor table of the GGUF file mapped at `buf`, or WeightsError."""
    walk = _Walk(buf, path, keep_all=True)
    header = walk.header()
    _check_layers(header, path)
    alignment = walk.metadata.get("general.alignment", 32)
    if not isinstance(alignment, int) or isinstance(alignment, bool) or not 0 < alignment < 1 << 20:
        raise WeightsError(f"{path}: general.alignment is invalid ({alignment!r})")
    data_start = -(-header.end // alignment) * alignment
    return GgufLayout(walk.metadata, tuple(walk.tensors), data_start)


class _Walk:
    def __init__(self, buf: mmap.mmap, path: Path, keep_all: bool = False) -> None:
        self.buf, self.path, self.pos = buf, path, 0
        # keep_all: every value and the tensor table, not only the short scalars.
        self.keep_all = keep_all
        self.metadata: dict[str, object] = {}
        self.tensors: list[TensorInfo] = []

    def fail(self, what: str) -> WeightsError:
        return WeightsError(f"{self.path} is not a readable GGUF file: {what} at byte {self.pos}")

    def unpack(self, fmt: str) -> tuple:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise self.fail("the file ends inside the header")
        values = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return values

    def count(self, what: str, min_bytes: int) -> int:
        """A count read from the file, refused when that many items cannot fit in the rest."""
        (n,) = self.unpack("<Q")
        if n * min_bytes > len(self.buf) - self.pos:
            raise self.fail(f"{what} count {n} does not fit in the {len(self.buf)}-byte file")
        return n

    def string(self, keep: bool = True) -> str | None:
        n = self.count("string length", 1)
        start, self.pos = self.pos, self.pos + n
        if not keep or (n > _KEPT_STRING_BYTES and not self.keep_all):
            return None
        try:
            return bytes(self.buf[start : self.pos]).decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail("a string that is not UTF-8") from None

    def strings(self, n: int) -> list[str]:
        """`n` strings in a row: string() inlined, for vocabularies of 150K tokens."""
        buf, pos, size, unpack = self.buf, self.pos, len(self.buf), struct.unpack_from
        out = []
        try:
            for _ in range(n):
                if pos + 8 > size:
                    raise self.fail("the file ends inside the header")
                (length,) = unpack("<Q", buf, pos)
                pos += 8
                if length > size - pos:
                    raise self.fail(f"string length {length} does not fit in the file")
                out.append(buf[pos : pos + length].decode("utf-8"))
                pos += length
        except UnicodeDecodeError:
            raise self.fail("a string that is not UTF-8") from None
        finally:
            self.pos = pos
        return out

    def value(self, kind: int, depth: int = 0) -> int | float | bool | str | None:
        if kind in _SCALAR_FORMATS:
            return self.unpack(_SCALAR_FORMATS[kind])[0]
        if kind == _STRING:
            return self.string()
        if kind != _ARRAY:
            raise self.fail(f"unknown value type {kind}")
        if depth >= _MAX_ARRAY_DEPTH:
            raise self.fail(f"arrays nested deeper than {_MAX_ARRAY_DEPTH}")
        (item,) = self.unpack("<I")
        if item not in _MIN_VALUE_BYTES:
            raise self.fail(f"unknown array item type {item}")
        n = self.count("array", _MIN_VALUE_BYTES[item])
        if item in _SCALAR_FORMATS:
            start, self.pos = self.pos, self.pos + n * _MIN_VALUE_BYTES[item]
            if self.keep_all:
                return np.frombuffer(self.buf, _ARRAY_DTYPES[item], n, start).tolist()
        elif item == _STRING:
            if self.keep_all:
                return self.strings(n)
            for _ in range(n):
                self.string(keep=False)
        else:
            arrays = [self.value(item, depth + 1) for _ in range(n)]
            if self.keep_all:
                return arrays
        return None

    def header(self) -> GgufHeader:
        magic, version = self.unpack("<4sI")
        if magic != b"GGUF":
            raise WeightsError(f"{self.path} is not a readable GGUF file: no GGUF magic")
        if version not in (2, 3):
            raise WeightsError(
                f"{self.path} is not a readable GGUF file: version {version} (kvchat reads 2 and 3)"
            )
        n_tensors = self.count("tensor", 8 + 4 + 8 + 4 + 8)  # name, n_dims, a dim, type, offset
        n_kv = self.count("key/value", 8 + 4 + 1)  # key length, type, smallest value
        scalars: dict[str, int | float | bool | str] = {}
        for _ in range(n_kv):
            key = self.string() or ""
            (kind,) = self.unpack("<I")
            value = self.value(kind)
            if value is not None and kind != _ARRAY and (
                not isinstance(value, str) or len(value) <= _KEPT_STRING_BYTES
            ):
                scalars[key] = value
            if self.keep_all:
                if kind == _FLOAT32:
                    # The shortest decimal that round-trips in float32: 1e-05, not 9.99e-06.
                    value = float(str(np.float32(value)))
                self.metadata[key] = value
        names = []
        for _ in range(n_tensors):
            names.append(self.string() or "")
            (n_dims,) = self.unpack("<I")
            if not 1 <= n_dims <= _MAX_DIMS:
                raise self.fail(f"a tensor with {n_dims} dimensions (at most {_MAX_DIMS})")
            dims = self.unpack(f"<{n_dims}Q")
            elements = 1
            for d in dims:
                elements *= d
            if elements > len(self.buf) * 8:  # no type packs more than 8 values in a byte
                raise self.fail(f"tensor {names[-1]!r} of shape {dims} is larger than the file")
            type_id, offset = self.unpack("<IQ")  # the loader checks them against the data
            self.tensors.append(TensorInfo(names[-1], dims, type_id, offset))
        return GgufHeader(version, self.pos, scalars, tuple(names))


def _check_layers(header: GgufHeader, path: Path) -> None:
    arch = header.scalars.get("general.architecture")
    blocks = header.scalars.get(f"{arch}.block_count")
    if not isinstance(blocks, int) or isinstance(blocks, bool):
        return  # the loader's own checks name a missing or mistyped key
    present = {int(m[1]) for name in header.tensor_names if (m := _LAYER_TENSOR.match(name))}
    if blocks != len(present) or (present and max(present) != blocks - 1):
        raise WeightsError(
            f"{path}: {arch}.block_count says {blocks} layers, "
            f"but the file holds tensors for {len(present)}"
        )
