"""Mapping a file's pages into memory of our own: the bytes equal a copy's, writes stay in the
process, and only whole pages that line up with the file are mapped."""

from __future__ import annotations

import mmap
import os
import sys
from pathlib import Path

import pytest
import torch

from kvchat.kv import host_pages
from kvchat.kv.host_pages import PAGE

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/maps")


def mapped_from(path: Path, t: torch.Tensor) -> int:
    """Bytes of `t`'s range that /proc/self/maps shows as mapped from `path`."""
    start, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    total = 0
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 6 and fields[5] == str(path):
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            total += max(0, min(hi, end) - max(lo, start))
    return total


@pytest.fixture
def source(tmp_path):
    """A file of random bytes, its private mapping as a tensor, and an open descriptor."""
    path = tmp_path / "pages.bin"
    path.write_bytes(torch.randint(0, 256, (64 * PAGE,), dtype=torch.uint8).numpy().tobytes())
    fd = os.open(path, os.O_RDONLY)
    raw = torch.frombuffer(mmap.mmap(fd, 0, access=mmap.ACCESS_COPY), dtype=torch.uint8)
    yield path, raw, fd
    os.close(fd)


def test_pages_that_line_up_are_mapped_and_the_ragged_ends_copied(source):
    path, raw, fd = source
    original = path.read_bytes()
    dest = host_pages.allocate(64 * PAGE)
    # Both start 100 bytes into a page and end mid-page: 40 whole pages between.
    at, offset, n = 3 * PAGE + 100, 5 * PAGE + 100, 41 * PAGE
    host_pages.copy_from_file(dest[at : at + n], raw[offset : offset + n], fd, offset)
    assert torch.equal(dest[at : at + n], raw[offset : offset + n])
    assert mapped_from(path, dest) == 40 * PAGE
    assert not dest[:at].any() and not dest[at + n :].any()
    # Writes go to this process's copy of the page, never to the file.
    dest[at : at + n] = 7
    assert path.read_bytes() == original
    file_bytes = torch.frombuffer(bytearray(original), dtype=torch.uint8)
    assert torch.equal(raw[offset : offset + n], file_bytes[offset : offset + n])


def test_pages_that_do_not_line_up_are_copied(source):
    path, raw, fd = source
    dest = host_pages.allocate(64 * PAGE)
    at, offset, n = 3 * PAGE, 5 * PAGE + 64, 40 * PAGE
    host_pages.copy_from_file(dest[at : at + n], raw[offset : offset + n], fd, offset)
    assert torch.equal(dest[at : at + n], raw[offset : offset + n])
    assert mapped_from(path, dest) == 0


def test_memory_torch_allocated_is_never_mapped_over(source):
    path, raw, fd = source
    dest = torch.zeros(64 * PAGE + PAGE, dtype=torch.uint8)
    at = -dest.data_ptr() % PAGE  # a page boundary inside torch's own allocation
    n = 40 * PAGE
    host_pages.copy_from_file(dest[at : at + n], raw[:n], fd, 0)
    assert torch.equal(dest[at : at + n], raw[:n])
    assert mapped_from(path, dest) == 0
