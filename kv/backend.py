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

from kvchat.config.enums import PositionMode

from .state import CacheState


@dataclass(frozen=True)
class LayerStats:
    """What one layer of the block-sparse cache read at the last step."""

    layer: int
    dense: bool  # attends to every block (one of the first dense_layer_num layers)
    candidates: int  # blocks it could select from
    selected: tuple[int, ...]  # block ids it read (union over KV heads in SEPARATE mode)


@dataclass(frozen=True)
class CacheStats:
    """An immutable snapshot of a cache, cheap enough to take a few times a second.

    The block fields stay zero for the dense backend, which has no blocks.
    """

    backend: str
    tokens: int
    capacity_tokens: int
    kv_bytes: int  # bytes allocated for keys and values (DRAM for the block store)
    kv_dtype: str
    position_mode: PositionMode
    block_size: int = 0
    blocks_in_dram: int = 0
    resident_tokens: int = 0  # sinks + local window, kept on the compute device
    resident_bytes: int = 0
    anchor_bytes: int = 0
    device_slots_used: int = 0
    device_slots_total: int = 0
    hits: int = 0
    misses: int = 0
    bytes_moved: int = 0
    layers: tuple[LayerStats, ...] = ()

    @property
    def hit_rate(self) -> float:
        lookups = self.hits + self.misses
        return self.hits / lookups if lookups else 0.0


class ContextFullError(RuntimeError):
    """A pass would grow the cache past the size it was planned for."""


def check_capacity(end: int, max_tokens: int) -> None:
    if end > max_tokens:
        raise ContextFullError(
            f"the cache holds at most {max_tokens} tokens "
            f"(long_context.max_seq_len); this pass would reach {end}"
        )


class AttentionBackend(ABC):
    """Owns the KV cache of one token sequence and computes attention for every layer.

    A forward pass over tokens `length .. length+n` calls `begin(n)`, then `attend` once per
    layer in order, then `commit()`. Until `commit`, `length` does not move, so a pass that
    fails midway leaves the cache as it was.
    """

    name: str = "abstract"
    max_chunk: int | None = None  # longest pass the backend accepts (None: any)
    position_mode: PositionMode = PositionMode.NATIVE

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
    def abort(self) -> None:
        """Drop the current pass (stopped between layers): the cache holds what it held before
        `begin`; what the pass wrote past `length` is written again by the next one."""

    @abstractmethod
    def truncate(self, n_tokens: int) -> None:
        """Forget every token from position `n_tokens` on."""

    @abstractmethod
    def stats(self) -> CacheStats:
        """A snapshot for the UI and benchmarks."""

    @abstractmethod
    def decode_read_bytes(self) -> int:
        """Bytes of cache (keys, values, anchors, copies made to read them) that the next
        one-token pass reads, over all layers: the cache's share of a decode step's memory
        traffic, for bandwidth-roofline reports."""

    def reserve(self, n_tokens: int) -> None:  # noqa: B027 - optional hook, most backends grow lazily
        """Hint that the sequence will reach `n_tokens`, so storage can be allocated once."""

    @abstractmethod
    def export_state(self) -> CacheState:
        """The committed cache as views of its storage (no copy), between passes only."""

    @abstractmethod
    def load_state(self, state: CacheState) -> None:
        """Make this freshly made cache hold `state` (from a cache with the same settings).

        Raises StateMismatchError when the state does not fit; the cache is then unusable.
        """
