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


def test_grouped_keys_count_every_slot_of_their_group() -> None:
    """SHARED selection: one key per block stands for its KV heads' slots, and counts like
    the per-slot accounting of the same reads."""
    grouped = DeviceBlockCache(n_layers=1, slots_per_layer=6, bytes_per_block=10, group=3)
    per_slot = DeviceBlockCache(n_layers=1, slots_per_layer=6, bytes_per_block=10)
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
