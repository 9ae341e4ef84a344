"""Host memory that kvchat maps itself, so a file's pages can be mapped into a cache in place of
a copy.

A restored 1M-token cache is gigabytes: copying it from a snapshot costs a fault and a zeroed
page for every 4 KiB of fresh memory, which on a VM runs at well under the copy's own speed.
Mapping the file's pages privately over the cache's memory costs page-table entries instead:
the pages come from the page cache when read, and a write copies only the page it touches.

Only memory allocated here is ever mapped over: a region of our own, unmapped whole when its
last tensor goes, so no allocator ever hands out a page that reads back as file contents.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
import weakref
from collections.abc import Callable

import torch

PAGE = mmap.PAGESIZE
_MIN_MAPPED = 16 * PAGE  # below this a copy is as cheap as the system call
_MAP_FIXED = 0x10  # the same on Linux and macOS, which Python's mmap module does not export
_owned: dict[int, int] = {}  # base address -> size of every live region allocated here


def _libc_mmap() -> Callable[..., int | None] | None:
    if sys.platform not in ("linux", "darwin") or not hasattr(mmap, "MAP_ANONYMOUS"):
        return None
    fn = ctypes.CDLL(None, use_errno=True).mmap
    fn.restype = ctypes.c_void_p
    fn.argtypes = (
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int64,
    )
    return fn


_mmap = _libc_mmap()


def allocate(nbytes: int) -> torch.Tensor:
    """A uint8 tensor of `nbytes` page-aligned bytes that restores may map file pages into
    (plain torch memory where the platform cannot). Pages are made when first touched."""
    if _mmap is None:
        return torch.empty(nbytes, dtype=torch.uint8)
    region = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # The tensor keeps the region alive; the region's end unmaps whatever was mapped into it.
    data = torch.frombuffer(region, dtype=torch.uint8, count=nbytes)
    base = data.data_ptr()
    _owned[base] = len(region)
    weakref.finalize(region, _owned.pop, base, None)
    return data


def _owns(t: torch.Tensor) -> bool:
    storage = t.untyped_storage()
    base = storage.data_ptr()
    size = _owned.get(base)
    end = t.data_ptr() + t.numel() * t.element_size()
    return size is not None and base <= t.data_ptr() and end <= base + size


def copy_from_file(dest: torch.Tensor, src: torch.Tensor, fd: int, offset: int) -> None:
    """`dest.copy_(src)` for a contiguous `src` that is a private mapping of the open file `fd`
    from byte `offset`: the whole pages of `dest` that line up with the file's pages are mapped
    from it (copy on write), the rest copied."""
    nbytes = dest.numel() * dest.element_size()
    start = dest.data_ptr()
    lo, hi = -(-start // PAGE) * PAGE, (start + nbytes) // PAGE * PAGE
    if (
        _mmap is None
        or hi - lo < _MIN_MAPPED
        or (start - offset) % PAGE
        or not (dest.is_contiguous() and src.is_contiguous() and _owns(dest))
    ):
        dest.copy_(src)
        return
    to, frm = _bytes(dest), _bytes(src)
    head, tail = lo - start, start + nbytes - hi
    to[:head].copy_(frm[:head])
    to[nbytes - tail :].copy_(frm[nbytes - tail :])
    prot, flags = mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | _MAP_FIXED
    if _mmap(lo, hi - lo, prot, flags, fd, offset + head) != lo:
        # A failed fixed mapping may have dropped the pages there: put fresh ones back.
        anonymous = flags | mmap.MAP_ANONYMOUS
        if _mmap(lo, hi - lo, prot, anonymous, -1, 0) != lo:
            raise OSError(ctypes.get_errno(), "cannot map memory back after a failed mapping")
        to[head : nbytes - tail].copy_(frm[head : nbytes - tail])


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)
