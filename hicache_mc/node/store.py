"""TieredStore: one node's objects across its DRAM tier and its optional SSD tier.

Contract (the node loop is the only caller; it sees outcomes, never the tiers' records):

- ``reserve_many(keys, sizes, now, hold_s, max_value) -> list[Reservation]``: a slot per key
  to fill and ``commit_many``, or why not (``Reserved``).
- ``commit_many(keys, checksums, offsets) -> list[Optional[Stored]]``: the reserved slots
  become readable objects; ``write_through`` then starts them on their way to disk.
- ``lease_many(keys, now) -> list[Lease]``: objects in DRAM for a reader, or why not
  (``Leased``); ``release(key, offset)`` ends a lease or gives a reservation back.
- ``clear`` / ``remove`` / ``drop_damaged``: objects removed on purpose.
- ``maintain(now)`` (timers), ``poll_done(now)`` (the SSD writer finished jobs: the sync
  writes now on disk, or not), ``drain_dropped()`` (keys that left the node, for the master).

Policy, in one place (how objects reach the SSD tier, and leave DRAM for it, is
``writeback.py``, private to the store):

- Writes land in DRAM, reserved then committed; a second writer of a key being stored is told
  "busy", and one of a key stored already "stored".
- A read of an SSD-only object stages it back into DRAM; with no room there for it now, the
  lease says so (the reader asks again once it has released others).
- The master hears of every key that left the node and is not held again by the time the
  report goes (``drain_dropped``).
- An object a reader found damaged, whose bytes fail its checksum here too, is removed
  (``drop_damaged``): a put of the key stores it again.
- Tenants (the ``@tenant`` suffix of a key's namespace, ``tenants.py``): each tenant's keys,
  bytes held and bytes reserved are kept; a reservation is charged when made, credited back
  when it lapses or is given back, and moves to the bytes held at commit. A tenant with a quota
  (this node's share, sent by the master) that a reservation would take over it evicts its own
  least recently used objects first (SSD-only ones, then DRAM), never another tenant's, and
  the write fails if that cannot make room: no batch overruns a quota. A clear walks the
  clearing tenant's own keys.
"""
from __future__ import annotations

import logging
import time
from typing import Optional

import xxhash

from ..keys import tenant_of
from .dram import DramTier
from .results import FULL, Done, Lease, Leased, Reservation, Reserved, Stored
from .ssd import SsdTier
from .tenants import NODE_OBJECT_BYTES, OBJECT_BYTES, Tenants, charge
from .writeback import WriteBack

__all__ = ["Done", "Lease", "Leased", "NODE_OBJECT_BYTES", "OBJECT_BYTES", "Reservation",
           "Reserved", "Stored", "TieredStore", "charge"]

log = logging.getLogger(__name__)

class TieredStore:
    def __init__(self, dram: DramTier, ssd: Optional[SsdTier], durability: str, fsync_interval_s: float):
        self.dram = dram
        self.ssd = ssd
        self.durability = durability if ssd is not None else "none"
        self.fsync_interval_s = fsync_interval_s
        dram.drop_dirty(ssd is None)
        self._writeback = WriteBack(dram, ssd, self.durability, fsync_interval_s, self._lost_on_ssd)
        self.tenants = Tenants()        # what each tenant holds here (read-only outside)
        self._gone: list[str] = []      # keys that left the node: the master is to hear of them
        # Deletion is durable: a key whose SSD record was removed is reported gone only once a
        # tombstone burying the record is written (a restart's scan would bring it back).
        self._burying: dict[str, None] = {}     # keys whose tombstones bury() is to queue
        self._report_later: list[str] = []      # ... those of them that left the node
        self._awaiting: dict[int, list[str]] = {}   # ticket -> keys reported once it is written
        self._tickets = 0
        self.quota_evictions = 0
        if ssd is not None:
            for key, rec in ssd.items():
                self.tenants.add(key, charge(rec.size))

    def set_quotas(self, quotas: dict[str, int]) -> None:
        """This node's share of each tenant's quota (tenant -> bytes), from the master."""
        self.tenants.quotas = quotas

    # ------------------------------------------------------------ lookups

    def contains(self, key: str) -> bool:
        return key in self.dram or (self.ssd is not None and key in self.ssd)

    def meta(self, key: str) -> Optional[tuple[int, int]]:
        """(size, checksum) wherever the object lives."""
        slot = self.dram.get(key)
        if slot is not None:
            return slot.size, slot.checksum
        rec = self.ssd.get(key, touch=False) if self.ssd is not None else None
        return (rec.size, rec.checksum) if rec else None

    def release(self, key: str, offset: int) -> None:
        """A reader released its lease on ``key`` at ``offset``, or a writer gave back its
        reservation (``DramTier.give_back``, ``DramTier.release``)."""
        slot = self.dram.give_back(key, offset)
        if slot is not None:
            self.tenants.unreserve(key, charge(slot.size))
        else:
            self.dram.release(key, offset)

    def lease_many(self, keys: list[str], now: float) -> list[Lease]:
        """A lease per key (see ``Leased``)."""
        return [self._lease(key, now) for key in keys]

    def _lease(self, key: str, now: float) -> Lease:
        """The object in DRAM, leased; an SSD-only object is staged in first."""
        slot = self.dram.lease(key, now)
        if slot is None and self.ssd is not None:
            slot = self._stage(key, now)
        if slot is not None:
            self.tenants.touch(key)
            return Lease(Leased.OBJECT, slot.offset, slot.size, slot.checksum)
        on_ssd_only = self.ssd is not None and key in self.ssd and key not in self.dram
        return Lease(Leased.LATER if on_ssd_only else Leased.MISSING)

    def _stage(self, key: str, now: float):
        """Read an SSD-only object back into DRAM and lease it; None when it is not on SSD,
        DRAM has no room for it now, or its record is damaged (then it is dropped)."""
        rec = self.ssd.get(key)
        if rec is None or self.dram.is_reserved(key):
            return None
        slot = self.dram.reserve(key, rec.size, now, 0.0)
        self._collect()
        if slot is None:
            return None
        if not self.ssd.read_into(rec, self.dram.view(slot)):
            self.dram.give_back(key, slot.offset)
            self._lost_on_ssd(key)
            return None
        self.dram.commit(key, rec.checksum)
        self.dram.set_on_ssd(key, True)
        self.ssd.count("promotions")
        return self.dram.lease(key, now)

    def _lost_on_ssd(self, key: str) -> None:
        log.warning("ssd record of %s is damaged; dropped it", key)
        if self.ssd.remove(key) is not None:
            self._burying[key] = None
        if key in self.dram:
            self.dram.set_on_ssd(key, False)
        else:
            self._left(key)

    # ------------------------------------------------------------ writes

    def durable(self, key: str) -> Optional[bool]:
        """True: stored as the policy promises (acknowledge a duplicate put); False: being
        stored right now (reserved, or with ``sync`` not yet on disk); None: absent."""
        if self.ssd is not None and key in self.ssd:
            return True
        slot = self.dram.get(key)
        if slot is not None:
            return slot.on_ssd or self.durability != "sync"
        return False if self.dram.is_reserved(key) else None

    def reserve(self, key: str, size: int, now: float, hold_s: float) -> Reservation:
        """A slot for ``key`` to fill and commit before ``now + hold_s``, or why not."""
        state = self.durable(key)
        if state is not None:   # a second writer of the same key is acknowledged only once it holds
            return Reservation(Reserved.STORED if state else Reserved.BUSY)
        if not self._within_quota(key, size, now):
            return FULL
        slot = self.dram.reserve(key, size, now, hold_s)
        if slot is None:
            slot = self._writeback.room_by_waiting(
                size, now, lambda: self.dram.reserve(key, size, time.monotonic(), hold_s))
        self._collect()
        if slot is None:
            return FULL
        self.tenants.reserve(key, charge(size))
        return Reservation(Reserved.SLOT, slot.offset)

    def reserve_many(self, keys: list[str], sizes: list[int], now: float, hold_s: float,
                     max_value: int) -> list[Reservation]:
        """``reserve`` for a batch (FULL for sizes out of 0..``max_value``). Keys not
        stored, not being stored and under no quota take one free range together
        (``DramTier.reserve_row``); the rest, or all when no range is big enough, go
        key by key."""
        out: list[Optional[Reservation]] = [FULL] * len(keys)
        fresh, seen = [], set()
        dram = self.dram
        on_ssd = self.ssd if self.ssd is not None else ()
        for i, (key, size) in enumerate(zip(keys, sizes)):
            if size < 0 or size > max_value:
                continue
            if key in seen or key in dram or dram.is_reserved(key) or key in on_ssd or \
                    self.tenants.quota(self.tenants.tenant_of(key)) is not None:
                out[i] = None       # the careful way, below
            else:
                fresh.append(i)
            seen.add(key)
        if fresh:
            got = self.dram.reserve_row([keys[i] for i in fresh], [sizes[i] for i in fresh],
                                        now, hold_s)
            if got is None:
                for i in fresh:
                    out[i] = None
            else:
                for i, slot in zip(fresh, got):
                    out[i] = Reservation(Reserved.SLOT, slot.offset)
                    self.tenants.reserve(keys[i], charge(sizes[i]))
        for i, r in enumerate(out):
            if r is None:
                out[i] = self.reserve(keys[i], sizes[i], now, hold_s)
        return out

    def commit_many(self, keys: list[str], checksums: list[int],
                    offsets: Optional[list[int]] = None) -> list[Optional[Stored]]:
        """Make reserved slots readable objects: the object per key (None: nothing reserved,
        or, with ``offsets``, reserved at another offset: another writer's slot)."""
        out: list[Optional[Stored]] = []
        commit, tenants = self.dram.commit, self.tenants
        for i, (key, checksum) in enumerate(zip(keys, checksums)):
            obj = commit(key, checksum, None if offsets is None else offsets[i])
            if obj is None:
                out.append(None)
                continue
            out.append(Stored(obj.size, obj.checksum))
            cost = charge(obj.size)
            tenants.unreserve(key, cost)
            tenants.add(key, cost)
        return out

    # ------------------------------------------------------------ tenants

    def _within_quota(self, key: str, size: int, now: float) -> bool:
        """Make room for an object of ``size`` bytes of ``key``'s tenant (held and reserved,
        at what each is charged) by evicting only its own objects."""
        tenants = self.tenants
        tenant = tenants.tenant_of(key)
        cost = charge(size)
        need = tenants.over(tenant, cost)
        if need <= 0:
            return True
        if cost > tenants.quota(tenant):
            return False
        for victim in self._victims(tenant):
            need -= self._evict_entirely(victim, now)
            if need <= 0:
                return True
        return False

    def _victims(self, tenant: str):
        """The tenant's objects to evict for its quota, least recently used first: those on
        SSD only (the colder ones), then those in DRAM that no SSD write holds. Each is looked
        for from the oldest on, so the caller evicts one before it asks for the next."""
        dram = self.dram
        for wanted in (lambda k: k not in dram,
                       lambda k: (s := dram.get(k)) is not None and not s.busy):
            last = None
            while (key := self.tenants.first(tenant, wanted)) is not None and key != last:
                last = key
                yield key

    def _evict_entirely(self, key: str, now: float) -> int:
        """Remove ``key`` from every tier of this node (the master is told); what it was
        charged to its tenant."""
        if key in self.dram:
            self.dram.drop(key, now)    # reported by _collect unless on SSD too
        if self.ssd is not None and self.ssd.remove(key) is not None:
            self._burying[key] = None
        charge = self._left(key)
        self._collect()
        self.quota_evictions += 1
        return charge

    def _left(self, key: str) -> int:
        """``key`` may have left the node: if so, its tenant is credited back what it was
        charged (returned), and the master is to hear of it."""
        charge = None if self.contains(key) else self.tenants.remove(key)
        if charge is None:
            return 0        # still here, or gone and reported already
        (self._report_later if key in self._burying else self._gone).append(key)
        return charge

    def _collect(self) -> None:
        """The objects DRAM evicted with no copy on SSD have left the node."""
        for key, _ in self.dram.take_dropped():
            self._left(key)

    def drain_dropped(self) -> list[str]:
        """Keys that left this node since the last call, for the master: not those stored
        again meanwhile (their commit is reported already; this report must not undo it)."""
        self._collect()
        gone, self._gone = self._gone, []
        return [k for k in gone if not self.contains(k)]

    # ------------------------------------------------------------ removal

    def remove(self, keys: list[str], now: float) -> list[str]:
        """Remove ``keys`` on purpose (the caller tells the master); the keys that were here."""
        for key in keys:
            self.tenants.remove(key)
        dram = self.dram
        # objects on their way to disk: their records land before the tombstones queued by
        # bury(), which bury them
        writing = {k for k in keys if (s := dram.get(k)) is not None and s.busy}
        gone = set(self.dram.remove(keys, now))
        if self.ssd is not None:
            on_disk = {k for k in keys if self.ssd.remove(k) is not None}
            self._burying.update(dict.fromkeys(sorted(on_disk | writing)))
            gone |= on_disk
        return [k for k in keys if k in gone]

    def bury(self) -> Optional[int]:
        """Queue tombstones for the SSD records removed since the last call; a ticket that
        ``poll_done`` names once they are written (None: there were none). The keys among them
        that left the node are reported (``drain_dropped``) only then; a reply acknowledging
        their removal waits for the ticket."""
        if not self._burying:
            return None
        self._tickets += 1
        self._writeback.bury(list(self._burying), self._tickets)
        self._awaiting[self._tickets] = self._report_later
        self._burying, self._report_later = {}, []
        return self._tickets

    def drop_damaged(self, keys: list[str], offsets: list[int], now: float) -> list[str]:
        """Remove the objects a reader found damaged: those still at the offset it read
        (the same object) whose bytes do not match their checksum here either (a commit that
        named another checksum, bytes changed since). Returns the keys removed."""
        bad = [k for k, off in dict(zip(keys, offsets)).items()
               if (obj := self.dram.get(k)) is not None and obj.offset == off
               and xxhash.xxh3_64_intdigest(self.dram.view(obj)) != obj.checksum]
        if bad:
            log.warning("%d objects do not match their checksums (e.g. %s); dropped them",
                        len(bad), bad[0][:200])
        return self.remove(bad, now)

    def clear(self, prefix: str, now: float, tenant: Optional[str] = None) -> list[str]:
        """Remove the keys starting with ``prefix`` (of ``tenant`` only, unless None): the
        tenant's own keys are walked, not every key on the node."""
        if tenant is None and "/" in prefix:      # a whole namespace names its tenant
            tenant = tenant_of(prefix)
        return self.remove(sorted(self.tenants.keys(tenant, prefix)), now)

    # ------------------------------------------------------------ the SSD tier's side

    def write_through(self, keys: list[str], waiter: object = None) -> bool:
        """Start newly committed objects on their way to disk, as ``durability`` says; True
        when ``waiter`` must wait for the disk (``sync``): ``poll_done`` returns it once there."""
        return self._writeback.persist(keys, waiter)

    def maintain(self, now: float) -> None:
        """Timers: reservations that lapsed, watermarks, compaction, the periodic fsync."""
        for key, size in self.dram.maintain(now):     # reservations that lapsed
            self.tenants.unreserve(key, charge(size))
        for key in self._writeback.maintain(now):   # SSD records evicted
            self._burying[key] = None
            self._left(key)
        self._collect()

    def poll_done(self, now: float) -> Done:
        """Apply the SSD writer's finished jobs: the sync writes now done with the disk, each
        with an ok flag per key (on disk, and not removed meanwhile), and the tickets of
        ``bury`` now written."""
        self._writeback.poll_done(now)
        self._collect()
        buried = self._writeback.take_buried()
        for ticket in buried:
            self._gone += self._awaiting.pop(ticket, [])
        return Done(self._writeback.take_finished(), buried)

    def next_request(self) -> None:
        """The node starts serving another request: a fresh back-pressure budget."""
        self._writeback.next_request()

    @property
    def problem(self) -> str:
        """Why a tier is unusable now ("" while every tier works)."""
        return self._writeback.problem

    # ------------------------------------------------------------ reporting

    def inventory(self) -> list[tuple[str, int, int]]:
        items = {k: (o.size, o.checksum) for k, o in self.dram.items()}
        if self.ssd is not None:
            for k, r in self.ssd.items():
                items.setdefault(k, (r.size, r.checksum))
        return [(k, s, c) for k, (s, c) in items.items()]

    def stats(self) -> dict:
        st = self.dram.stats()
        st["objects"] = len(self.dram)
        if self.ssd is not None:
            st.update(self.ssd.stats())
            st["objects_total"] = len(set(self.dram.keys()) | set(self.ssd.keys()))
        else:
            st["objects_total"] = st["objects"]
        st["tenants"] = self.tenants.usage()
        st["quota_evictions"] = self.quota_evictions
        st["degraded"] = self._writeback.problem     # "" while every tier works
        return st

    def close(self) -> None:
        self.bury()
        self._writeback.close()
        if self.ssd is not None:
            self.ssd.close()
        self.dram.close()
