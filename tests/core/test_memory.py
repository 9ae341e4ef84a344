"""Process memory: the peak since a reset, and giving freed heap back."""

from __future__ import annotations

import torch

from kvchat.core.memory import peak_rss, process_rss, reset_peak_rss

MIB = 1024**2


def _touch(n_bytes: int) -> None:
    block = torch.empty(n_bytes, dtype=torch.uint8)
    block.fill_(1)  # resident, not only reserved
    del block


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
