"""The CPU kernels of the block-sparse cache (kv/csrc/), built on first use.

torch's small bf16 matmuls read a decode step's keys at ~8 GB/s here (README, "Where a 128K
decode step's time goes") and its block selection is a dozen small ops per layer; the
kernels read each key, value and anchor once, in place, and are what the block-sparse cache
uses on the CPU (decode attention, and block selection). They are compiled with the C++ compiler
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
import sys
import time
from functools import cache
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

SOURCES = [
    Path(__file__).with_name("csrc") / name
    for name in ("bindings.cpp", "decode_attention.cpp", "select_blocks.cpp")
]
HEADERS = [Path(__file__).with_name("csrc") / "bf16.h"]
FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]
# How decode_attention's sets are stored (the kernel's Format).
_FORMATS = {"FP16": 0, "INT8": 1, "INT4": 2}
# A build takes ~30-80 s here; torch's lock file that old was left by a process killed while
# it built (Ctrl-C on a first start), and torch would wait on it forever.
STALE_LOCK_S = 600


@cache
def load() -> ModuleType | None:
    """The compiled kernels' module, or None (with a warning logged) when it cannot be built."""
    from torch.utils import cpp_extension

    if shutil.which("ninja") is None:
        # torch runs `ninja` from PATH; the ninja wheel puts it next to the interpreter, which
        # is not on PATH when the virtual environment is not activated (as under `make test`).
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    # The build is for these sources, this torch and Python, and this CPU (-march=native:
    # a home directory shared with another CPU model must not load it).
    sources = b"".join(path.read_bytes() for path in SOURCES + HEADERS)
    versions = f"{torch.__version__} {sys.version_info[:2]} {_cpu_flags()}"
    name = f"kvchat_cpu_kernels_{hashlib.sha256(sources + versions.encode()).hexdigest()[:12]}"
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    build_dir = Path(root) / name
    try:
        build_dir.mkdir(parents=True, exist_ok=True)
        clear_stale_lock(build_dir)
        return cpp_extension.load(
            name=name,
            sources=[str(path) for path in SOURCES],
            extra_cflags=FLAGS,
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir),
        )
    except (OSError, RuntimeError, ImportError) as err:
        log.warning("the CPU kernels could not be built (%s); using torch attention", err)
        return None


def clear_stale_lock(build_dir: Path, max_age_s: float = STALE_LOCK_S) -> bool:
    """Remove torch's build lock in build_dir when it is older than max_age_s (its builder
    is gone); True when one was removed."""
    lock = build_dir / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    if age <= max_age_s:
        return False
    log.warning("removing a stale build lock (%.0f s old, left by a killed build): %s", age, lock)
    lock.unlink(missing_ok=True)
    return True


def _cpu_flags() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    return next((line for line in text.splitlines() if line.startswith("flags")), "")


def decode_attention(
    q0: torch.Tensor,
    q1: torch.Tensor,
    sets: list[tuple],
    n_kv: int,
) -> torch.Tensor:
    """One decode query per head over key sets read in place; [n_heads, 1, D] in q0's dtype.

    q0, q1: [n_heads, 1, D], the two rotations of the query. Each set is (k, v, qid, stride,
    rows, starts[, kv_type]): contiguous K and V sources of the same shape, read as rows of D
    elements `stride` elements apart, `rows` rows from each element offset in starts (int64
    [n_kv, runs]), scored with q0 (qid 0) or q1 (qid 1). With kv_type "INT8" or "INT4" the
    sources are such a BlockPool's storage and each run one block (starts in bytes, stride D),
    dequantized in the kernel as the pool's gather would. One softmax over every set; the
    first set is in the kv dtype.
    """
    n_heads, _, dim = q0.shape
    out = _module().decode_attention(
        q0,
        q1,
        [s[0] for s in sets],
        [s[1] for s in sets],
        [s[2] for s in sets],
        [s[3] for s in sets],
        [s[4] for s in sets],
        [s[5] for s in sets],
        [_FORMATS[s[6] if len(s) > 6 else "FP16"] for s in sets],
        n_kv,
        dim**-0.5,
    )
    return out.reshape(n_heads, 1, dim).to(q0.dtype)


def select_blocks(
    query: torch.Tensor,
    anchors: torch.Tensor,
    first: int,
    last: int,
    k: int,
    anchor_type: str,
    mode: str,
) -> torch.Tensor:
    """The top-min(k, n) blocks among first..last-1 for `query` (fp32 [n_heads, D]), as
    kv.selection.score_blocks + select_top rank them: ids ascending, [k] for SHARED or
    [n_kv, k] for SEPARATE. anchors: the layer's fp32 or bf16 [n_blocks, n_kv, R, D]. Equal
    scores go to the lower id."""
    return _module().select_blocks(
        query, anchors, first, last, k, anchor_type == "QUEST", mode == "SHARED"
    )


def _module() -> ModuleType:
    module = load()
    assert module is not None, "the CPU kernels are not built: check load() first"
    return module
