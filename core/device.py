"""Where the model runs and in which dtype, resolved from the `model` settings."""

from __future__ import annotations

import os
import platform

import torch

from kvchat.native import cpuinfo


def cpu_has_bf16() -> bool:
    """True when the CPU computes bf16 natively (AVX512-BF16 or AMX); then bf16 is fastest."""
    flags = cpuinfo()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def cpu_name() -> str:
    """The CPU's model name ("AMD EPYC ...", "Intel(R) Xeon(R) ..."), for benchmark reports:
    speed differs by machine class, so every result says which one it ran on."""
    for line in cpuinfo().splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and value.strip():
            return value.strip()
    return platform.processor() or platform.machine()


def resolve_device(setting: str) -> torch.device:
    if setting == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(
            "model.device is 'cuda' but no CUDA device is available; use 'auto' or 'cpu'"
        )
    if setting == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(setting)


def resolve_dtype(setting: str, device: torch.device) -> torch.dtype:
    if setting == "auto":
        # Without native bf16, bf16 matmuls run emulated and fp32 is faster.
        fast_bf16 = device.type == "cuda" or cpu_has_bf16()
        return torch.bfloat16 if fast_bf16 else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[setting]


def configure_threads(threads: int) -> int:
    """Set torch's intra-op threads (0 = every core this process may use); returns the count."""
    n = threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(n)
    # bf16-derived weights used in fp32 can hit denormal slow paths (10x slower decode).
    torch.set_flush_denormal(True)
    return n
