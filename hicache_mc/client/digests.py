"""A compact set of keys for the residency view: 8 bytes a key plus a small delta.

Each key is the first 8 bytes of its xxh3-128 digest (what the master publishes), as a uint64
in a sorted numpy array, plus two small sorted arrays for the keys added and removed since the
big one was last built (folded in once they hold ``FOLD_AT`` entries). A Python set of 16-byte
digests costs ~83 B a key; this ~9 B (benchmarks/bench_view.py, 1M keys). Two keys whose digests
share 8 bytes (~n²/2^65: 3e-8 at 1M keys) look alike: the view may then say "stored" for a key
that is not (a get finds it missing: one miss) or "not stored" for one that is (a miss).
Never wrong bytes.

Readers (any thread) and the one writer (the view's thread) share no lock: the writer builds
new arrays and replaces the (base, added, removed) triple in one assignment, so a reader sees
the set before an update or after it. A lookup is a few vectorised binary searches.
"""
from __future__ import annotations

import numpy as np

FOLD_AT = 1 << 15       # delta entries that make the writer build a new base array
_EMPTY = np.zeros(0, dtype=np.uint64)
# the base array ends with the largest uint64, so a binary search never runs off its end (a key
# whose prefix is that value answers "stored": a chance of 2^-64, as any other prefix's)
_TOP = np.array([np.iinfo(np.uint64).max], dtype=np.uint64)


def prefixes(digests: bytes) -> np.ndarray:
    """The first 8 bytes of each 16-byte digest, as uint64s."""
    return np.frombuffer(digests, dtype="<u8")[::2]


def _in(sorted_arr: np.ndarray, q: np.ndarray) -> np.ndarray:
    if not len(sorted_arr):
        return np.zeros(len(q), dtype=bool)
    return sorted_arr[np.minimum(np.searchsorted(sorted_arr, q), len(sorted_arr) - 1)] == q


class DigestSet:
    """(base - removed) | added, with added and removed disjoint."""
    __slots__ = ("_state",)

    def __init__(self, digests: bytes = b""):
        self._state: tuple[np.ndarray, np.ndarray, np.ndarray] = \
            (np.union1d(prefixes(digests), _TOP), _EMPTY, _EMPTY)

    def __len__(self) -> int:       # approximate while ``removed`` holds keys the base lacks
        base, added, removed = self._state
        return len(base) - 1 + len(added) - len(removed)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self._state)

    def mask(self, q: np.ndarray) -> np.ndarray:
        """Per prefix in ``q``: is it in the set? (a bool array)"""
        base, added, removed = self._state
        hit = base[base.searchsorted(q)] == q
        if len(removed):
            hit &= ~_in(removed, q)
        if len(added):
            hit |= _in(added, q)
        return hit

    def contains(self, q: np.ndarray) -> list[bool]:
        """Per prefix in ``q``: is it in the set?"""
        return self.mask(q).tolist()

    def leading(self, q: np.ndarray) -> int:
        """How many prefixes of ``q``, from the first, are in the set."""
        hit = self.mask(q)
        return len(q) if hit.all() else int(hit.argmin())

    def apply(self, added: bytes, removed: bytes) -> None:
        """The set becomes (set - removed) | added (one update: the two are disjoint)."""
        a, r = np.unique(prefixes(added)), np.unique(prefixes(removed))
        base, add_s, rem_s = self._state
        add_s = np.union1d(np.setdiff1d(add_s, r, assume_unique=True), a)
        rem_s = np.union1d(np.setdiff1d(rem_s, a, assume_unique=True), r)
        if len(add_s) + len(rem_s) >= FOLD_AT:
            base = np.union1d(np.union1d(np.setdiff1d(base, rem_s, assume_unique=True), add_s), _TOP)
            add_s = rem_s = _EMPTY
        self._state = (base, add_s, rem_s)
