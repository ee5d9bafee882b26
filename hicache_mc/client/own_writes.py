"""The keys a client stored lately, which its residency view answers as stored before the
master's update of them arrives (read-your-writes; client/view.py)."""
from __future__ import annotations

import threading
import time

import numpy as np

from .. import residency as R
from .digests import prefixes

OWN_TTL_S = 10.0        # own writes answered as stored for 5-10 s: the view hears of them in ms
OWN_MAX = 1 << 20       # own writes held per generation (two generations)


class OwnWrites:
    """The 8-byte digest prefixes of the keys this client stored lately, in generations that take
    writes for OWN_TTL_S / 2 and answer for OWN_TTL_S / 2 more (a key is held 5-10 s, whether or
    not the client writes again). Writers (put threads) take a lock; readers take none: the
    generations are swapped in one assignment."""

    def __init__(self):
        self._lock = threading.Lock()
        self._rotate_at = time.monotonic() + OWN_TTL_S / 2
        # (current, answered until, previous, answered until)
        self._gens: tuple = (set(), self._rotate_at + OWN_TTL_S / 2, set(), 0.0)

    def add(self, keys: list[str]) -> None:
        if not keys:
            return
        new = prefixes(R.digests(keys)).tolist()
        with self._lock:
            now = time.monotonic()
            cur, cur_until = self._gens[0], self._gens[1]
            if now >= self._rotate_at or len(cur) + len(new) > OWN_MAX:
                self._rotate_at = now + OWN_TTL_S / 2
                self._gens = (set(), self._rotate_at + OWN_TTL_S / 2, cur, now + OWN_TTL_S / 2)
            self._gens[0].update(new)

    def add_to(self, hit, q):
        """``hit`` (a bool array over the prefixes ``q``) with this client's writes set."""
        cur, cur_until, old, old_until = self._gens
        if not cur and not old:     # a client that wrote nothing lately
            return hit
        now = time.monotonic()
        live = [g for g, until in ((cur, cur_until), (old, old_until)) if g and now < until]
        if live and not hit.all():      # only the view's misses are looked up here
            for i in np.flatnonzero(~hit).tolist():
                p = int(q[i])
                if any(p in g for g in live):
                    hit[i] = True
        return hit

    def forget(self, removed: bytes) -> None:
        """Stop answering the keys of ``removed`` (digests of an update: the store dropped
        them; a key written again comes back with its commit's update)."""
        cur, _, old, _ = self._gens
        if removed and (cur or old):
            gone = prefixes(removed).tolist()
            with self._lock:
                self._gens[0].difference_update(gone)
                self._gens[2].difference_update(gone)

    def clear(self) -> None:
        with self._lock:
            self._rotate_at = time.monotonic() + OWN_TTL_S / 2
            self._gens = (set(), self._rotate_at + OWN_TTL_S / 2, set(), 0.0)
