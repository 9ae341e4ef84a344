"""Which stored blocks are resident on the compute device: fixed slots per layer, LRU.

A block selected at consecutive steps is copied once. On a CPU-only machine the compute
device is the host, so nothing is copied, but the same accounting runs (hits, misses, bytes
that a GPU would move), so the UI panels mean the same thing everywhere.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable


class DeviceBlockCache:
    def __init__(self, n_layers: int, slots_per_layer: int, bytes_per_block: int) -> None:
        self.slots_per_layer = slots_per_layer
        self.bytes_per_block = bytes_per_block
        self._lru: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(n_layers)]
        self.hits = 0
        self.misses = 0
        self.bytes_moved = 0

    def touch(self, layer: int, slots: Iterable[int]) -> None:
        """Record that `slots` (store slot ids) are read by `layer` now."""
        lru = self._lru[layer]
        for slot in slots:
            if slot in lru:
                self.hits += 1
                lru.move_to_end(slot)
                continue
            self.misses += 1
            self.bytes_moved += self.bytes_per_block
            lru[slot] = None
            if len(lru) > self.slots_per_layer:
                lru.popitem(last=False)

    def resize(self, slots_per_layer: int) -> None:
        """Change the slots per layer, dropping the least recently used blocks that no
        longer fit."""
        self.slots_per_layer = slots_per_layer
        for lru in self._lru:
            while len(lru) > slots_per_layer:
                lru.popitem(last=False)

    def invalidate(self) -> None:
        """Forget every resident block (the store was rewritten below them)."""
        for lru in self._lru:
            lru.clear()

    @property
    def used(self) -> int:
        return sum(len(lru) for lru in self._lru)

    @property
    def total(self) -> int:
        return self.slots_per_layer * len(self._lru)
