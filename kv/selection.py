"""Score candidate blocks from their anchors and pick the ones a query attends to.

Every score here is linear in a per-head weight vector derived from the query (for QUEST
too, see `_query_weights`), so the scores of a group of query heads sum to the score of
their summed weights, and scoring all blocks is one pass over the anchors as stored.
"""

from __future__ import annotations

import math

import torch

from kvchat.config.enums import AnchorType, HeadSelectMode
from kvchat.kv.anchors import anchor_rows

HEAD_SELECT_MODES = tuple(HeadSelectMode)


def score_blocks(
    q: torch.Tensor, anchors: torch.Tensor, anchor_type: AnchorType, mode: HeadSelectMode
) -> torch.Tensor:
    """Score every block for one query.

    q: [n_heads, head_dim]; anchors: [n_blocks, n_kv_heads, R, head_dim], any float dtype
    (scored in float32).
    SHARED -> float32 [n_blocks], summed over all heads; SEPARATE -> float32
    [n_kv_heads, n_blocks], each KV head summed over its group of query heads.
    """
    if mode not in HEAD_SELECT_MODES:
        raise ValueError(
            f"unknown head select mode {mode!r}; expected one of {', '.join(HeadSelectMode)}"
        )
    if q.dim() != 2:
        raise ValueError(f"q must be [n_heads, head_dim], got shape {tuple(q.shape)}")
    n_blocks, n_kv_heads, rows, head_dim = _check_anchors(anchors, anchor_type, q.shape[-1])
    group = _group_size(q.shape[0], n_kv_heads)
    weights = _query_weights(q.float(), anchor_type)
    group_weights = weights.view(n_kv_heads, group, rows * head_dim).sum(dim=1)
    anchors = anchors.float()
    if mode == HeadSelectMode.SHARED:
        flat = anchors.reshape(n_blocks, n_kv_heads * rows * head_dim)
        return flat @ group_weights.reshape(-1)
    # A broadcast dot over the anchors as stored: on CPU a matmul with only n_kv_heads
    # output columns (bmm or block-diagonal) measured 2-4x slower than this one pass.
    per_head = anchors.reshape(n_blocks, n_kv_heads, rows * head_dim)
    return torch.linalg.vecdot(per_head, group_weights).T.contiguous()


def select_top(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the top-min(k, n) scores along the last dim, sorted ascending (long)."""
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    n = scores.shape[-1]
    if k >= n:
        every = torch.arange(n, device=scores.device)
        return every.expand(*scores.shape[:-1], n).contiguous()
    top = scores.topk(k, dim=-1, sorted=False).indices
    # Ascending order lets the caller gather blocks in storage order.
    return top.sort(dim=-1).values


def pin(scores: torch.Tensor, candidates: torch.Tensor, pinned: torch.Tensor) -> torch.Tensor:
    """Scores [..., n] of the blocks `candidates` [n] with the `pinned` ids' set to +inf, so
    select_top takes them first (in place; returns scores)."""
    if len(pinned):
        scores[..., torch.isin(candidates, pinned).to(scores.device)] = float("inf")
    return scores


def preselect_vote(
    q_last: torch.Tensor, anchors: torch.Tensor, anchor_type: AnchorType, count: int
) -> torch.Tensor:
    """SnapKV-style vote of the last prompt queries: the `count` blocks they attend to most.

    q_last: [n_heads, n_q, head_dim]; anchors: [n_blocks, n_kv_heads, R, head_dim].
    Each (head, query) softmaxes its scaled scores over the blocks, so every query casts the
    same total vote whatever its norm; the votes are summed. Returns long indices, ascending.
    """
    if q_last.dim() != 3:
        raise ValueError(f"q_last must be [n_heads, n_q, head_dim], got {tuple(q_last.shape)}")
    n_heads, n_q, head_dim = q_last.shape
    n_blocks, n_kv_heads, rows, _ = _check_anchors(anchors, anchor_type, head_dim)
    group = _group_size(n_heads, n_kv_heads)
    weights = _query_weights(q_last.float(), anchor_type)
    weights = weights.reshape(n_kv_heads, group * n_q, rows * head_dim)
    per_head = anchors.float().reshape(n_blocks, n_kv_heads, rows * head_dim).permute(1, 2, 0)
    scores = torch.bmm(weights, per_head)  # [n_kv_heads, group * n_q, n_blocks]
    votes = torch.softmax(scores / math.sqrt(head_dim), dim=-1).sum(dim=(0, 1))
    return select_top(votes, count)


def _query_weights(q: torch.Tensor, anchor_type: AnchorType) -> torch.Tensor:
    """[..., head_dim] -> [..., R, head_dim], with score = sum(weights * anchor rows).

    QUEST's bound sum(max(q * lo, q * hi)) picks hi where q > 0 and lo where q < 0, so it
    equals relu(q) . hi - relu(-q) . lo: linear in the weights (-relu(-q), relu(q)).
    """
    if anchor_type == AnchorType.QUEST:
        return torch.stack((-torch.relu(-q), torch.relu(q)), dim=-2)
    return q.unsqueeze(-2)


def _check_anchors(
    anchors: torch.Tensor, anchor_type: AnchorType, head_dim: int
) -> tuple[int, int, int, int]:
    """Shape of a valid anchor tensor for this type and query width."""
    if anchors.dim() != 4:
        raise ValueError(
            f"anchors must be [n_blocks, n_kv_heads, R, head_dim], got {tuple(anchors.shape)}"
        )
    rows = anchor_rows(anchor_type)
    if anchors.shape[2] != rows or anchors.shape[3] != head_dim:
        raise ValueError(
            f"anchors of type {anchor_type} must have R={rows} and head_dim={head_dim}, "
            f"got shape {tuple(anchors.shape)}"
        )
    n_blocks, n_kv_heads, _, _ = anchors.shape
    return n_blocks, n_kv_heads, rows, head_dim


def _group_size(n_heads: int, n_kv_heads: int) -> int:
    if n_kv_heads < 1 or n_heads % n_kv_heads:
        raise ValueError(f"n_heads ({n_heads}) must be a multiple of n_kv_heads ({n_kv_heads})")
    return n_heads // n_kv_heads
