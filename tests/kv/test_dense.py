"""The dense cache's storage: reserved exactly, grown by doubling past a reserve."""

from __future__ import annotations

import torch

from .conftest import dense_cache, run


def test_reserve_is_exact_and_growth_past_it_doubles(tiny):
    cache = dense_cache(tiny)
    cache.reserve(300)
    assert cache._capacity == 300
    ids = torch.randint(0, 256, (301,), generator=torch.Generator().manual_seed(3))
    run(tiny, cache, ids[:300], 64)
    assert cache._capacity == 300  # the reserve held the whole prompt
    run(tiny, cache, ids[300:], 64)
    assert cache._capacity == 600  # one token past it: doubled, so decoding copies rarely
    cache.reserve(700)
    assert cache._capacity == 700
