"""Byte ranges of a node's DRAM segment that a principal may move through the stream port, and
the transfers moving them now.

The node's service loop grants a range when it leases an object (read) or reserves a slot
(write) for a peer, and takes it back at the release or the commit; a grant also lapses with
the lease or the reservation. A stream-port thread opens a transfer over granted ranges
(``open``): a request names each range once, asks at most the granted size of it, and runs
at most one transfer per lease of it at a time. An open transfer pins its ranges: the loop's
DRAM tier asks ``hold(offset)`` before it frees a slot and keeps a pinned one out of reuse
until the transfer ends (``take_unpinned``). Before each chunk the thread asks ``live``: once
the grant was revoked or lapsed, the transfer is cut. So no slot outlives what references it,
and a peer that stops reading or writing cannot move another tenant's bytes once its slot
was given back.

Grants and pins change under one lock (the loop and the stream threads both change them);
``live`` reads under the GIL.
"""
from __future__ import annotations

import threading
import time
from typing import Optional

from ..auth import Principal
from ..errors import ProtocolError


class Grant:
    """What one principal may move at one offset; changed in place while it lasts."""
    __slots__ = ("size", "write", "expires", "count", "active")

    def __init__(self, size: int, write: bool, expires: float):
        self.size, self.write, self.expires = size, write, expires
        self.count = 1      # leases of the same object by the same principal, not yet released
        self.active = 0     # transfers open on it now (at most count)


class Transfer:
    """Ranges a stream-port thread is moving; ``close`` it when done, whatever happened."""

    def __init__(self, grants: "Grants", who: Principal, held: list[tuple[int, Grant]]):
        self._grants, self._who, self._held = grants, who, held

    def live(self, i: int) -> bool:
        """Whether range ``i``'s grant still stands (checked before each chunk)."""
        off, g = self._held[i]
        return self._grants.current(self._who, off) is g and g.expires > time.monotonic()

    def close(self) -> None:
        self._grants.unpin(self._held)
        self._held = []


class Grants:
    PURGE_S = 1.0       # lapsed grants are dropped this often (a grant is checked for expiry anyway)

    def __init__(self):
        self._g: dict[tuple[Principal, int], Grant] = {}
        self._pins: dict[int, int] = {}         # offset -> open transfers over it
        self._deferred: set[int] = set()        # pinned offsets the loop wants to free
        self._unpinned: list[int] = []          # ... whose last transfer ended since
        self._lock = threading.Lock()
        self._next_purge = 0.0

    def __len__(self) -> int:
        return len(self._g)

    # ------------------------------------------------------------ the loop's side

    def grant(self, who: Principal, offset: int, size: int, write: bool, expires: float) -> None:
        with self._lock:
            old = self._g.get((who, offset))
            if old is not None and old.size == size and old.write == write and old.expires > 0:
                old.count += 1
                old.expires = max(expires, old.expires)
            else:
                self._g[(who, offset)] = Grant(size, write, expires)

    def revoke(self, who: Principal, offset: int) -> bool:
        """Take back one grant of ``offset`` (a release, a commit); False when ``who`` holds none."""
        with self._lock:
            g = self._g.get((who, offset))
            if g is None:
                return False
            g.count -= 1
            if g.count <= 0:
                del self._g[(who, offset)]
            return True

    def hold(self, offset: int) -> bool:
        """Whether a transfer is moving the slot at ``offset`` (the loop is about to free it):
        then its offset comes back from ``take_unpinned`` once the last such transfer ends."""
        with self._lock:
            if self._pins.get(offset):
                self._deferred.add(offset)
                return True
            return False

    def take_unpinned(self) -> list[int]:
        """The offsets ``hold`` kept whose transfers have all ended since the last call."""
        with self._lock:
            out, self._unpinned = self._unpinned, []
            return out

    def purge(self, now: float) -> None:
        """Drop lapsed grants (the loop thread calls it every turn; it works once a second)."""
        if now < self._next_purge:
            return
        self._next_purge = now + self.PURGE_S
        with self._lock:
            for k in [k for k, g in self._g.items() if g.expires <= now]:
                del self._g[k]

    # ------------------------------------------------------------ the stream port's side

    def current(self, who: Principal, offset: int) -> Optional[Grant]:
        return self._g.get((who, offset))

    def open(self, who: Principal, ranges: list[tuple[int, int]], write: bool,
             now: float) -> Transfer:
        """Start moving ``ranges`` for ``who``: each granted to it for this op, unexpired, named
        once, no larger than granted, and not moved by as many transfers as it has leases
        already; ProtocolError (nothing pinned) otherwise."""
        with self._lock:
            held, seen = [], set()
            for off, size in ranges:
                g = self._g.get((who, off))
                if off in seen:
                    raise ProtocolError(f"range {[off, size]} is named more than once")
                seen.add(off)
                if g is None or g.write != write or size > g.size or g.expires <= now:
                    raise ProtocolError(f"range {[off, size]} is not "
                                        f"{'reserved' if write else 'leased'} to this peer")
                if g.active >= g.count:
                    raise ProtocolError(f"range {[off, size]} is being moved already")
                held.append((off, g))
            for off, g in held:
                g.active += 1
                self._pins[off] = self._pins.get(off, 0) + 1
        return Transfer(self, who, held)

    def unpin(self, held: list[tuple[int, Grant]]) -> None:
        with self._lock:
            for off, g in held:
                g.active -= 1
                n = self._pins[off] - 1
                if n:
                    self._pins[off] = n
                    continue
                del self._pins[off]
                if off in self._deferred:
                    self._deferred.discard(off)
                    self._unpinned.append(off)
