"""Loading a saved cache state: what kv/state.py checks and how it fills a fresh cache."""

from __future__ import annotations

import sys

import psutil
import pytest
import torch

from kvchat.kv.state import CacheState, StateMismatchError, populate

MiB = 1 << 20


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="populating is Linux's madvise")
def test_populate_faults_in_each_run_and_not_the_capacity_between_them():
    # Fresh pages of a large tensor are untouched until written: populating a view of two
    # KV heads' used blocks makes those resident, and not the capacity after each run.
    proc = psutil.Process()
    pool = torch.empty(2, 64 * MiB, dtype=torch.uint8)  # two heads, 64 MiB of capacity each
    used = pool[:, : 16 * MiB]
    saved = torch.ones(2, 16 * MiB, dtype=torch.uint8)
    before = proc.memory_info().rss
    populate(used)
    grown = proc.memory_info().rss - before
    assert 30 * MiB <= grown <= 40 * MiB, grown / MiB
    CacheState({}, {"pool": saved}).restore({"pool": used})
    assert torch.equal(used, saved) and proc.memory_info().rss - before <= 40 * MiB


def test_a_state_of_another_shape_is_refused_before_anything_is_copied():
    dest = {"a": torch.zeros(4), "b": torch.zeros(3)}
    state = CacheState({}, {"a": torch.ones(4), "b": torch.ones(5)})
    with pytest.raises(StateMismatchError, match="'b' is float32\\[5\\]"):
        state.restore(dest)
    assert not dest["a"].any()
