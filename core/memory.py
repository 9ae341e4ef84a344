"""Process memory: what this process holds, and giving freed heap back to the OS."""

from __future__ import annotations

import ctypes
import ctypes.util
from functools import cache

import psutil


@cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
    except OSError:
        return None
    return libc if hasattr(libc, "malloc_trim") else None


def release_freed_memory() -> None:
    """Return freed heap pages to the OS (glibc's malloc_trim; nothing elsewhere).

    Loading a model builds fp32 copies of every tensor in MB-sized pieces that glibc keeps in
    its arenas after they are freed: ~0.65 GiB of RSS for SmolLM2-135M that the process never
    uses again but the memory plan would otherwise have to count.
    """
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


def process_rss() -> int:
    return psutil.Process().memory_info().rss
