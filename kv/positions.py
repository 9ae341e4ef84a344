"""Rotary positions as the KV cache sees them: a source of cos/sin tables and the rotation.

The tables come from the model (core/rope.py knows the rope_scaling formulas); the cache
decides which position each key and query gets, which is what InfLLM's extrapolation changes.
"""

from __future__ import annotations

from typing import Protocol

import torch


class RopeTables(Protocol):
    def cos_sin(
        self, start: int, length: int, dtype: torch.dtype, device: torch.device | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for positions start .. start+length, each [length, head_dim], on
        `device` (default: the model's)."""
        ...


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Apply RoPE (half-rotation layout, as in transformers) to x [..., T, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
