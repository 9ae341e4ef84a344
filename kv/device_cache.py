"""Which stored blocks are resident on the compute device: fixed slots per layer, LRU.

A block selected at consecutive steps is copied once. On a CPU-only machine the compute
device is the host, so nothing is copied, but the same accounting runs (hits, misses, bytes
that a GPU would move), so the UI panels mean the same thing everywhere. The LRU itself is
kv/csrc/block_lru.cpp's, which the CPU decode layer also counts its reads in without a
return to Python; `KeyLru` is the same in Python, for where the C++ kernels cannot be built.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from types import ModuleType

import torch


class KeyLru:
    """An LRU of `capacity` keys per layer that counts hits and misses (block_lru.cpp's)."""

    def __init__(self, n_layers: int, capacity: int) -> None:
        self._layers: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(n_layers)]
        self._capacity = capacity
        self.hits = 0
        self.misses = 0

    def touch(self, layer: int, keys: torch.Tensor) -> int:
        """Count each key of `keys` in order as a hit (made the most recent) or a miss (added,
        the least recent evicted when over capacity); return the misses."""
        lru = self._layers[layer]
        ids = keys.reshape(-1).tolist()
        misses = 0
        for key in ids:
            if key in lru:
                lru.move_to_end(key)
                continue
            misses += 1
            lru[key] = None
            if len(lru) > self._capacity:
                lru.popitem(last=False)
        self.hits += len(ids) - misses
        self.misses += misses
        return misses

    def resize(self, capacity: int) -> None:
        self._capacity = capacity
        for lru in self._layers:
            while len(lru) > capacity:
                lru.popitem(last=False)

    def clear(self) -> None:
        for lru in self._layers:
            lru.clear()

    @property
    def used(self) -> int:
        return sum(len(lru) for lru in self._layers)


class DeviceBlockCache:
    def __init__(
        self,
        n_layers: int,
        slots_per_layer: int,
        bytes_per_block: int,
        group: int = 1,
        kernels: ModuleType | None = None,
    ) -> None:
        """group: slots that always move together, as one key (the KV heads' copies of a
        block when every head reads the same blocks): counted as `group` slots each, and
        tracked at a fraction of the bookkeeping of one key per slot. kernels: the CPU
        kernels' module (kv/cpu_kernel.py) to keep the LRU in, else it is kept in Python."""
        self.n_layers = n_layers
        self.slots_per_layer = slots_per_layer
        self.bytes_per_block = bytes_per_block
        self.group = group
        capacity = slots_per_layer // group
        # The keys' LRU, which CPU decode layers are handed to count their own reads in.
        self.lru = (
            kernels.BlockLru(n_layers, capacity)
            if kernels is not None
            else KeyLru(n_layers, capacity)
        )

    def touch(self, layer: int, keys: torch.Tensor | Iterable[int]) -> None:
        """Record that `keys` (store slot ids, or ids of groups of slots) are read by `layer`
        now."""
        if not isinstance(keys, torch.Tensor):
            keys = torch.tensor(list(keys), dtype=torch.long)
        self.lru.touch(layer, keys)

    def resize(self, slots_per_layer: int) -> None:
        """Change the slots per layer, dropping the least recently used blocks that no
        longer fit."""
        self.slots_per_layer = slots_per_layer
        self.lru.resize(slots_per_layer // self.group)

    def invalidate(self) -> None:
        """Forget every resident block (the store was rewritten below them)."""
        self.lru.clear()

    @property
    def hits(self) -> int:
        return self.lru.hits * self.group

    @property
    def misses(self) -> int:
        return self.lru.misses * self.group

    @property
    def bytes_moved(self) -> int:
        return self.misses * self.bytes_per_block

    @property
    def used(self) -> int:
        return self.lru.used * self.group

    @property
    def total(self) -> int:
        return self.slots_per_layer * self.n_layers
