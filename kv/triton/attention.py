"""Block-sparse attention in Triton: a tile of queries over up to three key sets in one pass.

The sets are the ones a layer of the block-sparse cache reads:
- A, "local": contiguous keys read with `q_local`, optionally causal with the last query
  aligned to the last key (the local window, whose tail is the current chunk);
- B, "sinks": contiguous keys read with `q_far`, no mask;
- C, "blocks": whole blocks read with `q_far` straight from a block store (a `BlockPool`,
  host-side or a device block cache) by slot id, FP16 / INT8 / INT4, dequantized in
  registers exactly as `BlockPool.gather` does (q * scale (+ minimum) in fp32, one rounding
  to the compute dtype), so no gathered copy of the blocks is ever made.

One program owns one KV head and a tile of rows, where row r is (token r // group, query head
r % group of that KV head's group): every key is loaded once for all the query heads that read
it (GQA). The key tiles of the three sets are numbered one after the other and split across
`splits` programs (flash-decoding: a decode step has only n_kv_heads x 1 row tiles, far too
few programs for a GPU); each split keeps an online softmax and writes its output and
log-sum-exp, and the splits are merged by log-sum-exp.
"""

from __future__ import annotations

from functools import cache

import torch
import triton
import triton.language as tl

from kvchat.config.enums import KvType

from ..quant import BlockPool

LOG2E = 1.4426950408889634
# Kernels may read globals only as constexpr.
_LN2 = tl.constexpr(0.6931471805599453)
_LOG2E = tl.constexpr(LOG2E)
KV_CODES = {KvType.FP16: 0, KvType.INT8: 1, KvType.INT4: 2}


@triton.jit
def load_block_tile(
    data_ptr,
    meta_ptr,
    slot,
    tok,
    dim,
    mask,
    KV_TYPE: tl.constexpr,
    BLOCK: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    """Values at (tok, dim) (broadcastable index tensors) of the block in store row `slot`.

    FP16 pools store [BLOCK, HEAD_DIM] in the compute dtype and are returned as stored;
    quantized rows are [q | scale | minimum] bytes (see kv/quant.py) and are returned as the
    fp32 dequantization. data_ptr points at the rows (compute dtype, int8 or uint8); meta_ptr
    at the same rows viewed as fp16.
    """
    G: tl.constexpr = HEAD_DIM // 32
    if KV_TYPE == 0:
        x = tl.load(data_ptr + slot * (BLOCK * HEAD_DIM) + tok * HEAD_DIM + dim, mask=mask, other=0)
    elif KV_TYPE == 1:
        ROW: tl.constexpr = BLOCK * (HEAD_DIM + 2 * G)
        q = tl.load(data_ptr + slot * ROW + tok * HEAD_DIM + dim, mask=mask, other=0)
        meta = slot * (ROW // 2) + (BLOCK * HEAD_DIM) // 2 + tok * G + dim // 32
        scale = tl.load(meta_ptr + meta, mask=mask, other=0)
        x = q.to(tl.float32) * scale.to(tl.float32)
    else:
        ROW: tl.constexpr = BLOCK * (HEAD_DIM // 2 + 4 * G)
        byte = tl.load(data_ptr + slot * ROW + tok * (HEAD_DIM // 2) + dim // 2, mask=mask, other=0)
        # Low nibble = even index, high nibble = odd index.
        nibble = (byte.to(tl.int32) >> ((dim % 2) * 4)) & 15
        meta = slot * (ROW // 2) + (BLOCK * HEAD_DIM) // 4 + tok * G + dim // 32
        scale = tl.load(meta_ptr + meta, mask=mask, other=0)
        minimum = tl.load(meta_ptr + meta + BLOCK * G, mask=mask, other=0)
        x = nibble.to(tl.float32) * scale.to(tl.float32) + minimum.to(tl.float32)
    return x


@triton.jit
def _softmax_step(q, k_t, v, valid, m_i, l_i, acc, qk_scale, DOT_PREC: tl.constexpr):
    """One key tile of an online softmax; scores are in log2 units (qk_scale includes log2 e)."""
    s = tl.dot(q, k_t, input_precision=DOT_PREC) * qk_scale
    s = tl.where(valid, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row with no valid key yet keeps m = -inf; subtracting 0 instead avoids -inf - -inf.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return m_new, l_i, acc


@triton.jit
def _sparse_attention_kernel(
    qa_ptr,
    qb_ptr,
    ak_ptr,
    av_ptr,
    bk_ptr,
    bv_ptr,
    ck_ptr,
    ck_meta_ptr,
    cv_ptr,
    cv_meta_ptr,
    slots_ptr,
    o_ptr,
    lse_ptr,
    T,
    group,
    S_a,
    S_b,
    n_sel,
    n_split,
    qk_scale,
    s_qah,
    s_qat,
    s_qbh,
    s_qbt,
    s_akh,
    s_akn,
    s_avh,
    s_avn,
    s_bkh,
    s_bkn,
    s_bvh,
    s_bvn,
    s_slot,
    s_os,
    s_oh,
    s_ot,
    s_ls,
    CAUSAL: tl.constexpr,
    KV_TYPE: tl.constexpr,
    BLOCK: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    kv = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_s = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < T * group
    t = rows // group
    head = kv * group + rows % group
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    n = tl.arange(0, BLOCK_N)
    q_mask = row_ok[:, None] & d_ok[None, :]
    # Masked lanes must be 0, not whatever a GPU leaves there: padding dims meet padded keys.
    qa = tl.load(
        qa_ptr + head[:, None] * s_qah + t[:, None] * s_qat + d[None, :], mask=q_mask, other=0
    )
    qb = tl.load(
        qb_ptr + head[:, None] * s_qbh + t[:, None] * s_qbt + d[None, :], mask=q_mask, other=0
    )

    # Causal: the last row of this tile sees local keys up to t_last + S_a - T.
    a_end = S_a
    if CAUSAL:
        t_last = tl.minimum((pid_m * BLOCK_M + BLOCK_M - 1) // group, T - 1)
        a_end = tl.minimum(S_a, t_last + S_a - T + 1)
    TILES_PER_BLOCK: tl.constexpr = BLOCK // BLOCK_N
    tiles_a = tl.cdiv(a_end, BLOCK_N)
    tiles_ab = tiles_a + tl.cdiv(S_b, BLOCK_N)
    total = tiles_ab + n_sel * TILES_PER_BLOCK
    per_split = tl.cdiv(total, n_split)
    lo = pid_s * per_split
    hi = tl.minimum(lo + per_split, total)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    for i in range(lo, tl.minimum(hi, tiles_a)):
        keys = i * BLOCK_N + n
        key_ok = keys < S_a
        k_t = tl.load(
            ak_ptr + kv * s_akh + keys[None, :] * s_akn + d[:, None],
            mask=key_ok[None, :] & d_ok[:, None],
            other=0,
        )
        v = tl.load(
            av_ptr + kv * s_avh + keys[:, None] * s_avn + d[None, :],
            mask=key_ok[:, None] & d_ok[None, :],
            other=0,
        )
        valid = row_ok[:, None] & key_ok[None, :]
        if CAUSAL:
            valid = valid & (keys[None, :] <= t[:, None] + (S_a - T))
        m_i, l_i, acc = _softmax_step(qa, k_t, v, valid, m_i, l_i, acc, qk_scale, DOT_PREC)

    for i in range(tl.maximum(lo, tiles_a), tl.minimum(hi, tiles_ab)):
        keys = (i - tiles_a) * BLOCK_N + n
        key_ok = keys < S_b
        k_t = tl.load(
            bk_ptr + kv * s_bkh + keys[None, :] * s_bkn + d[:, None],
            mask=key_ok[None, :] & d_ok[:, None],
            other=0,
        )
        v = tl.load(
            bv_ptr + kv * s_bvh + keys[:, None] * s_bvn + d[None, :],
            mask=key_ok[:, None] & d_ok[None, :],
            other=0,
        )
        valid = row_ok[:, None] & key_ok[None, :]
        m_i, l_i, acc = _softmax_step(qb, k_t, v, valid, m_i, l_i, acc, qk_scale, DOT_PREC)

    for i in range(tl.maximum(lo, tiles_ab), hi):
        c = i - tiles_ab
        slot = tl.load(slots_ptr + kv * s_slot + c // TILES_PER_BLOCK).to(tl.int64)
        tok = (c % TILES_PER_BLOCK) * BLOCK_N + n
        k_t = load_block_tile(
            ck_ptr, ck_meta_ptr, slot, tok[None, :], d[:, None], d_ok[:, None],
            KV_TYPE, BLOCK, HEAD_DIM,
        ).to(qb.dtype)  # fmt: skip
        v = load_block_tile(
            cv_ptr, cv_meta_ptr, slot, tok[:, None], d[None, :], d_ok[None, :],
            KV_TYPE, BLOCK, HEAD_DIM,
        ).to(qb.dtype)  # fmt: skip
        valid = row_ok[:, None] & (tok[None, :] < BLOCK)
        m_i, l_i, acc = _softmax_step(qb, k_t, v, valid, m_i, l_i, acc, qk_scale, DOT_PREC)

    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    # m_i is in log2 units: lse = ln 2 * (m + log2 l).
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * _LN2)
    o_off = pid_s * s_os + head[:, None] * s_oh + t[:, None] * s_ot + d[None, :]
    tl.store(o_ptr + o_off, out.to(o_ptr.dtype.element_ty), mask=q_mask)
    tl.store(lse_ptr + pid_s * s_ls + head * T + t, lse, mask=row_ok)


@triton.jit
def _merge_kernel(
    parts_ptr,
    lses_ptr,
    out_ptr,
    lse_ptr,
    n_rows,
    n_parts,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    """Row `program_id` of n_parts partial results [n_parts, n_rows, D] merged by log-sum-exp."""
    row = tl.program_id(0).to(tl.int64)
    p = tl.arange(0, BLOCK_P)
    d = tl.arange(0, BLOCK_D)
    p_ok = p < n_parts
    lses = tl.load(lses_ptr + p * n_rows + row, mask=p_ok, other=float("-inf"))
    m = tl.max(lses, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lses - m_safe)
    total = tl.sum(w, 0)
    parts = tl.load(
        parts_ptr + (p[:, None] * n_rows + row) * HEAD_DIM + d[None, :],
        mask=p_ok[:, None] & (d[None, :] < HEAD_DIM),
        other=0.0,
    )
    merged = tl.sum(parts.to(tl.float32) * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + row * HEAD_DIM + d, merged.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)
    lse = tl.where(total == 0.0, float("-inf"), m_safe + tl.log(tl.where(total == 0.0, 1.0, total)))
    tl.store(lse_ptr + row, lse)


@triton.jit
def _window_probs_kernel(
    q_ptr,
    k_ptr,
    lse_ptr,
    out_ptr,
    group,
    S,
    qk_scale,
    s_qh,
    s_kh,
    s_kn,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """Attention probabilities exp(score - lse) of one decode query per head over S keys,
    summed over each KV head's query group: [n_kv, S] fp32."""
    kv = tl.program_id(0)
    g = tl.arange(0, BLOCK_M)
    g_ok = g < group
    head = kv * group + g
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    keys = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    key_ok = keys < S
    q = tl.load(
        q_ptr + head[:, None] * s_qh + d[None, :], mask=g_ok[:, None] & d_ok[None, :], other=0
    )
    k_t = tl.load(
        k_ptr + kv * s_kh + keys[None, :] * s_kn + d[:, None],
        mask=key_ok[None, :] & d_ok[:, None],
        other=0,
    )
    lse2 = tl.load(lse_ptr + head, mask=g_ok, other=0.0) * _LOG2E
    s = tl.dot(q, k_t, input_precision=DOT_PREC) * qk_scale
    p = tl.where(g_ok[:, None] & key_ok[None, :], tl.exp2(s - lse2[:, None]), 0.0)
    tl.store(out_ptr + kv * S + keys, tl.sum(p, 0), mask=key_ok)


def _dot_precision(dtype: torch.dtype) -> str:
    # A GPU multiplies fp32 in TF32 by default (10-bit mantissa); fp32 callers want fp32.
    return "ieee" if dtype == torch.float32 else "tf32"


def _block_n(block_size: int) -> int:
    return 64 if block_size % 64 == 0 else 32


def _check_heads(q: torch.Tensor, k: torch.Tensor, what: str) -> int:
    if q.dim() != 3 or k.dim() != 3:
        raise ValueError(f"{what}: q must be [n_heads, T, D] and keys [n_kv, S, D]")
    if q.shape[0] % k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(
            f"{what}: q {tuple(q.shape)} does not fit keys {tuple(k.shape)} "
            "(n_heads must be a multiple of n_kv and head_dim must match)"
        )
    return q.shape[0] // k.shape[0]


def _inner_contiguous(x: torch.Tensor) -> torch.Tensor:
    """x with a unit stride along head_dim (views of the window already have one)."""
    return x if x.stride(-1) == 1 else x.contiguous()


@cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def default_splits(device: torch.device, programs: int, key_tiles: int) -> int:
    """Splits of the key tiles so a GPU has about two programs per SM; 1 in the interpreter."""
    if device.type != "cuda" or key_tiles <= 1:
        return 1
    return max(1, min(-(-2 * _sm_count(device) // programs), key_tiles // 2))


def sparse_attention(
    q_local: torch.Tensor,
    q_far: torch.Tensor,
    local_k: torch.Tensor,
    local_v: torch.Tensor,
    sink_k: torch.Tensor,
    sink_v: torch.Tensor,
    k_pool: BlockPool | None,
    v_pool: BlockPool | None,
    slots: torch.Tensor | None,
    causal: bool = True,
    scale: float | None = None,
    splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over local keys (read with q_local, causal when asked), sinks and stored blocks
    (read with q_far). q_*: [n_heads, T, D]; local_*, sink_*: [n_kv, S, D] (S may be 0);
    slots: [n_kv, n_sel] store slots of each KV head's blocks (n_sel may be 0, or None).
    Returns out [n_heads, T, D] in q's dtype and fp32 LSE [n_heads, T]."""
    n_heads, t_len, dim = q_local.shape
    group = _check_heads(q_local, local_k, "sparse_attention")
    n_kv = local_k.shape[0]
    if q_far.shape != q_local.shape or sink_k.shape[0] != n_kv or sink_k.shape[2] != dim:
        raise ValueError("sparse_attention: q_far and the sinks must match q_local and local_k")
    if causal and local_k.shape[1] < t_len:
        raise ValueError(
            f"sparse_attention: causal local keys ({local_k.shape[1]}) must include the "
            f"{t_len} queries' own keys"
        )
    n_sel = 0 if slots is None else slots.shape[1]
    dtype = q_local.dtype
    kv_code, block = 0, 32
    ck = ck_meta = cv = cv_meta = local_k
    if n_sel:
        if k_pool is None or v_pool is None:
            raise ValueError("sparse_attention: slots given without block pools")
        if slots.shape[0] != n_kv or k_pool.head_dim != dim:
            raise ValueError(
                f"sparse_attention: slots {tuple(slots.shape)} / pool head_dim "
                f"{k_pool.head_dim} do not fit {n_kv} KV heads of dim {dim}"
            )
        if k_pool.kv_type == KvType.FP16 and k_pool.dtype != dtype:
            raise ValueError(f"sparse_attention: FP16 pool holds {k_pool.dtype}, q is {dtype}")
        kv_code, block = KV_CODES[k_pool.kv_type], k_pool.block_size
        ck, ck_meta = _pool_pointers(k_pool)
        cv, cv_meta = _pool_pointers(v_pool)
        slots = slots if slots.stride(1) == 1 else slots.contiguous()
    q_local, q_far = _inner_contiguous(q_local), _inner_contiguous(q_far)
    local_k, local_v = _inner_contiguous(local_k), _inner_contiguous(local_v)
    sink_k, sink_v = _inner_contiguous(sink_k), _inner_contiguous(sink_v)
    block_m = 16 if t_len * group <= 16 else 64
    block_n = _block_n(block)
    m_tiles = triton.cdiv(t_len * group, block_m)
    key_tiles = (
        triton.cdiv(local_k.shape[1], block_n)
        + triton.cdiv(sink_k.shape[1], block_n)
        + n_sel * (block // block_n)
    )
    if splits is None:
        splits = default_splits(q_local.device, n_kv * m_tiles, key_tiles)
    # One split writes the result itself; several write fp32 partials for the merge.
    out_shape = q_local.shape if splits == 1 else (splits, *q_local.shape)
    out_dtype = dtype if splits == 1 else torch.float32
    out = torch.empty(out_shape, dtype=out_dtype, device=q_local.device)
    lse = torch.empty((splits, n_heads, t_len), dtype=torch.float32, device=q_local.device)
    slot_arg = slots if n_sel else torch.zeros(1, 1, dtype=torch.int32, device=q_local.device)
    _sparse_attention_kernel[(n_kv, m_tiles, splits)](
        q_local, q_far, local_k, local_v, sink_k, sink_v, ck, ck_meta, cv, cv_meta, slot_arg,
        out, lse,
        t_len, group, local_k.shape[1], sink_k.shape[1], n_sel, splits,
        (scale if scale is not None else dim**-0.5) * LOG2E,
        q_local.stride(0), q_local.stride(1), q_far.stride(0), q_far.stride(1),
        local_k.stride(0), local_k.stride(1), local_v.stride(0), local_v.stride(1),
        sink_k.stride(0), sink_k.stride(1), sink_v.stride(0), sink_v.stride(1),
        slot_arg.stride(0),
        out.stride(0) if splits > 1 else 0, out.stride(-3), out.stride(-2), lse.stride(0),
        CAUSAL=causal, KV_TYPE=kv_code, BLOCK=block, HEAD_DIM=dim,
        BLOCK_D=triton.next_power_of_2(dim), BLOCK_M=block_m, BLOCK_N=block_n,
        DOT_PREC=_dot_precision(dtype), num_warps=4 if block_m == 16 else 8,
    )  # fmt: skip
    if splits == 1:
        return out, lse[0]
    return merge_stacked(out, lse, dtype)


def _pool_pointers(pool: BlockPool) -> tuple[torch.Tensor, torch.Tensor]:
    """The pool's rows as the kernel reads them: values (compute dtype, int8 or uint8) and fp16."""
    data = pool.storage
    if pool.kv_type == KvType.FP16:
        return data, data
    values = data.view(torch.int8) if pool.kv_type == KvType.INT8 else data
    return values, data.view(torch.float16)


def merge_stacked(
    outs: torch.Tensor, lses: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """outs [P, ..., D] (any float dtype), lses [P, ...] fp32 -> merged [..., D] in dtype, LSE."""
    n_parts, dim = outs.shape[0], outs.shape[-1]
    rows = lses[0].numel()
    outs, lses = outs.contiguous(), lses.contiguous()
    out = torch.empty(outs.shape[1:], dtype=dtype, device=outs.device)
    lse = torch.empty(lses.shape[1:], dtype=torch.float32, device=outs.device)
    _merge_kernel[(rows,)](
        outs, lses, out, lse, rows, n_parts,
        HEAD_DIM=dim, BLOCK_D=triton.next_power_of_2(dim),
        BLOCK_P=max(2, triton.next_power_of_2(n_parts)),
    )  # fmt: skip
    return out, lse


def window_probs(
    q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """Probabilities one decode query per head [n_heads, 1, D] gave keys k [n_kv, S, D], given
    the LSE [n_heads, 1] of its whole attention; summed over each group: [n_kv, S] fp32."""
    group = _check_heads(q, k, "window_probs")
    n_kv, s_len, dim = k.shape
    if q.shape[1] != 1:
        raise ValueError(f"window_probs takes one query per head, got {q.shape[1]}")
    out = torch.empty((n_kv, s_len), dtype=torch.float32, device=q.device)
    if s_len == 0:
        return out
    q, k = _inner_contiguous(q), _inner_contiguous(k)
    block_n = 64
    _window_probs_kernel[(n_kv, triton.cdiv(s_len, block_n))](
        q, k, lse.contiguous(), out, group, s_len,
        (scale if scale is not None else dim**-0.5) * LOG2E,
        q.stride(0), k.stride(0), k.stride(1),
        HEAD_DIM=dim, BLOCK_D=triton.next_power_of_2(dim),
        BLOCK_M=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n,
        DOT_PREC=_dot_precision(q.dtype),
    )  # fmt: skip
    return out


def partial_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """kv.attention.partial_attention: q [n_heads, T, D] over k, v [n_kv, S, D]; causal aligns
    the last query with the last key. Returns out (q's dtype) and fp32 LSE [n_heads, T]."""
    empty = k[:, :0]
    return sparse_attention(q, q, k, v, empty, empty, None, None, None, causal, scale)
