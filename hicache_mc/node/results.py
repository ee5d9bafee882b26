"""What the storage core (``store.py``) answers: a result per key, its outcome an enum. The
node's service turns them into the protocol's codes in one place (``wire.py``)."""
from __future__ import annotations

import enum
from typing import NamedTuple

from .writeback import Finished


class Reserved(enum.Enum):
    SLOT = "slot"           # a slot to fill, then commit
    STORED = "stored"       # stored already, as durably as the policy says: nothing to write
    BUSY = "busy"           # another writer is storing it now: not acknowledged to this one
    FULL = "full"           # no room, over the tenant's quota, or a size out of range


class Reservation(NamedTuple):
    outcome: Reserved
    offset: int = -1        # the slot, for SLOT


FULL = Reservation(Reserved.FULL)


class Leased(enum.Enum):
    OBJECT = "object"       # in DRAM, leased
    MISSING = "missing"     # not on this node
    LATER = "later"         # on SSD only, and DRAM has no room to stage it now: ask again later


class Lease(NamedTuple):
    outcome: Leased
    offset: int = -1
    size: int = -1
    checksum: int = 0


class Stored(NamedTuple):
    """A committed object."""
    size: int
    checksum: int


class Done(NamedTuple):
    """What the SSD writer finished since the last ``poll_done``."""
    writes: list[Finished]      # sync writes, each with an ok flag per key
    buried: list[int]           # tickets of ``bury`` whose tombstones are written
