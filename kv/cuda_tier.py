"""The device tier of the block store: fixed slots per layer on the compute device, LRU, with
copies of missed blocks on a side stream and events so no block is read before it arrives.

The block store (one `BlockPool` per layer for K and one for V) stays in host DRAM; the tier
holds copies of recently read blocks in two device pools of the same row format, so the
attention kernels read a tier slot exactly as they would read a store slot
(`ops.sparse_attention(..., tier.k, tier.v, tier_slots)`).

`fetch(layer, store_slots)` returns the tier slots that hold those blocks. Misses are gathered
on the host into a pinned staging buffer (one index_select), copied to the device on a side
stream, and scattered into their tier slots there; the compute stream then waits on an event
recorded after the copy, so only kernels enqueued after `fetch` wait for the data, and the
Python thread never blocks on a copy. A tier slot is overwritten only after the kernels that
read it at the previous step: `release(layer)` records that point, after the layer's attention
is enqueued (without it, `fetch` orders the copy after all the work enqueued so far).

On a CPU device (tests, CPU-only machines) the same bookkeeping runs with synchronous copies,
so hits, misses and bytes mean the same thing everywhere.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .quant import BlockPool


@dataclass(frozen=True)
class TierStats:
    hits: int
    misses: int
    bytes_moved: int  # host-to-device bytes of the missed blocks, K and V
    slots_used: int
    slots_total: int

    @property
    def hit_rate(self) -> float:
        lookups = self.hits + self.misses
        return self.hits / lookups if lookups else 0.0


class DeviceBlockTier:
    def __init__(
        self,
        k_pools: Sequence[BlockPool],
        v_pools: Sequence[BlockPool],
        slots_per_layer: int,
        device: torch.device | str,
    ) -> None:
        if len(k_pools) != len(v_pools) or not k_pools:
            raise ValueError("the tier needs one K and one V pool per layer (at least one layer)")
        first = k_pools[0]
        layout = (first.block_size, first.head_dim, first.kv_type, first.dtype)
        for pool in (*k_pools, *v_pools):
            if (pool.block_size, pool.head_dim, pool.kv_type, pool.dtype) != layout:
                raise ValueError("every pool of the tier must have the same block layout")
        self.k_pools, self.v_pools = list(k_pools), list(v_pools)
        self.n_layers = len(k_pools)
        self.device = torch.device(device)
        self.bytes_per_block = 2 * first.bytes_per_slot  # K and V
        self.hits = self.misses = self.bytes_moved = 0
        cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if cuda else None
        self._staging_done: torch.cuda.Event | None = None
        row_shape = first.storage.shape[1:]
        self._staging = [
            torch.empty((0, *row_shape), dtype=first.storage.dtype, pin_memory=cuda)
            for _ in range(2)
        ]
        self.resize(slots_per_layer)

    def resize(self, slots_per_layer: int) -> None:
        """Make the device pools anew with `slots_per_layer` slots per layer. Every resident
        block is forgotten; the counters go on."""
        if slots_per_layer < 1:
            raise ValueError(f"slots_per_layer must be >= 1, got {slots_per_layer}")
        self.slots_per_layer = slots_per_layer
        first = self.k_pools[0]
        layout = (first.block_size, first.head_dim, first.kv_type, first.dtype)
        n_slots = self.n_layers * slots_per_layer
        self.k = BlockPool(n_slots, *layout, self.device)
        self.v = BlockPool(n_slots, *layout, self.device)
        # store slot -> tier slot, least recently used first
        self._lru: list[OrderedDict[int, int]] = [OrderedDict() for _ in range(self.n_layers)]
        self._free: list[list[int]] = [
            list(range((layer + 1) * slots_per_layer - 1, layer * slots_per_layer - 1, -1))
            for layer in range(self.n_layers)
        ]
        # Kernels enqueued before may still read the old pools: the caching allocator frees
        # them in stream order. Nothing has read the new ones yet.
        self._released: list[torch.cuda.Event | None] = [None] * self.n_layers
        self._read_since_release = [False] * self.n_layers

    def fetch(self, layer: int, store_slots: torch.Tensor | Sequence[int]) -> torch.Tensor:
        """Tier slots (int32 on the device, store_slots' shape) holding the blocks at
        `store_slots` of `layer`'s pools, copying the ones not resident yet."""
        shape = store_slots.shape if isinstance(store_slots, torch.Tensor) else (len(store_slots),)
        wanted = (
            store_slots.reshape(-1).tolist()
            if isinstance(store_slots, torch.Tensor)
            else list(store_slots)
        )
        lru = self._lru[layer]
        unique = list(dict.fromkeys(wanted))
        if len(unique) > self.slots_per_layer:
            raise ValueError(
                f"layer {layer} reads {len(unique)} blocks at once but the tier has "
                f"{self.slots_per_layer} slots per layer"
            )
        # Hits first, so the evictions below only ever take blocks this call does not read.
        missing = []
        for slot in unique:
            if slot in lru:
                lru.move_to_end(slot)
                self.hits += 1
            else:
                missing.append(slot)
        targets = []
        for slot in missing:
            free = self._free[layer]
            target = free.pop() if free else lru.popitem(last=False)[1]
            lru[slot] = target
            targets.append(target)
        self.misses += len(missing)
        self.bytes_moved += len(missing) * self.bytes_per_block
        if missing:
            self._copy_in(layer, missing, targets)
        self._read_since_release[layer] = True
        tier_slots = torch.tensor([lru[s] for s in wanted], dtype=torch.int32)
        return tier_slots.to(self.device, non_blocking=True).view(shape)

    def release(self, layer: int) -> None:
        """Mark that every read of `layer`'s tier slots so far is enqueued on the current
        stream: later copies into those slots wait for exactly that work."""
        if self._stream is not None:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            self._released[layer] = event
        self._read_since_release[layer] = False

    def _copy_in(self, layer: int, store_slots: list[int], targets: list[int]) -> None:
        n = len(store_slots)
        src = torch.tensor(store_slots, dtype=torch.long)
        dst = torch.tensor(targets, dtype=torch.long)
        if self._stream is None:
            for pool, tier in ((self.k_pools[layer], self.k), (self.v_pools[layer], self.v)):
                tier.storage.index_copy_(0, dst, pool.storage.index_select(0, src))
            return
        if self._staging_done is not None:
            # The pinned staging of the previous copy must be consumed before it is refilled.
            self._staging_done.synchronize()
        for i, pool in enumerate((self.k_pools[layer], self.v_pools[layer])):
            if self._staging[i].shape[0] < n:
                shape = (max(n, 2 * self._staging[i].shape[0]), *self._staging[i].shape[1:])
                self._staging[i] = torch.empty(shape, dtype=pool.storage.dtype, pin_memory=True)
            torch.index_select(pool.storage, 0, src, out=self._staging[i][:n])
        compute = torch.cuda.current_stream(self.device)
        if self._read_since_release[layer] or self._released[layer] is None:
            self._stream.wait_stream(compute)
        else:
            self._stream.wait_event(self._released[layer])
        with torch.cuda.stream(self._stream):
            dst_dev = dst.to(self.device, non_blocking=True)
            for staging, tier in zip(self._staging, (self.k, self.v), strict=True):
                rows = staging[:n].to(self.device, non_blocking=True)
                tier.storage.index_copy_(0, dst_dev, rows)
            done = torch.cuda.Event()
            done.record(self._stream)
        compute.wait_event(done)
        self._staging_done = done

    def resident(self, layer: int) -> list[int]:
        """Store slots resident for `layer`, least recently used first."""
        return list(self._lru[layer])

    def invalidate(self) -> None:
        """Forget every resident block (the store was rewritten below them)."""
        for layer, lru in enumerate(self._lru):
            self._free[layer].extend(lru.values())
            lru.clear()

    @property
    def used(self) -> int:
        return sum(len(lru) for lru in self._lru)

    @property
    def total(self) -> int:
        return self.n_layers * self.slots_per_layer

    def stats(self) -> TierStats:
        return TierStats(
            hits=self.hits,
            misses=self.misses,
            bytes_moved=self.bytes_moved,
            slots_used=self.used,
            slots_total=self.total,
        )
