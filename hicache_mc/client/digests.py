"""A compact set of keys for the residency view: 8 bytes a key plus a small delta.

Each key is the first 8 bytes of its digest (keydigest.py: what the master publishes), as a
uint64 in a sorted numpy array, plus a small sorted delta of the keys added or removed since
the big one was last built, each with a flag (folded in once it holds ``FOLD_AT`` keys). A
Python set of 16-byte digests costs ~83 B a key; this ~9 B (benchmarks/bench_view.py, 1M keys).
Two keys whose digests share 8 bytes (~n²/2^65: 3e-8 at 1M keys) look alike: the view may then
say "stored" for a key that is not (a get finds it missing: one miss) or "not stored" for one
that is (a miss). Never wrong bytes.

Readers (any thread) and the one writer (the view's thread) share no lock: the writer builds
new arrays and replaces the (base, delta, flags) triple in one assignment, so a reader sees
the set before an update or after it. A lookup is one vectorised binary search, two with a delta.
"""
from __future__ import annotations

import numpy as np

FOLD_AT = 1 << 15       # delta entries that make the writer build a new base array
_EMPTY = np.zeros(0, dtype=np.uint64)
_NONE = np.zeros(0, dtype=bool)
_TRUE = np.ones(1, dtype=bool)
# the base array ends with the largest uint64, so a binary search never runs off its end (a key
# whose prefix is that value answers "stored": a chance of 2^-64, as any other prefix's)
_TOP = np.array([np.iinfo(np.uint64).max], dtype=np.uint64)


def prefixes(digests: bytes) -> np.ndarray:
    """The first 8 bytes of each 16-byte digest, as uint64s."""
    return np.frombuffer(digests, dtype="<u8")[::2]


class DigestSet:
    """The base array, with the delta's keys answered by the delta: stored (added since) or not
    (removed since)."""
    __slots__ = ("_state",)

    def __init__(self, digests: bytes = b""):
        # (base, delta keys, delta stored?): one sorted delta with a flag per key, so a lookup
        # makes one binary search in it, not one in the added and one in the removed keys
        # (bench_view.py, 10k-entry delta)
        self._state: tuple[np.ndarray, np.ndarray, np.ndarray] = \
            (np.union1d(prefixes(digests), _TOP), _EMPTY, _NONE)

    def __len__(self) -> int:   # approximate while the delta adds or removes what the base has or lacks
        base, delta, stored = self._state
        if not len(delta):
            return len(base) - 1
        added = int(stored.sum()) - 1       # (less _TOP)
        return len(base) - 1 + added - (len(delta) - 1 - added)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self._state)

    def mask(self, q: np.ndarray) -> np.ndarray:
        """Per prefix in ``q``: is it in the set? (a bool array)"""
        base, delta, stored = self._state
        hit = base[base.searchsorted(q)] == q
        if len(delta):      # (the delta ends with _TOP too: no index runs off its end)
            at = delta.searchsorted(q)
            hit = np.where(delta[at] == q, stored[at], hit)
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
        base, delta, stored = self._state
        keep = ~np.isin(delta[:-1], np.concatenate((a, r)))     # (without its _TOP)
        keys = np.concatenate((delta[:-1][keep], a, r))
        flags = np.concatenate((stored[:-1][keep], np.ones(len(a), bool), np.zeros(len(r), bool)))
        if len(keys) >= FOLD_AT:
            base = np.union1d(np.setdiff1d(base, keys[~flags], assume_unique=True), keys[flags])
            base = np.union1d(base, _TOP)
            delta, stored = _EMPTY, _NONE
        elif len(keys):
            order = np.argsort(keys, kind="stable")
            delta = np.concatenate((keys[order], _TOP))
            stored = np.concatenate((flags[order], _TRUE))
        self._state = (base, delta, stored)
