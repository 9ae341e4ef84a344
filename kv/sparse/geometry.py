"""The shape of a block-sparse cache: what the model puts in it and how much of it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvchat.config import LongContextSettings

SINK_BLOCKS = 1
RECEIVED_QUERIES = 64  # prefill queries whose attention feeds DYNAMIC anchors
PROMPT_QUERIES = 32  # last prompt queries that vote in preselection and pinning


@dataclass(frozen=True)
class CacheGeometry:
    """The model's side of a cache: layers, heads, precision, where it computes, how many
    tokens it may hold and the context the model was trained on."""

    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    max_tokens: int
    trained_context: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "device", torch.device(self.device))

    @property
    def token_bytes(self) -> int:
        """Bytes of one token's keys and values over the KV heads, in full precision."""
        return 2 * self.n_kv_heads * self.head_dim * self.dtype.itemsize


def window_capacity(lc: LongContextSettings) -> int:
    """Tokens kept in full precision per layer: the local window, the partial block, the
    sink-to-window gap, and one pass of new tokens. The planner sizes memory with it too."""
    return lc.local_windows_len + 2 * lc.block_size + lc.chunk_size
