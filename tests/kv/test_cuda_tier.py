"""The device block tier's LRU, accounting and copies, on the CPU device (no streams there)."""

from __future__ import annotations

import pytest
import torch

from kvchat.kv.cuda_tier import DeviceBlockTier
from kvchat.kv.quant import BlockPool

BLOCK, DIM = 32, 64


def _store(n_layers: int, n_slots: int, kv_type: str, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    k_pools, v_pools = [], []
    for _ in range(n_layers):
        for pools in (k_pools, v_pools):
            pool = BlockPool(n_slots, BLOCK, DIM, kv_type, torch.float32)
            pool.write(torch.arange(n_slots), torch.randn(n_slots, BLOCK, DIM, generator=gen))
            pools.append(pool)
    return k_pools, v_pools


def _assert_resident(tier: DeviceBlockTier, layer: int, store_slots, tier_slots) -> None:
    """Each tier slot holds exactly the bytes of its store slot, K and V."""
    for store, tier_pool in ((tier.k_pools, tier.k), (tier.v_pools, tier.v)):
        src = store[layer].storage[torch.as_tensor(store_slots).reshape(-1)]
        dst = tier_pool.storage[tier_slots.reshape(-1).long()]
        assert torch.equal(src, dst)


@pytest.mark.parametrize("kv_type", ["FP16", "INT8", "INT4"])
def test_fetch_copies_blocks_and_counts_hits_and_misses(kv_type):
    k_pools, v_pools = _store(2, 20, kv_type)
    tier = DeviceBlockTier(k_pools, v_pools, slots_per_layer=4, device="cpu")
    first = tier.fetch(0, torch.tensor([[3, 7], [12, 15]]))
    assert first.shape == (2, 2) and first.dtype == torch.int32
    _assert_resident(tier, 0, [[3, 7], [12, 15]], first)
    # Tier slots of layer 0 are its own range [0, 4).
    assert set(first.reshape(-1).tolist()) <= set(range(4))
    s = tier.stats()
    assert (s.hits, s.misses) == (0, 4)
    assert s.bytes_moved == 4 * 2 * k_pools[0].bytes_per_slot
    again = tier.fetch(0, [7, 3])
    assert again.tolist() == [first[0, 1].item(), first[0, 0].item()]
    assert tier.stats().hits == 2 and tier.stats().bytes_moved == s.bytes_moved
    # Layer 1 has its own slots and counts its own misses.
    other = tier.fetch(1, [3])
    assert 4 <= other.item() < 8
    _assert_resident(tier, 1, [3], other)
    assert tier.stats().misses == 5 and tier.stats().slots_used == 5


def test_least_recently_used_is_evicted_never_a_block_of_the_same_fetch():
    k_pools, v_pools = _store(1, 20, "INT8")
    tier = DeviceBlockTier(k_pools, v_pools, slots_per_layer=3, device="cpu")
    tier.fetch(0, [1, 2, 3])
    tier.fetch(0, [1])  # 2 is now the least recently used, then 3
    slots = tier.fetch(0, [4, 3, 5])  # 3 is a hit; 4 and 5 evict 2 and 1
    _assert_resident(tier, 0, [4, 3, 5], slots)
    assert tier.stats().hits == 2
    assert tier.resident(0) == [3, 4, 5]
    # Fetching a block evicted earlier is a miss again, with the right bytes.
    back = tier.fetch(0, [2])
    _assert_resident(tier, 0, [2], back)
    assert tier.stats().misses == 6


def test_repeated_slots_in_one_fetch_are_copied_once():
    k_pools, v_pools = _store(1, 10, "INT4")
    tier = DeviceBlockTier(k_pools, v_pools, slots_per_layer=2, device="cpu")
    slots = tier.fetch(0, [5, 5, 6, 5])
    assert slots[0] == slots[1] == slots[3] != slots[2]
    assert tier.stats().misses == 2


def test_too_many_blocks_for_the_slots_is_refused():
    k_pools, v_pools = _store(1, 10, "FP16")
    tier = DeviceBlockTier(k_pools, v_pools, slots_per_layer=2, device="cpu")
    with pytest.raises(ValueError, match="reads 3 blocks at once but the tier has 2 slots"):
        tier.fetch(0, [1, 2, 3])
    assert tier.stats().misses == 0  # nothing was half-done


def test_invalidate_frees_every_slot():
    k_pools, v_pools = _store(1, 10, "FP16")
    tier = DeviceBlockTier(k_pools, v_pools, slots_per_layer=2, device="cpu")
    tier.fetch(0, [1, 2])
    tier.release(0)
    tier.invalidate()
    assert tier.stats().slots_used == 0
    # The store changed below the tier: a fetch now copies the new bytes.
    k_pools[0].write(torch.tensor([1]), torch.ones(1, BLOCK, DIM))
    slot = tier.fetch(0, [1])
    _assert_resident(tier, 0, [1], slot)
    assert tier.stats().misses == 3


def test_pools_of_different_layouts_are_refused():
    k_pools, v_pools = _store(1, 4, "INT8")
    other = BlockPool(4, BLOCK, DIM, "INT4", torch.float32)
    with pytest.raises(ValueError, match="same block layout"):
        DeviceBlockTier(k_pools, [other], 2, "cpu")


def test_attention_reads_tier_slots_as_it_reads_the_store():
    # The tier's device pools have the store's row format: attention over tier slots equals
    # attention over the same blocks read from the store.
    pytest.importorskip("triton")
    from kvchat.kv.kernels import attention_ops

    ops = attention_ops("cpu", backend="triton")
    k_pools, v_pools = _store(2, 16, "INT4")
    tier = DeviceBlockTier(k_pools, v_pools, slots_per_layer=6, device="cpu")
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(4, 1, DIM, generator=gen)
    local = torch.randn(2, 40, DIM, generator=gen), torch.randn(2, 40, DIM, generator=gen)
    sinks = local[0][:, :0], local[1][:, :0]
    store_slots = torch.tensor([[2, 5, 6], [9, 12, 15]])
    tier.fetch(1, [0, 1, 2, 3])  # other slots of layer 1 in use: tier slots are not store slots
    tier_slots = tier.fetch(1, store_slots)
    got = ops.sparse_attention(q, q, *local, *sinks, tier.k, tier.v, tier_slots)
    want = ops.sparse_attention(q, q, *local, *sinks, k_pools[1], v_pools[1], store_slots)
    torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_resize_forgets_residents_and_keeps_counting():
    k_pools, v_pools = _store(2, 10, "INT8")
    tier = DeviceBlockTier(k_pools, v_pools, slots_per_layer=4, device="cpu")
    tier.fetch(1, [1, 2, 3])
    tier.resize(2)
    assert (tier.used, tier.total, tier.k.n_slots) == (0, 4, 4)
    slots = tier.fetch(1, [3, 4])
    _assert_resident(tier, 1, [3, 4], slots)
    assert set(slots.tolist()) == {2, 3}  # layer 1's range of the new pools
    assert (tier.stats().hits, tier.stats().misses) == (0, 5)
    with pytest.raises(ValueError, match="reads 3 blocks at once but the tier has 2 slots"):
        tier.fetch(0, [1, 2, 3])
