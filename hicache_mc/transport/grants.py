"""Byte ranges of a node's DRAM segment that a principal may move through the stream port.

The node's service loop grants a range when it leases an object (read) or reserves a slot
(write) for a peer, and takes it back at the release or the commit; a grant also lapses with
the lease or the reservation. The stream port's threads only ask (``refused``): a dict read
under the GIL, against writes that only the loop thread makes.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

from ..auth import Principal


class Grant(NamedTuple):
    size: int
    write: bool
    expires: float      # monotonic seconds
    count: int          # leases of the same object by the same principal, not yet released


class Grants:
    PURGE_S = 1.0       # lapsed grants are dropped this often (a grant is checked for expiry anyway)

    def __init__(self):
        self._g: dict[tuple[Principal, int], Grant] = {}
        self._next_purge = 0.0

    def __len__(self) -> int:
        return len(self._g)

    def grant(self, who: Principal, offset: int, size: int, write: bool, expires: float) -> None:
        old = self._g.get((who, offset))
        if old is not None and old.size == size and old.write == write and old.expires > 0:
            self._g[(who, offset)] = Grant(size, write, max(expires, old.expires), old.count + 1)
        else:
            self._g[(who, offset)] = Grant(size, write, expires, 1)

    def holds(self, who: Principal, offset: int, write: bool) -> bool:
        g = self._g.get((who, offset))
        return g is not None and g.write == write

    def revoke(self, who: Principal, offset: int) -> bool:
        """Take back one grant of ``offset`` (a release, a commit); False when ``who`` holds none."""
        g = self._g.get((who, offset))
        if g is None:
            return False
        if g.count > 1:
            self._g[(who, offset)] = g._replace(count=g.count - 1)
        else:
            del self._g[(who, offset)]
        return True

    def refused(self, who: Principal, ranges: list[tuple[int, int]], write: bool,
                now: float) -> Optional[tuple[int, int]]:
        """The first of ``ranges`` not granted to ``who`` for this op (None: all are)."""
        get = self._g.get
        for off, size in ranges:
            g = get((who, off))
            if g is None or g.write != write or size > g.size or g.expires <= now:
                return off, size
        return None

    def purge(self, now: float) -> None:
        """Drop lapsed grants (the loop thread calls it every turn; it works once a second)."""
        if now < self._next_purge:
            return
        self._next_purge = now + self.PURGE_S
        for k in [k for k, g in list(self._g.items()) if g.expires <= now]:
            self._g.pop(k, None)
