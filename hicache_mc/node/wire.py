"""The storage core's outcomes as the wire says them: the one place that knows the codes."""
from __future__ import annotations

from .. import protocol as P
from .results import Lease, Leased, Reservation, Reserved

_RESERVE_CODES = {Reserved.STORED: P.RESERVE_STORED, Reserved.BUSY: P.RESERVE_BUSY,
                  Reserved.FULL: P.RESERVE_FULL}
_LEASE_CODES = {Leased.MISSING: P.LEASE_MISSING, Leased.LATER: P.LEASE_LATER}


def reserve_reply(reservations: list[Reservation], ttl: float, segment: str) -> P.ReserveReply:
    return P.ReserveReply([r.offset if r.outcome is Reserved.SLOT else _RESERVE_CODES[r.outcome]
                           for r in reservations], ttl, segment)


def lease_reply(leases: list[Lease], ttl: float, segment: str) -> P.LeaseReply:
    return P.LeaseReply([x.offset if x.outcome is Leased.OBJECT else _LEASE_CODES[x.outcome]
                         for x in leases], [x.size for x in leases], [x.checksum for x in leases],
                        ttl, segment)
