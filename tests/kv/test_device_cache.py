"""The device block cache's LRU accounting when its size changes (second_select_num live)."""

from __future__ import annotations

from kvchat.kv.device_cache import DeviceBlockCache


def test_resize_keeps_the_most_recently_used_blocks() -> None:
    cache = DeviceBlockCache(n_layers=2, slots_per_layer=4, bytes_per_block=10)
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
