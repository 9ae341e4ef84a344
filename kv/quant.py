"""KV block storage in FP16, INT8 or INT4: quantizers and the preallocated block pool.

Formats, per token, in groups of GROUP = 32 consecutive values along head_dim:

- FP16: the compute dtype itself (bf16 on CPUs without fp16 arithmetic), exact.
- INT8: symmetric; scale = max|x| / 127 in fp16, q = round(x / scale) in -127..127.
- INT4: asymmetric; minimum in fp16, scale = (max - minimum) / 15 in fp16,
  q = round((x - minimum) / scale) in 0..15, two per byte (low nibble = even index).

Scales and minimums are computed in fp32 and rounded *down* to fp16, and values are quantized
against the stored fp16 numbers. Rounding down keeps the grid inside [min, max] of the group
(so a group at the edge of the fp16 range dequantizes to finite fp16), and a minimum rounded
down keeps every value above it (rounded to nearest, values 1000.3..1001.3 would sit below a
minimum of 1000.5 and clamp with errors unbounded relative to the group's range).

Scales are clamped to [SCALE_MIN, FP16_MAX]: the floor keeps all-zero and constant groups from
dividing by zero (and keeps scales out of fp16 subnormals, where they lose relative precision);
the ceiling keeps the fp16 scale from overflowing to inf. Nothing produces NaN or inf for finite
inputs.

Error bounds per group of a finite input with |x| <= FP16_MAX, up to fp32 rounding:

- INT8: |x - x̂| <= max(max|x| / 254, SCALE_MIN / 2). Values beyond FP16_MAX are still kept
  (an fp32 or bf16 output has room for them) up to 127 * FP16_MAX (~8.3e6), where they saturate.
- INT4: |x - x̂| <= max((max - min + ulp) / 30, SCALE_MIN / 2), where ulp <= |min| * 2**-10 is
  how far rounding the minimum down to fp16 moved it. Values saturate at ±FP16_MAX.

Dequantization computes x̂ = q * scale (+ minimum) in fp32 and rounds once to the output dtype,
in the standalone functions and in BlockPool.gather alike, so both give identical results. On
CPU the fp32 route is also the fast one: eager bf16 arithmetic converts to fp32 and back inside
every op, and a decode step's gathers run ~1.4x (INT8) to ~1.6x (INT4) slower when converting
int -> bf16 and scaling in bf16 than int -> fp32, scale in fp32, one conversion to bf16.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import torch

from kvchat.config.enums import KvType

from . import cpu_kernel, host_pages

KV_TYPES = tuple(KvType)
GROUP = 32

FP16_MAX = 65504.0
# Smallest normal fp16: a scale below it would be an fp16 subnormal.
SCALE_MIN = 2.0**-14


def _check(head_dim: int, kv_type: KvType) -> None:
    if kv_type not in KV_TYPES:
        raise ValueError(f"kv_type must be one of {', '.join(KV_TYPES)}, got {kv_type!r}")
    if kv_type != KvType.FP16 and head_dim % GROUP:
        raise ValueError(
            f"head_dim must be a multiple of {GROUP} for kv_type {kv_type}, got {head_dim}"
        )


def _as_fp32_groups(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] as fp32 [..., D/GROUP, GROUP]."""
    if x.shape[-1] % GROUP:
        raise ValueError(f"last dimension must be a multiple of {GROUP}, got {x.shape[-1]}")
    return x.float().reshape(*x.shape[:-1], x.shape[-1] // GROUP, GROUP)


def _fp16_down(x: torch.Tensor) -> torch.Tensor:
    """fp32 x (within ±FP16_MAX) -> the largest fp16 value <= x."""
    nearest = x.half()
    lower = torch.nextafter(nearest, torch.full_like(nearest, -FP16_MAX))
    return torch.where(nearest.float() > x, lower, nearest)


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] (any float dtype) -> q int8 [..., D], scale fp16 [..., D/32]."""
    xg = _as_fp32_groups(x)
    scale = _fp16_down((xg.abs().amax(-1) / 127).clamp_(SCALE_MIN, FP16_MAX))
    q = (xg / scale.float().unsqueeze(-1)).round_().clamp_(-127, 127).to(torch.int8)
    return q.reshape(x.shape), scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q int8 [..., D], scale fp16 [..., D/32] -> x̂ [..., D] in dtype."""
    work = q.float()
    _scale_groups(_grouped(work), scale.float().unsqueeze(-1))
    return work.to(dtype)


def quantize_int4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [..., D] (any float dtype) -> packed uint8 [..., D/2], scale fp16 [..., D/32],
    minimum fp16 [..., D/32]."""
    xg = _as_fp32_groups(x)
    low = xg.amin(-1).clamp_(-FP16_MAX, FP16_MAX)
    high = xg.amax(-1).clamp_(-FP16_MAX, FP16_MAX)
    minimum = _fp16_down(low)
    minimum_f = minimum.float()
    scale = _fp16_down(((high - minimum_f) / 15).clamp_(SCALE_MIN, FP16_MAX))
    q = ((xg - minimum_f.unsqueeze(-1)) / scale.float().unsqueeze(-1)).round_().clamp_(0, 15)
    q = q.to(torch.uint8).reshape(x.shape)
    packed = q[..., 0::2] | (q[..., 1::2] << 4)
    return packed, scale, minimum


def dequantize_int4(
    packed: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """packed uint8 [..., D/2], scale and minimum fp16 [..., D/32] -> x̂ [..., D] in dtype."""
    words = torch.empty(packed.shape, dtype=torch.int16, device=packed.device)
    work = _unpack_int4(packed, words, torch.empty_like(words)).float()
    _scale_groups(_grouped(work), scale.float().unsqueeze(-1), minimum.float().unsqueeze(-1))
    return work.to(dtype)


def _unpack_int4(packed: torch.Tensor, words: torch.Tensor, tmp: torch.Tensor) -> torch.Tensor:
    """packed uint8 [..., D/2] -> q uint8 [..., D], a view of `words` (int16, packed's shape).

    Widening each byte hi<<4|lo to the 16-bit word hi<<8|lo puts lo in its low byte and hi in
    its high byte, which on a little-endian machine (x86, ARM, every CUDA host) *is* the
    interleaved pair [lo, hi] when the words are viewed as bytes: four full-width integer ops
    instead of a strided interleave (~4x faster on CPU than torch.stack of the two nibbles).
    """
    words.copy_(packed)
    torch.bitwise_left_shift(words, 4, out=tmp)
    words.bitwise_or_(tmp).bitwise_and_(0x0F0F)
    return words.view(torch.uint8)


def _scale_groups(
    grouped: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor | None = None
) -> None:
    """In place on fp32 grouped [..., G, 32]: grouped = grouped * scale (+ minimum).

    scale and minimum are fp32 [..., G, 1]: PyTorch vectorizes that stride-0 inner broadcast,
    so the per-group factors are never expanded to the block's size.
    """
    grouped.mul_(scale)
    if minimum is not None:
        grouped.add_(minimum)


def _grouped(x: torch.Tensor) -> torch.Tensor:
    """A view of x [..., D] as [..., D/GROUP, GROUP]."""
    return x.view(*x.shape[:-1], x.shape[-1] // GROUP, GROUP)


def bytes_per_token(head_dim: int, kv_type: KvType, dtype_itemsize: int) -> int:
    """Storage bytes of one token of one KV head, of K *or* V, scales and minimums included.

    dtype_itemsize is the compute dtype's (it is the storage dtype of FP16 blocks only).
    """
    _check(head_dim, kv_type)
    groups = head_dim // GROUP
    if kv_type == KvType.INT8:
        return head_dim + 2 * groups
    if kv_type == KvType.INT4:
        return head_dim // 2 + 4 * groups
    return head_dim * dtype_itemsize


@dataclass(frozen=True, eq=False)
class _Scratch:
    """Views into the workspace for gathering n blocks of one pool layout."""

    raw: torch.Tensor  # uint8 [n, bytes_per_slot]: the gathered rows
    q: torch.Tensor  # the q part of raw: int8 [n, B, D] or packed uint8 [n, B, D/2]
    meta_src: torch.Tensor  # fp16 view of raw's [scale | minimum] part: [n, n_meta, B, G]
    meta: torch.Tensor  # fp32 [n, n_meta, B, G]
    scale: torch.Tensor  # fp32 [n, B, G, 1], a view of meta
    minimum: torch.Tensor | None  # fp32 [n, B, G, 1], a view of meta (INT4)
    work: torch.Tensor  # fp32 [n, B, D], for destinations that are not fp32
    work_grouped: torch.Tensor  # work as [n, B, G, 32]
    words: torch.Tensor | None  # int16 [n, B, D/2] (INT4 unpacking)
    tmp: torch.Tensor | None  # int16 [n, B, D/2]


class _Workspace(threading.local):
    """Per-thread scratch shared by every pool: gather's intermediates never outlive a call.

    One set of buffers per thread rather than per pool, because a model has two pools per
    layer (60 for a 30-layer model) and the fp32 intermediate alone is 4 bytes per gathered
    value: per-pool scratch would cost hundreds of MB for nothing. Buffers only grow, so a
    steady-state decode step allocates nothing, and the views for each gather shape are built
    once, so a gather costs one dict lookup of Python bookkeeping.
    """

    def __init__(self) -> None:
        self.buffers: dict[tuple[str, torch.device], torch.Tensor] = {}
        self.scratch: dict[tuple, _Scratch] = {}

    def _get(
        self, role: str, device: torch.device, dtype: torch.dtype, shape: tuple[int, ...]
    ) -> torch.Tensor:
        """A contiguous [shape] tensor in dtype on device, from the role's growing buffer."""
        nbytes = dtype.itemsize * math.prod(shape)
        buf = self.buffers.get((role, device))
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
            self.buffers[(role, device)] = buf
            # Views built on the old buffer stay valid but would keep it alive: rebuild them.
            self.scratch.clear()
        return buf[:nbytes].view(dtype).view(shape)

    def for_gather(self, pool: BlockPool, n: int) -> _Scratch:
        key = (pool.device, pool.kv_type, pool.block_size, pool.head_dim, n)
        scratch = self.scratch.get(key)
        if scratch is None:
            # Decoding runs under inference_mode, whose tensors (and views) can never again
            # be updated in place outside it: make the scratch usable in both modes.
            with torch.inference_mode(False):
                scratch = self._build(pool, n)
            self.scratch[key] = scratch
        return scratch

    def _build(self, pool: BlockPool, n: int) -> _Scratch:
        dev, blk, dim, groups = pool.device, pool.block_size, pool.head_dim, pool.head_dim // GROUP
        n_meta = 1 if pool.kv_type == KvType.INT8 else 2  # scale, or scale and minimum
        raw = self._get("raw", dev, torch.uint8, (n, pool.bytes_per_slot))
        q_bytes = raw.shape[1] - 2 * n_meta * blk * groups
        meta_shape = (n, n_meta, blk, groups)
        words = tmp = None
        if pool.kv_type == KvType.INT8:
            q = raw[:, :q_bytes].view(torch.int8).view(n, blk, dim)
        else:
            q = raw[:, :q_bytes].view(n, blk, dim // 2)
            words = self._get("words", dev, torch.int16, q.shape)
            tmp = self._get("tmp", dev, torch.int16, q.shape)
        meta = self._get("meta", dev, torch.float32, meta_shape)
        work = self._get("work", dev, torch.float32, (n, blk, dim))
        return _Scratch(
            raw=raw,
            q=q,
            meta_src=raw[:, q_bytes:].view(torch.float16).view(meta_shape),
            meta=meta,
            scale=meta[:, 0].unsqueeze(-1),
            minimum=meta[:, 1].unsqueeze(-1) if n_meta == 2 else None,
            work=work,
            work_grouped=_grouped(work),
            words=words,
            tmp=tmp,
        )


_workspace = _Workspace()


class BlockPool:
    """Preallocated storage of n_slots blocks [block_size, head_dim] in one kv_type.

    Quantized blocks live as one byte row per slot, [q | scale | minimum], so a gather is a
    single index_select of contiguous rows. Blocks are written once (when they complete) and
    gathered at every decode step, so all the work that can be done at write time is.
    """

    def __init__(
        self,
        n_slots: int,
        block_size: int,
        head_dim: int,
        kv_type: KvType,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        pin: bool = False,
    ) -> None:
        _check(head_dim, kv_type)
        if n_slots <= 0 or block_size <= 0 or head_dim <= 0:
            raise ValueError(
                f"n_slots, block_size and head_dim must be positive, "
                f"got {n_slots}, {block_size}, {head_dim}"
            )
        if not dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating-point dtype, got {dtype}")
        self.n_slots = n_slots
        self.block_size = block_size
        self.head_dim = head_dim
        self.kv_type = kv_type
        self.dtype = dtype
        self.device = torch.device(device)
        # pin_memory raises on CPU-only builds, and only helps host-to-GPU copies anyway.
        pin_memory = pin and torch.cuda.is_available() and self.device.type == "cpu"
        if kv_type == KvType.FP16:
            shape, storage_dtype = (n_slots, block_size, head_dim), dtype
        else:
            shape, storage_dtype = (n_slots, self.bytes_per_slot), torch.uint8
        # Quantized blocks on the host are dequantized by the CPU kernel where it is built.
        self._native_gather = (
            kv_type != KvType.FP16
            and self.device.type == "cpu"
            and dtype in (torch.bfloat16, torch.float32)
            and head_dim in (32, 64, 128, 256)
            and cpu_kernel.load() is not None
        )
        # A pool made under inference_mode must still take writes outside it.
        with torch.inference_mode(False):
            if self.device.type == "cpu" and not pin_memory:
                # Memory of our own, so that a snapshot's blocks can be mapped into it.
                nbytes = math.prod(shape) * storage_dtype.itemsize
                self._data = host_pages.allocate(nbytes).view(storage_dtype).view(shape)
            else:
                self._data = torch.empty(
                    shape, dtype=storage_dtype, device=self.device, pin_memory=pin_memory
                )

    @property
    def bytes_per_slot(self) -> int:
        return self.block_size * bytes_per_token(self.head_dim, self.kv_type, self.dtype.itemsize)

    @property
    def nbytes(self) -> int:
        return self.n_slots * self.bytes_per_slot

    @property
    def storage(self) -> torch.Tensor:
        """The slots as stored, for kernels and copies that work on rows: [n_slots, block_size,
        head_dim] in `dtype` (FP16) or uint8 [n_slots, bytes_per_slot] rows (INT8 / INT4)."""
        return self._data

    def write(self, slots: torch.Tensor, blocks: torch.Tensor) -> None:
        """Store blocks [n, block_size, head_dim] (any float dtype, any device) at slots [n]."""
        shape = (self.block_size, self.head_dim)
        if blocks.dim() != 3 or tuple(blocks.shape[1:]) != shape:
            raise ValueError(
                f"blocks must be [n, {shape[0]}, {shape[1]}], got {list(blocks.shape)}"
            )
        slots = slots.to(self.device)
        if self.kv_type == KvType.FP16:
            self._data.index_copy_(0, slots, blocks.to(self.device, self.dtype))
            return
        n = blocks.shape[0]
        # Quantize where the blocks are (the GPU, when there is one), then move only bytes.
        if self.kv_type == KvType.INT8:
            parts = quantize_int8(blocks)
        else:
            parts = quantize_int4(blocks)
        row = torch.cat([p.reshape(n, -1).view(torch.uint8) for p in parts], dim=1)
        self._data.index_copy_(0, slots, row.to(self.device))

    def gather(self, slots: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Copy the blocks at slots [n] (long, on the pool's device, repeats allowed), dequantized,
        into out[:n] and return out[:n].

        out: a preallocated contiguous [>= n, block_size, head_dim] tensor in `dtype` on the
        pool's device. Scratch comes from a per-thread workspace that only grows, so a
        steady-state call allocates nothing.
        """
        n = slots.shape[0]
        dest = out[:n]
        if self.kv_type == KvType.FP16:
            return torch.index_select(self._data, 0, slots, out=dest)
        if self._native_gather:
            return cpu_kernel.gather_blocks(self._data, slots, out, self.kv_type)
        scratch = _workspace.for_gather(self, n)
        torch.index_select(self._data, 0, slots, out=scratch.raw)
        scratch.meta.copy_(scratch.meta_src)
        # fp32 destinations are their own workspace; others get one rounding at the end.
        fp32_dest = dest.dtype == torch.float32
        work = dest if fp32_dest else scratch.work
        if scratch.words is None:
            work.copy_(scratch.q)
        else:
            work.copy_(_unpack_int4(scratch.q, scratch.words, scratch.tmp))
        _scale_groups(
            _grouped(dest) if fp32_dest else scratch.work_grouped, scratch.scale, scratch.minimum
        )
        if not fp32_dest:
            dest.copy_(work)
        return dest

    def span(self, groups: int, first: int, last: int) -> torch.Tensor | None:
        """Blocks first..last of each of `groups` equal slot ranges, read in place.

        The slots are seen as [groups, n_slots // groups] (one range per KV head); returns
        [groups, (last - first) * block_size, head_dim] without copying, or None when the
        blocks are quantized and must be gathered (dequantized) instead.
        """
        if self.kv_type != KvType.FP16:
            return None
        per_group = self.n_slots // groups
        rows = self._data.view(groups, per_group * self.block_size, self.head_dim)
        return rows[:, first * self.block_size : last * self.block_size]

    def read(self, slot: int) -> torch.Tensor:
        """One block [block_size, head_dim] in `dtype`, a fresh tensor (for anchors and tests)."""
        out = torch.empty((1, self.block_size, self.head_dim), dtype=self.dtype, device=self.device)
        slots = torch.tensor([slot], dtype=torch.long, device=self.device)
        return self.gather(slots, out)[0]
