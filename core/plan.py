"""Memory planning: what a context of n tokens needs, and whether this machine has it.

The Engine checks the plan before any prefill, so an accepted prompt never ends in an
out-of-memory kill halfway through.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import psutil

from .model_config import ModelConfig

if TYPE_CHECKING:
    from .engine import Engine

# Leave room for the OS, the UI and allocator slack.
_USABLE_FRACTION = 0.85


class PlanRefusedError(ValueError):
    """A prompt exceeds the configured context or this machine's memory; says what to change."""


def kv_bytes_per_token(cfg: ModelConfig, itemsize: int) -> int:
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * itemsize


def activation_bytes(cfg: ModelConfig, chunk_size: int) -> int:
    """Transient fp32 tensors of one prefill chunk (residual, projections, MLP), rounded up."""
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    per_token = 4 * cfg.hidden_size + 3 * cfg.intermediate_size + 3 * qkv
    return 4 * chunk_size * per_token


@dataclass(frozen=True)
class MemoryPlan:
    n_tokens: int
    weights_bytes: int
    kv_bytes: int
    activation_bytes: int
    allocated_kv_bytes: int  # already held by the current cache
    available_bytes: int

    @property
    def needed_bytes(self) -> int:
        """Memory still to be allocated to run n_tokens."""
        return max(self.kv_bytes - self.allocated_kv_bytes, 0) + self.activation_bytes

    @property
    def fits(self) -> bool:
        return self.needed_bytes <= self.available_bytes * _USABLE_FRACTION

    def refusal(self) -> str:
        gib = 1024**3
        return (
            f"{self.n_tokens} tokens need {self.needed_bytes / gib:.2f} GiB more memory "
            f"(KV cache {self.kv_bytes / gib:.2f} GiB) but only "
            f"{self.available_bytes * _USABLE_FRACTION / gib:.2f} GiB is usable. Shorten the "
            f"document or lower long_context.max_seq_len."
        )


def make_plan(engine: Engine, n_tokens: int) -> MemoryPlan:
    cfg = engine.config
    cache = engine.session.cache.stats()
    return MemoryPlan(
        n_tokens=n_tokens,
        weights_bytes=engine.model.nbytes,
        kv_bytes=n_tokens * kv_bytes_per_token(cfg, engine.model.dtype.itemsize),
        activation_bytes=activation_bytes(cfg, engine.settings.long_context.chunk_size),
        allocated_kv_bytes=cache.kv_bytes,
        available_bytes=psutil.virtual_memory().available,
    )
