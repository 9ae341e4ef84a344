"""Linear layers in the weight format that runs fastest for the file and the compute dtype.

GGUF Q4_0/Q4_1/Q4_K weights are exact 4-bit integers in groups of 32, so on the CPU with bf16
activations they run as int4 and read a quarter of the bytes: through core/csrc/int4_layer.cpp
where it has a vector path for the CPU (AVX-512 VNNI, AVX2), else through PyTorch's int4
group-32 kernel. Q8_0 and Q5_0 weights are exact 8-bit integers in groups of 32, Q6_K's in
groups of 16, and run as int8 through core/csrc/decoder_ops.cpp, reading half the bytes.
On CUDA both kinds of groups run through Triton (core/triton_linear.py). Every other case is
a plain matrix in the compute dtype.

Products of many rows in bf16 run in hardware where the CPU has bf16 products
(kvchat.native.cpu); elsewhere torch emulates them at a fraction of fp32's speed, so they run in
fp32 on the bf16 values widened (exact products: the results differ from the hardware's only
in the order of the fp32 sums).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from types import ModuleType
from typing import Protocol

import torch
import torch.nn.functional as F

from kvchat.kv.kernels import triton_available
from kvchat.native.cpu import widened_products

from .int4_layer import Int4Pack, pack_int4
from .weights import GROUP_SIZE, Int4Groups, Int8Groups, tensor_bytes

WEIGHT_FORMATS = ("dense", "int4")
# The op as torch's own function: through torch.ops it costs ~5 us more a call (the packet
# resolves its overload each time), 120 calls a SmolLM2 decode step.
_INT4_MM = torch._weight_int4pack_mm_for_cpu


class Linear(Protocol):
    out_features: int
    format: str  # what its weight is held as: "int4", "int8", or the dense dtype ("bfloat16")
    nbytes: int  # held in memory
    read_bytes: int  # read by one product (a layer may hold more than it reads)

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


def widened_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """F.linear in fp32 on x and the weight widened (either may be fp32 already), in x's dtype."""
    y = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    return y.to(x.dtype)


class DenseLinear:
    """y = x @ W.T + b. A bf16 weight on the CPU is also kept as a second copy (`copy`) in the
    layout its products run fastest from: prepacked for oneDNN where bf16 products are in
    hardware (a one-row product, every decode step's and the output layer's, runs ~2x faster
    than through F.linear, which goes to MKL's slow path for a single row), else widened to
    fp32. Without the copy such products widen the weight at each call."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, copy: bool = True) -> None:
        self.weight, self.bias = weight, bias
        self.out_features = weight.shape[0]
        widened = widened_products(weight.device, weight.dtype)
        self._copy: torch.Tensor | None = None
        if widened:
            self._copy = weight.float() if copy else None
            self._product = self._widened
        elif (
            copy
            and weight.device.type == "cpu"
            and weight.dtype == torch.bfloat16
            and torch.backends.mkldnn.is_available()
        ):
            self._copy = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
            self._product = self._prepacked
        else:
            self._product = self._plain
        self.format = str(weight.dtype).removeprefix("torch.")
        self.nbytes = tensor_bytes(weight, bias, self._copy)
        self.read_bytes = tensor_bytes(weight if self._copy is None else self._copy, bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._product(x)

    def _prepacked(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self._copy, self.bias, "none", [], "")

    def _widened(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight if self._copy is None else self._copy
        return widened_linear(x, weight, self.bias)

    def _plain(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class Int4Linear:
    """y = x @ W.T with W = q * scale + minimum per 32 inputs, q packed two per byte (torch's
    CPU kernel, which takes groups of 32 and more)."""

    def __init__(self, groups: Int4Groups, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        self.out_features = groups.q.shape[0]
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            groups.q.to(torch.int32), 1
        )
        # The kernel computes (q - 8) * scale + zero, so zero = minimum + 8 * scale.
        zero = groups.minimum + 8 * groups.scale
        self.scale_zero = torch.stack([groups.scale.t(), zero.t()], dim=-1).to(dtype).contiguous()
        self.bias = bias
        self.format = "int4"
        self.nbytes = self.read_bytes = tensor_bytes(self.packed, self.scale_zero, bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:  # every call of the decoder: no reshapes around the product
            y = _INT4_MM(x, self.packed, GROUP_SIZE, self.scale_zero)
        else:
            rows = _INT4_MM(x.reshape(-1, x.shape[-1]), self.packed, GROUP_SIZE, self.scale_zero)
            y = rows.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


class PackedInt4Linear:
    """y = x @ W.T for the same int4 weights in core/csrc/int4_layer.cpp's layout (`ops`, where
    it has a vector path: AVX-512 VNNI or AVX2). Rows up to a few dozen go through its int4
    product (a decode step's four products a layer also run fused, see core/int4_layer.py).
    More rows (prefill chunks) go, where bf16 products are in hardware, through a bf16 matrix
    product with the weight unpacked for the call (torch's int4 kernel takes ~6x longer for a
    2048-row chunk: SmolLM2's gate_up on a Xeon 105 ms, unpacking 1.5 ms and the product
    15 ms); elsewhere through the int4 product too, which beats fp32 products on the widened
    values (2048 rows by gate_up on the AVX2 build: 29 ms against 42). The unpacked weight is
    q * scale + minimum rounded to bf16; the int4 product rounds each input row to 16-bit
    integers per group of 32 (within 1/65024 of the group's largest value), multiplies exactly
    and sums in int32, then in fp32."""

    # Rows from which unpacking the weight and a bf16 product beat the int4 product (on a
    # Xeon, the best of 5: gate_up 0.83 against 1.79 ms at 48 rows, 1.03 against 1.15 at 64,
    # 1.41 against 1.12 at 96; down 0.48 / 0.53 at 48, 0.67 / 0.54 at 64).
    UNPACK_ROWS = 64

    def __init__(self, pack: Int4Pack, bias: torch.Tensor | None, ops: ModuleType) -> None:
        self.pack, self.bias, self._ops = pack, bias, ops
        self.out_features = pack.out_features
        self.format = "int4"
        self.nbytes = self.read_bytes = pack.nbytes + tensor_bytes(bias)
        self._unpack_rows = self.UNPACK_ROWS if _bf16_in_hardware() else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        if self._unpack_rows is None or rows.shape[0] < self._unpack_rows:
            y = self._ops.int4_linear(rows, *self.pack.parts)
            y = y if self.bias is None else y + self.bias
        else:
            y = F.linear(rows, self._ops.int4_dequantize(*self.pack.parts), self.bias)
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], self.out_features)


def pack_int8(
    groups: Int8Groups,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """An int8 weight [N, K] in decoder_ops.cpp's int8_linear layout: (packed uint8 [N' / 16,
    16 K], scale fp32 [N' / 16, K / G, 16] for a scale per G inputs, 32 or 16, and the
    minimums in the scales' layout or None), N' = N rounded up to 16 with zero rows. Tile t's
    group g is 8 chunks of 64 bytes; byte 4 r + j of chunk c holds row 16 t + r's value for
    input 32 g + 4 c + j plus 128 (an unsigned byte, as vpdpbusd multiplies): a chunk is 16
    rows' 4 adjacent inputs, one row to a 32-bit lane. Packed
    _PACK_TILES tiles at a time, so that packing a vocabulary-sized output layer holds its
    groups and the result, not two more copies."""
    q, scale = groups.q, groups.scale
    n, k = q.shape
    tiles, n_groups = -(-n // 16), k // GROUP_SIZE
    packed = torch.empty(tiles, n_groups * 512, dtype=torch.uint8)
    for t0 in range(0, tiles, _PACK_TILES):
        rows = q[16 * t0 : 16 * (t0 + _PACK_TILES)]
        count = -(-rows.shape[0] // 16)
        rows = F.pad(rows, (0, 0, 0, 16 * count - rows.shape[0]))
        shifted = rows.view(torch.uint8) ^ 0x80  # the int8 value plus 128
        # [tile, row, group, chunk, j] -> [tile, group, chunk, row, j]
        block = shifted.view(count, 16, n_groups, 8, 4).permute(0, 2, 3, 1, 4)
        packed[t0 : t0 + count] = block.reshape(count, n_groups * 512)

    def per_tile(t: torch.Tensor) -> torch.Tensor:
        t = F.pad(t, (0, 0, 0, 16 * tiles - n))
        return t.view(tiles, 16, t.shape[1]).transpose(1, 2).contiguous()

    minimum = None if groups.minimum is None else per_tile(groups.minimum)
    return packed, per_tile(scale), minimum


# Tiles of 16 rows packed at a time: 4096 rows (3.5 MiB of a 896-wide weight).
_PACK_TILES = 256


class Int8Linear:
    """y = x @ W.T + b on a GGUF's int8 weights (W = q * scale per 32 inputs: Q8_0, and Q5_0's
    5-bit values; per 16: Q6_K's 6-bit values) as stored, in tiles of 16 rows (pack_int8).
    Rows up to a few dozen (every decode step's, a prefill's last token) go through
    core/cpu_ops.py's int8 product, which reads at most 5/8 of the bytes of a bf16 copy (a
    scale per 16) and is exact but for the inputs' rounding to 16-bit
    integers per group of 32 (a bf16 copy rounds every weight). More rows (prefill chunks)
    go through a product with `table` (a bf16 copy the model holds anyway: a tied embedding)
    or else with the weight unpacked to bf16 for the call: in bf16 where bf16 products are in
    hardware, else in fp32 on the widened values where the int8 product lacks VNNI (its AVX2
    path multiplies 16-bit integers). With VNNI and without bf16 products the int8 product
    takes every row. Returns `out_dtype` (the output layer: fp32)."""

    UNPACK_ROWS = PackedInt4Linear.UNPACK_ROWS
    # Rows from which fp32 products on the unpacked, widened weight beat the int8 product
    # without VNNI (a Zen 3, Qwen2.5-0.5B's four products of a layer, medians of 5: 135
    # against 139 ms at 256 rows, 247 against 176 at 512, 522 against 373 at 1024).
    WIDEN_ROWS = 256

    def __init__(
        self,
        groups: Int8Groups,
        bias: torch.Tensor | None,
        ops: ModuleType,
        out_dtype: torch.dtype,
        table: torch.Tensor | None = None,
    ) -> None:
        self.packed, self.scale, self.minimum = pack_int8(groups)
        self.bias, self._ops, self.out_dtype, self.table = bias, ops, out_dtype, table
        self.out_features = groups.q.shape[0]
        self.format = "int8"
        self.nbytes = self.read_bytes = tensor_bytes(self.packed, self.scale, self.minimum, bias)
        hardware = _bf16_in_hardware()
        self._unpack_rows: int | None = self.UNPACK_ROWS if hardware else None
        if not hardware and ops.integer_products != "avx512-vnni":
            self._unpack_rows = self.WIDEN_ROWS
        self._many_rows = F.linear if hardware else widened_linear

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if self._unpack_rows is None or rows.shape[0] < self._unpack_rows:
            y = self._ops.int8_linear(rows, self.packed, self.scale, self.minimum)
            y = y[:, : self.out_features]
            y = y if self.bias is None else y + self.bias
        else:
            weight = self.table
            if weight is None:
                unpacked = self._ops.int8_dequantize(self.packed, self.scale, self.minimum)
                weight = unpacked[: self.out_features]
            y = self._many_rows(rows.bfloat16(), weight, self.bias)
        return y.to(self.out_dtype).reshape(*x.shape[:-1], -1)


def _bf16_in_hardware() -> bool:
    """Whether this CPU multiplies bf16 in hardware, where the quantized layers unpack their
    weight to bf16 for products of many rows."""
    return not widened_products(torch.device("cpu"), torch.bfloat16)


class ConcatLinear:
    """A fused projection whose parts hold different groups (a Q4_K_M file's Q4_K q and k
    beside a Q6_K v): each run of parts alike is a layer of its own (part_runs), their
    outputs side by side, so that each keeps the file's integers instead of the whole
    projection running dense."""

    def __init__(self, parts: list[Linear]) -> None:
        self.parts = parts
        self.out_features = sum(p.out_features for p in parts)
        self.format = "+".join(p.format for p in parts)
        self.nbytes = sum(p.nbytes for p in parts)
        self.read_bytes = sum(p.read_bytes for p in parts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)


def part_runs(
    out_sizes: list[int],
    in_features: int,
    int4: list[bool],
    int8: list[bool],
    weight_format: str,
    dtype: torch.dtype,
    device: torch.device,
    ops: ModuleType | None,
    group_sizes: list[int],
) -> list[slice]:
    """The runs of consecutive parts of a fused projection (`out_sizes` rows each; `int4`,
    `int8`: whether each has those groups, of `group_sizes` inputs) whose layers would be of
    one kind (linear_kind of each part alone): one layer each."""
    kinds = [
        linear_kind(out, in_features, i4, i8, weight_format, dtype, device, ops, size)
        for out, i4, i8, size in zip(out_sizes, int4, int8, group_sizes, strict=True)
    ]
    runs: list[slice] = []
    start = 0
    for i in range(1, len(kinds) + 1):
        if i == len(kinds) or kinds[i] != kinds[start]:
            runs.append(slice(start, i))
            start = i
    return runs


class LinearKind(enum.Enum):
    """What make_linear builds a projection as."""

    PACKED_INT4 = "packed int4"  # PackedInt4Linear
    TORCH_INT4 = "torch int4"  # Int4Linear
    INT8 = "int8"  # Int8Linear
    TRITON_INT4 = "triton int4"  # core/triton_linear.TritonGroupsLinear on int4 groups
    TRITON_INT8 = "triton int8"  # and on int8 groups
    DENSE = "dense"  # DenseLinear

    @property
    def format(self) -> str | None:
        """Linear.format of its layers; None for DENSE (the compute dtype)."""
        return None if self is LinearKind.DENSE else self.value.split()[-1]


def linear_kind(
    out_features: int,
    in_features: int,
    int4: bool,
    int8: bool,
    weight_format: str,
    dtype: torch.dtype,
    device: torch.device,
    ops: ModuleType | None,
    group_size: int = GROUP_SIZE,
) -> LinearKind:
    """The kind of layer for a projection whose every part has int4 groups (`int4`) or int8
    groups (`int8`), a scale per `group_size` inputs: the file's groups run as they are,
    along whole groups of inputs, on the CPU (int8 there needs the C++ products and bf16
    activations) and on CUDA through Triton."""
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"weight format {weight_format!r}; choose one of {WEIGHT_FORMATS}")
    whole = weight_format == "int4" and in_features % GROUP_SIZE == 0
    if whole and device.type == "cuda" and triton_available() and (int4 or int8):
        return LinearKind.TRITON_INT4 if int4 else LinearKind.TRITON_INT8
    grouped = whole and device.type == "cpu"
    if grouped and int4:
        own = ops is not None and dtype == torch.bfloat16 and out_features % 16 == 0
        # torch's int4 kernel takes groups of 32 and more: scales per 16 run through the C++
        # products at any CPU level (one value at a time below AVX2).
        if own and (ops.int4_vectorized or group_size < GROUP_SIZE):  # type: ignore[union-attr]
            return LinearKind.PACKED_INT4
        return LinearKind.TORCH_INT4 if group_size == GROUP_SIZE else LinearKind.DENSE
    if grouped and int8 and ops is not None and dtype == torch.bfloat16:
        return LinearKind.INT8
    return LinearKind.DENSE


def planned_bytes(
    kind: LinearKind,
    out_features: int,
    in_features: int,
    dtype: torch.dtype,
    device: torch.device,
    bias: bool,
    group_size: int = GROUP_SIZE,
    scale_itemsize: int = 2,
    minimum: bool = False,
) -> int:
    """The bytes a layer of `kind` holds (its `nbytes`), from the shapes alone: `group_size`
    inputs per scale, `scale_itemsize` of an int4 scale (2: fp16, 4: fp32), whether the int8
    groups have minimums."""
    n, k, item = out_features, in_features, dtype.itemsize
    held = n * item if bias else 0
    groups = n * (k // group_size)
    if kind is LinearKind.PACKED_INT4:
        return held + n * k // 2 + 2 * groups * scale_itemsize
    if kind is LinearKind.TORCH_INT4:
        return held + n * k // 2 + 2 * groups * item
    if kind is LinearKind.INT8:
        padded = n + -n % 16
        return held + padded * k + padded * (k // group_size) * 4 * (2 if minimum else 1)
    if kind is LinearKind.TRITON_INT4:  # fp32 scales and minimums
        return held + n * k // 2 + 2 * groups * 4
    if kind is LinearKind.TRITON_INT8:
        return held + n * k + n * (k // group_size) * 4 * (2 if minimum else 1)
    if widened_products(device, dtype):
        copy = 4
    else:
        prepacked = device.type == "cpu" and dtype == torch.bfloat16
        copy = item if prepacked and torch.backends.mkldnn.is_available() else 0
    return held + n * k * (item + copy)


def make_linear(
    dense: Callable[[], list[torch.Tensor]],
    out_features: int,
    in_features: int,
    int4: Callable[[], list[Int4Groups]] | None,
    int8: Callable[[], list[Int8Groups]] | None,
    bias: torch.Tensor | None,
    weight_format: str,
    dtype: torch.dtype,
    device: torch.device,
    ops: ModuleType | None = None,
    group_size: int = GROUP_SIZE,
) -> Linear:
    """One linear layer from row blocks fused along the output dim, kept in the file's int4 or
    int8 groups where every block has them (`int4`, `int8`: the blocks' groups, None where
    some block has none; the finest of them a scale per `group_size` inputs; linear_kind),
    else a matrix of the blocks `dense` gives. Only what is kept is read. `ops`:
    core/cpu_ops.py's module, whose int4 products replace torch's where they run vectorized
    (and take scales per 16 everywhere), and whose int8 products run the int8 groups."""
    kind = linear_kind(
        out_features,
        in_features,
        int4 is not None,
        int8 is not None,
        weight_format,
        dtype,
        device,
        ops,
        group_size,
    )
    bias = None if bias is None else bias.to(device=device, dtype=dtype)
    if kind is LinearKind.PACKED_INT4:
        pack = pack_int4(Int4Groups.cat(int4()))  # type: ignore[misc]
        assert pack is not None  # linear_kind checked the rows
        return PackedInt4Linear(pack, bias, ops)  # type: ignore[arg-type]
    if kind is LinearKind.TORCH_INT4:
        return Int4Linear(Int4Groups.cat(int4()), bias, dtype)  # type: ignore[misc]
    if kind is LinearKind.INT8:
        return Int8Linear(Int8Groups.cat(int8()), bias, ops, dtype)  # type: ignore[arg-type,misc]
    if kind in (LinearKind.TRITON_INT4, LinearKind.TRITON_INT8):
        from .triton_linear import TritonGroupsLinear  # imports Triton: only where it runs

        groups = Int4Groups.cat(int4()) if int4 is not None else Int8Groups.cat(int8())  # type: ignore[misc]
        return TritonGroupsLinear(groups, bias, device, dtype)
    weight = torch.cat(dense()).to(device=device, dtype=dtype).contiguous()
    return DenseLinear(weight, bias)
