"""The CPU decode-attention kernel (kv/csrc/decode_attention.cpp), built on first use.

torch's small bf16 matmuls read a decode step's keys at ~8 GB/s here (README, "Where a 128K
decode step's time goes"); the kernel reads each key and value once, in place, and is what
the block-sparse cache uses for decode on the CPU. It is compiled with the C++ compiler
torch's extension builder finds (`-march=native`: the build is for this CPU) and cached where
torch caches extensions ($TORCH_EXTENSIONS_DIR, else ~/.cache/torch_extensions), so only the
first process on a machine pays the ~30 s.
Where it cannot be built the cache keeps the torch path and says why once.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
from functools import cache
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "decode_attention.cpp"
FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]


@cache
def load() -> ModuleType | None:
    """The compiled kernel module, or None (with a warning logged) when it cannot be built."""
    from torch.utils import cpp_extension

    if shutil.which("ninja") is None:
        # torch runs `ninja` from PATH; the ninja wheel puts it next to the interpreter, which
        # is not on PATH when the virtual environment is not activated (as under `make test`).
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    # -march=native code is for this CPU: a home directory shared with another CPU model
    # must not load it, so the CPU's feature flags are part of the build's name.
    key = hashlib.sha256(SOURCE.read_bytes() + _cpu_flags().encode()).hexdigest()[:12]
    try:
        return cpp_extension.load(
            name=f"kvchat_decode_attention_{key}",
            sources=[str(SOURCE)],
            extra_cflags=FLAGS,
            extra_ldflags=["-fopenmp"],
        )
    except (OSError, RuntimeError, ImportError) as err:
        log.warning("the CPU decode kernel could not be built (%s); using torch attention", err)
        return None


def _cpu_flags() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    return next((line for line in text.splitlines() if line.startswith("flags")), "")


def decode_attention(
    q0: torch.Tensor,
    q1: torch.Tensor,
    sets: list[tuple[torch.Tensor, torch.Tensor, int, int, int, torch.Tensor]],
    n_kv: int,
) -> torch.Tensor:
    """One decode query per head over key sets read in place; [n_heads, 1, D] in q0's dtype.

    q0, q1: [n_heads, 1, D], the two rotations of the query. Each set is (k, v, qid, stride,
    rows, starts): contiguous K and V sources of the same shape, read as rows of D elements
    `stride` elements apart, `rows` rows from each element offset in starts (int64
    [n_kv, runs]), scored with q0 (qid 0) or q1 (qid 1). One softmax over every set.
    """
    module = load()
    assert module is not None, "decode_attention needs the kernel: check load() first"
    n_heads, _, dim = q0.shape
    out = module.decode_attention(
        q0,
        q1,
        [s[0] for s in sets],
        [s[1] for s in sets],
        [s[2] for s in sets],
        [s[3] for s in sets],
        [s[4] for s in sets],
        [s[5] for s in sets],
        n_kv,
        dim**-0.5,
    )
    return out.reshape(n_heads, 1, dim).to(q0.dtype)
