"""Block anchors: the few vectors per KV block that stand in for its keys when scoring.

A block of `block_size` keys gets anchors when it leaves the local window. Anchors are a
uniform tensor `[n_kv_heads, R, head_dim]` per block (R = 2 for QUEST's min/max bounds, else
1), so the selection code scores every block in one pass.

QUEST's and BLOCK_MAX's anchors are values of the keys themselves (per-channel minimum and
maximum), so they are stored exactly in the keys' dtype: with bf16 keys, half the bytes that
scoring reads per candidate, per layer, per token (at 128K, 23 MB a decode step instead of 46).
Averages (BLOCK_MEAN, DYNAMIC and FIXED) keep float32.
"""

from __future__ import annotations

import torch

from kvchat.config.enums import WHOLE_BLOCK_ANCHOR_TYPES, AnchorType

ANCHOR_TYPES = tuple(AnchorType)

# Types whose anchors are key values, exact in the keys' dtype.
_KEY_VALUED_TYPES = frozenset({AnchorType.BLOCK_MAX, AnchorType.QUEST})


def anchor_rows(anchor_type: AnchorType) -> int:
    """R, the number of anchor vectors stored per block and KV head."""
    _check_type(anchor_type)
    return 2 if anchor_type == AnchorType.QUEST else 1


def anchor_dtype(anchor_type: AnchorType, key_dtype: torch.dtype) -> torch.dtype:
    """The dtype anchors of this type are stored in, for keys of `key_dtype`."""
    _check_type(anchor_type)
    return key_dtype if anchor_type in _KEY_VALUED_TYPES else torch.float32


def anchor_itemsize(anchor_type: AnchorType, key_itemsize: int) -> int:
    """Bytes per stored anchor element, for keys of `key_itemsize` bytes (the memory plan's)."""
    _check_type(anchor_type)
    return key_itemsize if anchor_type in _KEY_VALUED_TYPES else 4


def validate_anchor_settings(anchor_type: AnchorType, anchor_num: int, block_size: int) -> None:
    """Raise ValueError when the anchor settings cannot describe a block."""
    _check_type(anchor_type)
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if anchor_num < 1:
        raise ValueError(f"anchor_num must be >= 1, got {anchor_num}")
    if anchor_type in WHOLE_BLOCK_ANCHOR_TYPES and anchor_num != 1:
        raise ValueError(
            f"anchor_type {anchor_type} summarises the whole block: anchor_num must be 1, "
            f"got {anchor_num}"
        )
    if anchor_num > block_size:
        raise ValueError(
            f"anchor_num ({anchor_num}) cannot exceed block_size ({block_size}): "
            "a block has only block_size tokens to pick from"
        )


def block_anchors(
    keys: torch.Tensor,
    anchor_type: AnchorType,
    anchor_num: int,
    received: torch.Tensor | None = None,
) -> torch.Tensor:
    """Anchors of one block or of a batch of blocks.

    keys: [n_kv_heads, block_size, head_dim] or [n_blocks, n_kv_heads, block_size, head_dim],
    any float dtype. received (DYNAMIC only, ignored otherwise): attention each token received
    while in the local window, keys' shape without head_dim. Returns float32
    [(n_blocks,) n_kv_heads, R, head_dim].
    """
    if keys.dim() not in (3, 4):
        raise ValueError(f"keys must be 3-D or 4-D, got shape {tuple(keys.shape)}")
    validate_anchor_settings(anchor_type, anchor_num, keys.shape[-2])
    if anchor_type == AnchorType.BLOCK_MEAN:
        return keys.float().mean(dim=-2, keepdim=True)
    if anchor_type == AnchorType.BLOCK_MAX:
        return keys.amax(dim=-2, keepdim=True).float()
    if anchor_type == AnchorType.QUEST:
        return torch.stack((keys.amin(dim=-2), keys.amax(dim=-2)), dim=-2).float()
    if anchor_type == AnchorType.DYNAMIC:
        token_idx = _dynamic_indices(keys, anchor_num, received)
    else:
        token_idx = fixed_indices(keys.shape[-2], anchor_num, keys.device)
        token_idx = token_idx.expand(*keys.shape[:-2], anchor_num)
    return _mean_of_tokens(keys, token_idx)


def fixed_indices(block_size: int, anchor_num: int, device: torch.device) -> torch.Tensor:
    """The middle token of each of anchor_num equal slices of the block.

    Distinct whenever anchor_num <= block_size, and every token when they are equal.
    """
    slices = torch.arange(anchor_num, device=device)
    return ((2 * slices + 1) * block_size) // (2 * anchor_num)


def _dynamic_indices(
    keys: torch.Tensor, anchor_num: int, received: torch.Tensor | None
) -> torch.Tensor:
    """The anchor_num most-attended tokens per (block, head); FIXED where nothing was received."""
    fixed = fixed_indices(keys.shape[-2], anchor_num, keys.device).expand(
        *keys.shape[:-2], anchor_num
    )
    if received is None:
        return fixed
    if received.shape != keys.shape[:-1]:
        raise ValueError(
            f"received must have shape {tuple(keys.shape[:-1])}, got {tuple(received.shape)}"
        )
    top = received.topk(anchor_num, dim=-1).indices
    # A block can leave the window before any later query saw it (e.g. at the end of a
    # prefill chunk): its received row is all zero and the ranking would be arbitrary.
    saw_attention = (received != 0).any(dim=-1, keepdim=True)
    return torch.where(saw_attention, top, fixed)


def _mean_of_tokens(keys: torch.Tensor, token_idx: torch.Tensor) -> torch.Tensor:
    """Mean of the chosen keys: scoring it equals averaging their scores, by linearity."""
    gather_idx = token_idx.unsqueeze(-1).expand(*token_idx.shape, keys.shape[-1])
    chosen = keys.gather(dim=-2, index=gather_idx)
    return chosen.float().mean(dim=-2, keepdim=True)


def _check_type(anchor_type: str) -> None:
    if anchor_type not in ANCHOR_TYPES:
        raise ValueError(
            f"unknown anchor_type {anchor_type!r}; expected one of {', '.join(AnchorType)}"
        )


def received_attention(q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Attention the last queries of a chunk (q [n_heads, m, D], rotated) give each key of
    the window (keys [n_kv, T, D], the chunk's m keys last), summed over queries and a KV
    head's query heads, [n_kv, T] in fp32: what DYNAMIC anchors weigh a block's keys by."""
    n_kv, n_keys, dim = keys.shape
    m = q.shape[1]
    group = q.shape[0] // n_kv
    queries = q.float().reshape(n_kv, group * m, dim)
    scores = torch.matmul(queries, keys.float().transpose(1, 2)) * dim**-0.5
    # Query i of the last m sits at window column n_keys - m + i: it sees keys up to it.
    cols = torch.arange(n_keys, device=keys.device)
    rows = torch.arange(m, device=keys.device).repeat(group) + (n_keys - m)
    scores.masked_fill_(cols[None, None, :] > rows[None, :, None], float("-inf"))
    return torch.softmax(scores, dim=-1).sum(dim=1)
