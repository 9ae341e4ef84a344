"""Block append with quantization in Triton: blocks -> BlockPool rows, bit for bit.

Mirrors BlockPool.write for INT8 and INT4 (FP16 blocks are a plain copy, left to torch). One
program quantizes a tile of tokens of one 32-value group of one block and writes the
[q | scale | minimum] row bytes straight into the destination rows at their slots, computing
exactly what kv/quant.py computes: fp32 statistics, divisions rounded to nearest
(`div_rn`: a GPU's default fp32 division may be approximate), scales and minimums rounded
*down* to fp16, round-half-to-even quantization. The interleaved values of a group are read
as its even and odd halves, which are what the low and high nibbles of an INT4 byte hold.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvchat.config.enums import KvType

from ..quant import FP16_MAX, GROUP, SCALE_MIN, BlockPool, bytes_per_token

_FP16_MAX = tl.constexpr(FP16_MAX)
_SCALE_MIN = tl.constexpr(SCALE_MIN)
# x + 1.5 * 2**23 - 1.5 * 2**23 rounds fp32 |x| < 2**22 to an integer, half to even, like
# torch.round (the addition itself rounds; the subtraction is exact).
_RINT_MAGIC = tl.constexpr(12582912.0)


@triton.jit
def _rint(x):
    return (x + _RINT_MAGIC) - _RINT_MAGIC


@triton.jit
def _fp16_down(x):
    """fp32 x within +-FP16_MAX -> the largest fp16 value <= x (kv.quant._fp16_down)."""
    nearest = x.to(tl.float16)
    bits = nearest.to(tl.int16, bitcast=True)
    # One fp16 step towards -inf: the magnitude shrinks for positives and grows for negatives;
    # +0 steps to the smallest negative subnormal (0x8001).
    step = tl.where(bits > 0, bits - 1, tl.where(bits == 0, -32767, bits + 1)).to(tl.int16)
    lower = step.to(tl.float16, bitcast=True)
    return tl.where(nearest.to(tl.float32) > x, lower, nearest)


@triton.jit
def _quantize_kernel(
    x_ptr,
    slots_ptr,
    data_ptr,
    meta_ptr,
    s_xn,
    s_xt,
    INT4: tl.constexpr,
    BLOCK: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    blk = tl.program_id(0)
    grp = tl.program_id(1)
    tok = tl.program_id(2) * BLOCK_T + tl.arange(0, BLOCK_T)
    half = tl.arange(0, 16)  # a group of 32 values as 16 (even, odd) pairs
    G: tl.constexpr = HEAD_DIM // 32
    t_ok = tok < BLOCK
    mask = t_ok[:, None]
    src = x_ptr + blk.to(tl.int64) * s_xn + tok[:, None] * s_xt + grp * 32 + 2 * half[None, :]
    even = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    odd = tl.load(src + 1, mask=mask, other=0.0).to(tl.float32)
    slot = tl.load(slots_ptr + blk).to(tl.int64)
    if INT4:
        ROW: tl.constexpr = BLOCK * (HEAD_DIM // 2 + 4 * G)
        low = tl.minimum(tl.min(even, 1), tl.min(odd, 1))
        high = tl.maximum(tl.max(even, 1), tl.max(odd, 1))
        low = tl.minimum(tl.maximum(low, -_FP16_MAX), _FP16_MAX)
        high = tl.minimum(tl.maximum(high, -_FP16_MAX), _FP16_MAX)
        minimum = _fp16_down(low)
        minimum_f = minimum.to(tl.float32)
        scale = tl.math.div_rn(high - minimum_f, tl.full(high.shape, 15.0, tl.float32))
        scale = _fp16_down(tl.minimum(tl.maximum(scale, _SCALE_MIN), _FP16_MAX))
        scale_f = scale.to(tl.float32)[:, None]
        q_even = tl.math.div_rn(even - minimum_f[:, None], scale_f + tl.zeros_like(even))
        q_odd = tl.math.div_rn(odd - minimum_f[:, None], scale_f + tl.zeros_like(odd))
        q_even = _rint(tl.minimum(tl.maximum(q_even, 0.0), 15.0)).to(tl.int32)
        q_odd = _rint(tl.minimum(tl.maximum(q_odd, 0.0), 15.0)).to(tl.int32)
        packed = (q_even | (q_odd << 4)).to(tl.uint8)
        dst = data_ptr + slot * ROW + tok[:, None] * (HEAD_DIM // 2) + grp * 16 + half[None, :]
        tl.store(dst, packed, mask=mask)
        meta = slot * (ROW // 2) + (BLOCK * HEAD_DIM) // 4 + tok * G + grp
        tl.store(meta_ptr + meta, scale, mask=t_ok)
        tl.store(meta_ptr + meta + BLOCK * G, minimum, mask=t_ok)
    else:
        ROW: tl.constexpr = BLOCK * (HEAD_DIM + 2 * G)
        amax = tl.maximum(tl.max(tl.abs(even), 1), tl.max(tl.abs(odd), 1))
        scale = tl.math.div_rn(amax, tl.full(amax.shape, 127.0, tl.float32))
        scale = _fp16_down(tl.minimum(tl.maximum(scale, _SCALE_MIN), _FP16_MAX))
        scale_f = scale.to(tl.float32)[:, None]
        # Clamping before rounding equals rounding before clamping: the bounds are integers.
        q_even = tl.math.div_rn(even, scale_f + tl.zeros_like(even))
        q_odd = tl.math.div_rn(odd, scale_f + tl.zeros_like(odd))
        q_even = _rint(tl.minimum(tl.maximum(q_even, -127.0), 127.0)).to(tl.int8)
        q_odd = _rint(tl.minimum(tl.maximum(q_odd, -127.0), 127.0)).to(tl.int8)
        dst = data_ptr + slot * ROW + tok[:, None] * HEAD_DIM + grp * 32 + 2 * half[None, :]
        tl.store(dst, q_even, mask=mask)
        tl.store(dst + 1, q_odd, mask=mask)
        meta = slot * (ROW // 2) + (BLOCK * HEAD_DIM) // 2 + tok * G + grp
        tl.store(meta_ptr + meta, scale, mask=t_ok)


def _quantize_into(
    rows: torch.Tensor, slots: torch.Tensor, blocks: torch.Tensor, kv_type: KvType
) -> None:
    n, block, dim = blocks.shape
    if blocks.stride(-1) != 1:
        blocks = blocks.contiguous()
    data = rows.view(torch.int8) if kv_type == KvType.INT8 else rows
    block_t = min(16, triton.next_power_of_2(block))
    _quantize_kernel[(n, dim // GROUP, triton.cdiv(block, block_t))](
        blocks, slots, data, rows.view(torch.float16), blocks.stride(0), blocks.stride(1),
        INT4=kv_type == KvType.INT4, BLOCK=block, HEAD_DIM=dim, BLOCK_T=block_t,
    )  # fmt: skip


def quantize_rows(blocks: torch.Tensor, kv_type: KvType) -> torch.Tensor:
    """blocks [n, block_size, head_dim] (any float dtype) -> uint8 [n, bytes_per_slot], the
    rows BlockPool.write stores for INT8 / INT4."""
    if kv_type not in (KvType.INT8, KvType.INT4):
        raise ValueError(f"quantize_rows takes INT8 or INT4, got {kv_type!r}")
    n, block, dim = _check_blocks(blocks)
    width = block * bytes_per_token(dim, kv_type, blocks.element_size())
    rows = torch.empty((n, width), dtype=torch.uint8, device=blocks.device)
    slots = torch.arange(n, dtype=torch.int32, device=blocks.device)
    _quantize_into(rows, slots, blocks, kv_type)
    return rows


def write_blocks(pool: BlockPool, slots: torch.Tensor, blocks: torch.Tensor) -> None:
    """BlockPool.write(slots, blocks): quantized in place when the pool is on the blocks'
    device, else quantized where the blocks are and only the row bytes copied."""
    n, block, dim = _check_blocks(blocks)
    if (block, dim) != (pool.block_size, pool.head_dim) or slots.shape != (n,):
        raise ValueError(
            f"blocks {tuple(blocks.shape)} and slots {tuple(slots.shape)} do not fit a pool "
            f"of [{pool.block_size}, {pool.head_dim}] blocks"
        )
    if pool.kv_type == KvType.FP16:
        pool.write(slots, blocks)
        return
    if pool.device == blocks.device:
        _quantize_into(pool.storage, slots.to(pool.device), blocks, pool.kv_type)
        return
    rows = quantize_rows(blocks, pool.kv_type)
    pool.storage.index_copy_(0, slots.to(pool.device), rows.to(pool.device))


def _check_blocks(blocks: torch.Tensor) -> tuple[int, int, int]:
    if blocks.dim() != 3 or blocks.shape[-1] % GROUP:
        raise ValueError(
            f"blocks must be [n, block_size, head_dim] with head_dim a multiple of {GROUP}, "
            f"got {tuple(blocks.shape)}"
        )
    if not blocks.dtype.is_floating_point:
        raise ValueError(f"blocks must be floating point, got {blocks.dtype}")
    return blocks.shape[0], blocks.shape[1], blocks.shape[2]
