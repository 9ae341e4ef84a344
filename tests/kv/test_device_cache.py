"""The device block cache's LRU accounting: the C++ LRU (kv/csrc/block_lru.cpp) against the
Python one, and both when the cache's size changes (second_select_num live)."""

from __future__ import annotations

import random

import pytest
import torch

from kvchat.kv.device_cache import DeviceBlockCache, KeyLru
from kvchat.kv.kernels import cpu_kernels

KERNELS = cpu_kernels("cpu")
IMPLEMENTATIONS = [
    pytest.param(None, id="python"),
    pytest.param(
        KERNELS,
        id="c++",
        marks=pytest.mark.skipif(KERNELS is None, reason="the C++ CPU kernels do not build here"),
    ),
]


@pytest.mark.parametrize("kernels", IMPLEMENTATIONS)
def test_resize_keeps_the_most_recently_used_blocks(kernels) -> None:
    cache = DeviceBlockCache(n_layers=2, slots_per_layer=4, bytes_per_block=10, kernels=kernels)
    cache.touch(0, [1, 2, 3, 4])
    cache.touch(0, [1])  # 1 is now the most recent, 2 the least
    cache.resize(2)
    assert (cache.used, cache.total) == (2, 4)
    hits = cache.hits
    cache.touch(0, [4, 1])
    assert cache.hits == hits + 2
    cache.touch(0, [2])
    assert cache.misses == 5 and cache.used == 2

    cache.resize(8)
    cache.touch(1, range(8))
    assert (cache.used, cache.total) == (10, 16)
    cache.invalidate()
    assert cache.used == 0
    cache.touch(1, torch.tensor([[7, 6]]))
    assert (cache.misses, cache.bytes_moved) == (15, 150)


@pytest.mark.parametrize("kernels", IMPLEMENTATIONS)
def test_grouped_keys_count_every_slot_of_their_group(kernels) -> None:
    """SHARED selection: one key per block stands for its KV heads' slots, and counts like
    the per-slot accounting of the same reads."""
    grouped = DeviceBlockCache(1, slots_per_layer=6, bytes_per_block=10, group=3, kernels=kernels)
    per_slot = DeviceBlockCache(1, slots_per_layer=6, bytes_per_block=10, kernels=kernels)
    for blocks in ([1, 2], [2, 3], [3, 1], [1, 3]):
        grouped.touch(0, blocks)
        per_slot.touch(0, [head * 100 + b for head in range(3) for b in blocks])
        assert (grouped.hits, grouped.misses, grouped.bytes_moved, grouped.used) == (
            per_slot.hits,
            per_slot.misses,
            per_slot.bytes_moved,
            per_slot.used,
        )
    assert grouped.hits > 0 and grouped.misses > 0
    grouped.resize(3)
    assert grouped.used == 3


@pytest.mark.skipif(KERNELS is None, reason="the C++ CPU kernels do not build here")
def test_the_cpp_lru_counts_as_the_python_one() -> None:
    rng = random.Random(7)
    native, python = KERNELS.BlockLru(3, 12), KeyLru(3, 12)
    for step in range(400):
        layer = rng.randrange(3)
        keys = torch.tensor(rng.sample(range(40), rng.randrange(0, 16)), dtype=torch.long)
        assert native.touch(layer, keys) == python.touch(layer, keys)
        if step % 50 == 49:
            capacity = rng.randrange(0, 20)
            native.resize(capacity)
            python.resize(capacity)
        if step % 170 == 169:
            native.clear()
            python.clear()
        assert (native.hits, native.misses, native.used) == (
            python.hits,
            python.misses,
            python.used,
        )
    assert native.hits > 100 and native.misses > 100
