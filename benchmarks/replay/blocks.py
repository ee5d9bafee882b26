"""Block bytes derived from the block id, in one staging area per instance.

Word ``w`` of block ``b`` is ``w + b * GOLDEN`` (uint64, wrapping): every block and every word
of it differ, so a block read into the wrong slot, a stale slot, or a torn copy all fail the
check. Slots are poisoned before each read, so a read that reports success without writing
fails too.
"""
from __future__ import annotations

import numpy as np

GOLDEN = 0x9E3779B97F4A7C15   # odd: b -> b * GOLDEN is a bijection mod 2**64
POISON = np.uint64(0xDEADBEEFDEADBEEF)
MASK = (1 << 64) - 1


class BlockPool:
    """``slots`` blocks of ``block_bytes`` each in one contiguous buffer (registered once)."""

    def __init__(self, slots: int, block_bytes: int):
        if block_bytes <= 0 or block_bytes % 8:
            raise ValueError(f"block_bytes must be a positive multiple of 8, got {block_bytes}")
        self.slots, self.block_bytes = slots, block_bytes
        self.words = block_bytes // 8
        self.buf = np.zeros(slots * self.words, dtype=np.uint64)
        self.base = np.arange(self.words, dtype=np.uint64)
        self._scratch = np.empty(self.words, dtype=np.uint64)

    @property
    def ptr(self) -> int:
        return self.buf.ctypes.data

    @property
    def nbytes(self) -> int:
        return self.buf.nbytes

    def ptrs(self, n: int) -> list[int]:
        return [self.ptr + i * self.block_bytes for i in range(n)]

    def slot(self, i: int) -> np.ndarray:
        return self.buf[i * self.words:(i + 1) * self.words]

    def fill(self, i: int, block_id: int) -> None:
        """Write ``block_id``'s bytes into slot ``i`` (the "compute" of a missing block)."""
        np.add(self.base, np.uint64((block_id * GOLDEN) & MASK), out=self.slot(i))

    def poison(self, n: int) -> None:
        self.buf[: n * self.words] = POISON

    def check(self, i: int, block_id: int) -> bool:
        """Slot ``i`` holds exactly ``block_id``'s bytes."""
        np.add(self.base, np.uint64((block_id * GOLDEN) & MASK), out=self._scratch)
        return bool(np.array_equal(self.slot(i), self._scratch))
