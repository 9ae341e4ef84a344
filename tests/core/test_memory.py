"""Process memory: the peak since a reset, and giving freed heap back."""

from __future__ import annotations

import mmap

from kvchat.core.memory import peak_rss, process_rss, reset_peak_rss

MIB = 1024**2


def _touch(n_bytes: int) -> None:
    # Fresh pages from the OS: a tensor of this size could reuse free heap memory that an
    # earlier test left resident, and the process's RSS would not move.
    block = mmap.mmap(-1, n_bytes)
    for offset in range(0, n_bytes, mmap.PAGESIZE):
        block[offset] = 1  # resident, not only reserved
    block.close()


def test_the_peak_is_counted_from_the_last_reset():
    assert reset_peak_rss(), "Linux resets the high-water mark through /proc/self/clear_refs"
    before = process_rss()
    _touch(256 * MIB)
    high = peak_rss()
    assert high >= before + 250 * MIB
    assert reset_peak_rss()
    # The 256 MiB were freed: a new peak starts near what the process holds now.
    assert peak_rss() < high - 200 * MIB
    assert peak_rss() >= process_rss() - 4 * MIB
