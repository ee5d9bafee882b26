"""A compact set of keys for the residency view: 8 bytes a key plus a small delta.

Each key is the first 8 bytes of its xxh3-128 digest (what the master publishes), as a uint64
in a sorted numpy array, plus two Python sets for the changes since the array was last built
(folded in once they hold ``FOLD_AT`` entries). A Python set of 16-byte digests costs ~90 B a
key; this ~8 B (measured: benchmarks/bench_view.py). Two keys whose digests share 8 bytes
(~n²/2^65: 3e-8 at 1M keys) look alike: the view may then say "stored" for a key that is not
(a get finds it missing: one miss) or "not stored" for one that is (a miss). Never wrong bytes.

Readers (any thread) and the one writer (the view's thread) share no lock: the writer replaces
the (array, added, removed) triple in one assignment and changes the sets only one element at
a time, in an order under which a reader sees a key's old state or its new one.
"""
from __future__ import annotations

import numpy as np

FOLD_AT = 1 << 15       # delta entries that make the writer build a new array


def prefixes(digests: bytes) -> np.ndarray:
    """The first 8 bytes of each 16-byte digest, as uint64s."""
    return np.frombuffer(digests, dtype="<u8")[::2]


class DigestSet:
    __slots__ = ("_state",)

    def __init__(self, digests: bytes = b""):
        base = np.unique(prefixes(digests))
        self._state: tuple[np.ndarray, set, set] = (base, set(), set())

    def __len__(self) -> int:       # approximate while the delta holds removals of absent keys
        base, added, removed = self._state
        return len(base) + len(added) - len(removed)

    @property
    def nbytes(self) -> int:
        return self._state[0].nbytes

    def contains(self, q: np.ndarray) -> list[bool]:
        """Per prefix in ``q``: is it in the set?"""
        base, added, removed = self._state
        hit = self._in_base(base, q).tolist()
        if not added and not removed:
            return hit
        return [x in added or (h and x not in removed) for x, h in zip(q.tolist(), hit)]

    def leading(self, q: np.ndarray) -> int:
        """How many prefixes of ``q``, from the first, are in the set (``contains``'s leading
        run, without a Python list on the usual path: no delta)."""
        base, added, removed = self._state
        if added or removed:
            found = self.contains(q)
            return found.index(False) if False in found else len(found)
        hit = self._in_base(base, q)
        return len(q) if hit.all() else int(hit.argmin())

    @staticmethod
    def _in_base(base: np.ndarray, q: np.ndarray) -> np.ndarray:
        if not len(base):
            return np.zeros(len(q), dtype=bool)
        return base[np.minimum(np.searchsorted(base, q), len(base) - 1)] == q

    def apply(self, added: bytes, removed: bytes) -> None:
        """The set becomes (set - removed) | added (one update: the two are disjoint)."""
        a, r = prefixes(added), prefixes(removed)
        base, add_s, rem_s = self._state
        if len(a) + len(r) + len(add_s) + len(rem_s) >= FOLD_AT:
            b = base
            if rem_s:
                b = np.setdiff1d(b, np.fromiter(rem_s, np.uint64, len(rem_s)), assume_unique=True)
            if add_s:
                b = np.union1d(b, np.fromiter(add_s, np.uint64, len(add_s)))
            if len(r):
                b = np.setdiff1d(b, r)
            if len(a):
                b = np.union1d(b, a)
            self._state = (b, set(), set())
            return
        for x in r.tolist():
            add_s.discard(x)
            rem_s.add(x)
        for x in a.tolist():
            rem_s.discard(x)
            add_s.add(x)
