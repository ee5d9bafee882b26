"""SegmentKeys: which SSD segments may hold an object record of a key, at 8 bytes a record.

A tombstone must outlive every older record of its key, or a restart's scan brings the record
back. Compaction deletes a segment only after carrying on the tombstones in it whose keys an
older segment may still hold a record of (``may_hold_before``). Each segment keeps the 64-bit
xxh3 of the keys of the object records written to it: a list while it is written, a sorted
array once asked about. Two keys sharing a digest (~n^2 / 2^65) only cost a tombstone carried
that did not need to be.
"""
from __future__ import annotations

import numpy as np
import xxhash


def digest(key: str) -> int:
    return xxhash.xxh3_64_intdigest(key.encode())


class SegmentKeys:
    def __init__(self):
        self._open: dict[int, list[int]] = {}         # segment -> digests, as written
        self._sealed: dict[int, np.ndarray] = {}      # segment -> digests, sorted

    def add(self, seg: int, key: str) -> None:
        """An object record of ``key`` was written to segment ``seg``."""
        self._open.setdefault(seg, []).append(digest(key))

    def may_hold_before(self, keys: list[str], seg: int) -> list[bool]:
        """Per key: whether a segment older than ``seg`` may hold an object record of it
        (segments older than ``seg`` take no new records: they are sealed here)."""
        for s in [s for s in self._open if s < seg]:
            self._sealed[s] = np.unique(np.array(self._open.pop(s), dtype=np.uint64))
        wanted = np.array([digest(k) for k in keys], dtype=np.uint64)
        found = np.zeros(len(keys), dtype=bool)
        for s, have in self._sealed.items():
            if s < seg and len(have):
                at = np.minimum(np.searchsorted(have, wanted), len(have) - 1)
                found |= have[at] == wanted
        return found.tolist()

    def forget(self, seg: int) -> None:
        """Segment ``seg`` was deleted."""
        self._open.pop(seg, None)
        self._sealed.pop(seg, None)
