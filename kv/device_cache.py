"""Which stored blocks are resident on the compute device: fixed slots per layer, LRU.

A block selected at consecutive steps is copied once. On a CPU-only machine the compute
device is the host, so nothing is copied, but the same accounting runs (hits, misses, bytes
that a GPU would move), so the UI panels mean the same thing everywhere.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable


class DeviceBlockCache:
    def __init__(
        self, n_layers: int, slots_per_layer: int, bytes_per_block: int, group: int = 1
    ) -> None:
        """group: slots that always move together, as one key (the KV heads' copies of a
        block when every head reads the same blocks): counted as `group` slots each, and
        tracked at a fraction of the bookkeeping of one key per slot."""
        self.slots_per_layer = slots_per_layer
        self.bytes_per_block = bytes_per_block
        self.group = group
        self._lru: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(n_layers)]
        self.hits = 0
        self.misses = 0
        self.bytes_moved = 0

    def touch(self, layer: int, keys: Iterable[int]) -> None:
        """Record that `keys` (store slot ids, or ids of groups of slots) are read by `layer`
        now."""
        lru = self._lru[layer]
        capacity = self.slots_per_layer // self.group
        misses = 0
        for key in keys:
            if key in lru:
                self.hits += self.group
                lru.move_to_end(key)
                continue
            misses += 1
            lru[key] = None
            if len(lru) > capacity:
                lru.popitem(last=False)
        self.misses += misses * self.group
        self.bytes_moved += misses * self.group * self.bytes_per_block

    def resize(self, slots_per_layer: int) -> None:
        """Change the slots per layer, dropping the least recently used blocks that no
        longer fit."""
        self.slots_per_layer = slots_per_layer
        for lru in self._lru:
            while len(lru) > slots_per_layer // self.group:
                lru.popitem(last=False)

    def invalidate(self) -> None:
        """Forget every resident block (the store was rewritten below them)."""
        for lru in self._lru:
            lru.clear()

    @property
    def used(self) -> int:
        return sum(len(lru) for lru in self._lru) * self.group

    @property
    def total(self) -> int:
        return self.slots_per_layer * len(self._lru)
