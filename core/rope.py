"""Rotary position embeddings with the rope_scaling types of transformers (same formulas)."""

from __future__ import annotations

import math

import torch

from .model_config import ModelConfig, RopeScaling


def _base_inv_freq(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _yarn(theta: float, dim: int, rs: RopeScaling, max_pos: int) -> tuple[torch.Tensor, float]:
    factor = rs.factor
    original = rs.original_max_position_embeddings or max_pos

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = rs.attention_factor
    if attention_factor is None:
        if rs.mscale and rs.mscale_all_dim:
            attention_factor = get_mscale(factor, rs.mscale) / get_mscale(factor, rs.mscale_all_dim)
        else:
            attention_factor = get_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(rs.beta_fast), correction_dim(rs.beta_slow)
    if rs.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoids a division by zero in the ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep, attention_factor


def _llama3(theta: float, dim: int, rs: RopeScaling, max_pos: int) -> torch.Tensor:
    inv_freq = _base_inv_freq(theta, dim)
    old_context = rs.original_max_position_embeddings or max_pos
    low_wavelen = old_context / rs.low_freq_factor
    high_wavelen = old_context / rs.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rs.factor, inv_freq)
    smooth = (old_context / wavelen - rs.low_freq_factor) / (
        rs.high_freq_factor - rs.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


class Rope:
    """cos/sin for any range of absolute positions, computed on demand.

    Angles are computed in float64: at a position of 1M, a float32 product of position and
    frequency is off by ~0.06 rad, which would blur positions at the lengths kvchat is for.
    Nothing is tabulated, so a 1M-token context costs no table memory.
    Dynamic NTK scaling changes the frequencies with the sequence length; like transformers it
    uses the length reached by the current forward call, so a growing session matches a model
    that is called once per chunk.
    """

    def __init__(self, cfg: ModelConfig, device: torch.device | str = "cpu") -> None:
        self.cfg = cfg
        self.dim = cfg.head_dim
        self.device = torch.device(device)
        rs = cfg.rope_scaling
        self.attention_factor = 1.0
        if rs.rope_type == "linear":
            self.inv_freq = _base_inv_freq(cfg.rope_theta, self.dim) / rs.factor
        elif rs.rope_type == "yarn":
            self.inv_freq, self.attention_factor = _yarn(
                cfg.rope_theta, self.dim, rs, cfg.max_position_embeddings
            )
        elif rs.rope_type == "llama3":
            self.inv_freq = _llama3(cfg.rope_theta, self.dim, rs, cfg.max_position_embeddings)
        else:
            self.inv_freq = _base_inv_freq(cfg.rope_theta, self.dim)

    def _dynamic_inv_freq(self, seq_len: int) -> torch.Tensor:
        cfg, rs = self.cfg, self.cfg.rope_scaling
        seq_len = max(seq_len, cfg.max_position_embeddings)
        base = cfg.rope_theta * (
            (rs.factor * seq_len / cfg.max_position_embeddings) - (rs.factor - 1)
        ) ** (self.dim / (self.dim - 2))
        return _base_inv_freq(base, self.dim)

    def cos_sin(
        self, start: int, length: int, dtype: torch.dtype, device: torch.device | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Tables for positions start..start+length, shaped [length, head_dim], on `device`
        (default: the model's)."""
        device = self.device if device is None else device
        inv_freq = self.inv_freq
        if self.cfg.rope_scaling.rope_type == "dynamic":
            inv_freq = self._dynamic_inv_freq(start + length)
        t = torch.arange(start, start + length, dtype=torch.float64)
        freqs = torch.outer(t, inv_freq.double())
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.attention_factor).to(device=device, dtype=dtype)
        sin = (emb.sin() * self.attention_factor).to(device=device, dtype=dtype)
        return cos, sin
