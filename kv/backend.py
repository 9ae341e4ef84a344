"""The attention-backend interface: the one seam between the decoder and the KV cache.

The model hands every layer's queries, keys and values to a backend, *before* RoPE, and the
backend decides where keys live, which positions they get and which of them each query reads.
Dense attention and the block-sparse cache are two backends behind this interface, so the
model code never changes when the cache does.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CacheStats:
    """An immutable snapshot of a cache, cheap enough to take a few times a second."""

    backend: str
    tokens: int
    capacity_tokens: int
    kv_bytes: int
    kv_dtype: str
    position_mode: str


class AttentionBackend(ABC):
    """Owns the KV cache of one token sequence and computes attention for every layer.

    A forward pass over tokens `length .. length+n` calls `begin(n)`, then `attend` once per
    layer in order, then `commit()`. Until `commit`, `length` does not move, so a pass that
    fails midway leaves the cache as it was.
    """

    name: str = "abstract"

    @property
    @abstractmethod
    def length(self) -> int:
        """Tokens whose keys and values are committed to the cache."""

    @abstractmethod
    def begin(self, n_new: int) -> None:
        """Prepare a pass over the next `n_new` tokens (positions length .. length+n_new)."""

    @abstractmethod
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store k, v and return attention of q over the cached and new tokens, causally.

        q: [n_heads, n_new, head_dim]; k, v: [n_kv_heads, n_new, head_dim], all before RoPE.
        Returns [n_heads, n_new, head_dim].
        """

    @abstractmethod
    def commit(self) -> None:
        """Make the tokens of the current pass part of the cache."""

    @abstractmethod
    def truncate(self, n_tokens: int) -> None:
        """Forget every token from position `n_tokens` on."""

    @abstractmethod
    def stats(self) -> CacheStats:
        """A snapshot for the UI and benchmarks."""

    def reserve(self, n_tokens: int) -> None:  # noqa: B027 - optional hook, most backends grow lazily
        """Hint that the sequence will reach `n_tokens`, so storage can be allocated once."""
