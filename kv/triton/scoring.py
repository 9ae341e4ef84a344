"""Anchor scoring in Triton: every candidate block's score for one query, all anchor types.

Mirrors kv.selection.score_blocks. Each score is linear in per-head weights derived from the
query (q itself, or (-relu(-q), relu(q)) against QUEST's (min, max) rows), so a program sums
the weights of each KV head's query group once and takes one dot product per anchor row. The
candidates' anchors are read in place by id: the [n_candidates, ...] copy that
`anchors[candidates]` makes on the torch path is never built.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvchat.config.enums import AnchorType, HeadSelectMode

from ..anchors import anchor_rows
from ..selection import HEAD_SELECT_MODES


@triton.jit
def _score_kernel(
    q_ptr,
    anchors_ptr,
    cand_ptr,
    out_ptr,
    n_cand,
    n_kv,
    group,
    s_qh,
    s_ab,
    s_akv,
    ROWS: tl.constexpr,
    QUEST: tl.constexpr,
    SHARED: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    b = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    b_ok = b < n_cand
    blocks = tl.load(cand_ptr + b, mask=b_ok, other=0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    g = tl.arange(0, BLOCK_G)
    g_ok = g < group
    total = tl.zeros([BLOCK_B], tl.float32)
    for kv in range(n_kv):
        q = tl.load(
            q_ptr + (kv * group + g[:, None]) * s_qh + d[None, :],
            mask=g_ok[:, None] & d_ok[None, :],
            other=0.0,
        ).to(tl.float32)
        score = tl.zeros([BLOCK_B], tl.float32)
        for r in tl.static_range(ROWS):
            if QUEST:
                # Row 0 holds the block's minimum, row 1 its maximum.
                if r == 0:
                    w = tl.sum(tl.minimum(q, 0.0), 0)
                else:
                    w = tl.sum(tl.maximum(q, 0.0), 0)
            else:
                w = tl.sum(q, 0)
            a = tl.load(
                anchors_ptr + blocks[:, None] * s_ab + kv * s_akv + r * HEAD_DIM + d[None, :],
                mask=b_ok[:, None] & d_ok[None, :],
                other=0.0,
            ).to(tl.float32)
            score += tl.sum(a * w[None, :], 1)
        if SHARED:
            total += score
        else:
            tl.store(out_ptr + kv * n_cand + b, score, mask=b_ok)
    if SHARED:
        tl.store(out_ptr + b, total, mask=b_ok)


def score_blocks(
    q: torch.Tensor,
    anchors: torch.Tensor,
    anchor_type: AnchorType,
    mode: HeadSelectMode,
    candidates: torch.Tensor | None = None,
) -> torch.Tensor:
    """kv.selection.score_blocks(q, anchors[candidates], anchor_type, mode), without the copy.

    q: [n_heads, head_dim]; anchors: [n_blocks, n_kv_heads, R, head_dim], fp32 or the keys'
    dtype (contiguous per block); candidates: block ids (long or int), default every block.
    Returns fp32 [n] (SHARED) or [n_kv_heads, n] (SEPARATE).
    """
    if mode not in HEAD_SELECT_MODES:
        raise ValueError(
            f"unknown head select mode {mode!r}; expected one of {', '.join(HeadSelectMode)}"
        )
    rows = anchor_rows(anchor_type)
    if anchors.dim() != 4 or anchors.shape[2] != rows or anchors.shape[3] != q.shape[-1]:
        raise ValueError(
            f"anchors of type {anchor_type} must be [n_blocks, n_kv_heads, {rows}, "
            f"{q.shape[-1]}], got {tuple(anchors.shape)}"
        )
    if not anchors.is_floating_point():
        raise ValueError(f"anchors must be a float tensor, got {anchors.dtype}")
    n_kv, dim = anchors.shape[1], anchors.shape[3]
    if q.dim() != 2 or q.shape[0] % n_kv:
        raise ValueError(f"q must be [n_heads, head_dim] with n_heads a multiple of {n_kv}")
    if candidates is None:
        candidates = torch.arange(anchors.shape[0], device=anchors.device)
    n_cand = candidates.shape[0]
    shared = mode == HeadSelectMode.SHARED
    out = torch.empty((n_cand,) if shared else (n_kv, n_cand), dtype=torch.float32, device=q.device)
    if n_cand == 0:
        return out
    # Each block's [n_kv, R, D] must be dense; the block stride may be anything.
    if anchors.stride()[1:] != (rows * dim, dim, 1):
        anchors = anchors.contiguous()
    q = q if q.stride(-1) == 1 else q.contiguous()
    group = q.shape[0] // n_kv
    block_b = 64
    _score_kernel[(triton.cdiv(n_cand, block_b),)](
        q, anchors, candidates.contiguous(), out, n_cand, n_kv, group,
        q.stride(0), anchors.stride(0), anchors.stride(1),
        ROWS=rows, QUEST=anchor_type == AnchorType.QUEST, SHARED=shared, HEAD_DIM=dim,
        BLOCK_D=triton.next_power_of_2(dim), BLOCK_G=triton.next_power_of_2(group),
        BLOCK_B=block_b,
    )  # fmt: skip
    return out
