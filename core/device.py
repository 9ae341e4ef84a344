"""Where the model runs and in which dtype, resolved from the `model` settings."""

from __future__ import annotations

import os

import torch

from kvchat.config import ModelDevice, ModelDtype


def resolve_device(setting: ModelDevice) -> torch.device:
    if setting == ModelDevice.CUDA and not torch.cuda.is_available():
        raise RuntimeError(
            "model.device is 'cuda' but no CUDA device is available; use 'auto' or 'cpu'"
        )
    if setting == ModelDevice.AUTO:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(str(setting))


def resolve_dtype(setting: ModelDtype) -> torch.dtype:
    """bf16 for `auto` on every device: activations, the KV cache and the C++ kernels' inputs
    are 16-bit everywhere, so every CPU keeps the same values and the same cache size (where
    bf16 products are not in hardware, the large ones run in fp32 on the widened values:
    kvchat.native.cpu)."""
    return torch.float32 if setting == ModelDtype.FLOAT32 else torch.bfloat16


def configure_threads(threads: int) -> int:
    """Set torch's intra-op threads (0 = every core this process may use); returns the count."""
    n = threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(n)
    # bf16-derived weights used in fp32 can hit denormal slow paths (10x slower decode).
    torch.set_flush_denormal(True)
    return n
