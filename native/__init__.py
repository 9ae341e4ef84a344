"""Builds the C++ CPU kernels (kv/csrc/, core/csrc/) on first use and caches them.

They are compiled with the C++ compiler torch's extension builder finds (`-march=native`: the
build is for this CPU) and cached where torch caches extensions ($TORCH_EXTENSIONS_DIR, else
~/.cache/torch_extensions) under a name that hashes the sources, so only the first process on
a machine pays the build. Where one cannot be built its caller keeps a torch path.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import sys
import time
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

INCLUDE = Path(__file__).with_name("include")
FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]
# A build takes ~30-80 s here; torch's lock file that old was left by a process killed while
# it built (Ctrl-C on a first start), and torch would wait on it forever.
STALE_LOCK_S = 600


def build_extension(prefix: str, sources: Sequence[Path]) -> ModuleType | None:
    """The module compiled from `sources` (with native/include on the include path), or None
    with a warning logged when it cannot be built."""
    from torch.utils import cpp_extension

    if shutil.which("ninja") is None:
        # torch runs `ninja` from PATH; the ninja wheel puts it next to the interpreter, which
        # is not on PATH when the virtual environment is not activated (as under `make test`).
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    name = build_name(prefix, sources)
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    build_dir = Path(root) / name
    try:
        build_dir.mkdir(parents=True, exist_ok=True)
        clear_stale_lock(build_dir)
        return cpp_extension.load(
            name=name,
            sources=[str(path) for path in sources],
            extra_cflags=FLAGS,
            extra_ldflags=["-fopenmp"],
            extra_include_paths=[str(INCLUDE)],
            build_directory=str(build_dir),
        )
    except (OSError, RuntimeError, ImportError) as err:
        log.warning("the C++ kernels %s could not be built (%s); using torch", prefix, err)
        return None


def build_name(prefix: str, sources: Sequence[Path]) -> str:
    """The cached build's name: a hash of the sources, the headers they may include (the
    shared ones and any beside them), this torch and Python, and this CPU (-march=native: a
    home directory shared with another CPU model must not load it)."""
    headers = sorted(
        {*INCLUDE.glob("*.h"), *(h for src in sources for h in src.parent.glob("*.h"))}
    )
    text = b"".join(path.read_bytes() for path in [*sources, *headers])
    versions = f"{torch.__version__} {sys.version_info[:2]} {_cpu_flags()}"
    return f"{prefix}_{hashlib.sha256(text + versions.encode()).hexdigest()[:12]}"


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


@cache
def cpuinfo() -> str:
    """The text of /proc/cpuinfo ("" where there is none): the CPU's flags and model name."""
    try:
        return Path("/proc/cpuinfo").read_text(encoding="ascii", errors="ignore")
    except OSError:
        return ""


def _cpu_flags() -> str:
    flags = (line for line in cpuinfo().splitlines() if line.startswith("flags"))
    return next(flags, platform.processor())
