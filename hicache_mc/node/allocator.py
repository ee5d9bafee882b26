"""SlotAllocator: first-fit byte-range allocator with coalescing, for one DRAM segment.

Free ranges are kept as a sorted list of offsets plus offset -> size, so a free merges with both
neighbours in O(log n) lookups. ``can_allocate`` / ``allocate`` / ``free`` follow nano-vllm's
paired style. Offsets and sizes are rounded to ``align`` bytes so that every object starts on
a cache line (memcpy and the checksum run fastest there).
"""
from __future__ import annotations

import bisect


class SlotAllocator:
    def __init__(self, base: int, capacity: int, align: int = 256):
        self.align = align
        self.capacity = capacity
        self._offsets: list[int] = [base]          # sorted starts of free ranges
        self._sizes: dict[int, int] = {base: capacity}
        self.used = 0

    def rounded(self, size: int) -> int:
        return max(self.align, (size + self.align - 1) // self.align * self.align)

    @property
    def free_bytes(self) -> int:
        return self.capacity - self.used

    def can_allocate(self, size: int) -> bool:
        need = self.rounded(size)
        return any(s >= need for s in self._sizes.values())

    def allocate(self, size: int) -> int:
        """Offset of a new range of at least ``size`` bytes, or -1 when none is free."""
        need = self.rounded(size)
        for i, off in enumerate(self._offsets):
            have = self._sizes[off]
            if have >= need:
                del self._sizes[off]
                if have == need:
                    del self._offsets[i]
                else:
                    self._offsets[i] = off + need
                    self._sizes[off + need] = have - need
                self.used += need
                return off
        return -1

    def free(self, offset: int, size: int) -> None:
        """Return a range given out by ``allocate(size)``; merges with free neighbours."""
        size = self.rounded(size)
        assert offset not in self._sizes, f"double free at {offset}"
        self.used -= size
        i = bisect.bisect_left(self._offsets, offset)
        # merge with the following range
        if i < len(self._offsets) and offset + size == self._offsets[i]:
            nxt = self._offsets.pop(i)
            size += self._sizes.pop(nxt)
        # merge with the preceding range
        if i > 0:
            prev = self._offsets[i - 1]
            if prev + self._sizes[prev] == offset:
                self._sizes[prev] += size
                return
        self._offsets.insert(i, offset)
        self._sizes[offset] = size

    def largest_free(self) -> int:
        return max(self._sizes.values(), default=0)
