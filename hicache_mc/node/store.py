"""TieredStore: one node's objects across its DRAM tier and its optional SSD tier.

Policy, in one place (how objects reach the SSD tier, and leave DRAM for it, is
``writeback.py``):

- Writes land in DRAM, reserved then committed; a second writer of a key being stored is told
  "busy", and one of a key stored already "stored".
- A read of an SSD-only object stages it back into DRAM; with no room there for it now, the
  lease says so (the reader asks again once it has released others).
- The master hears of every key that left the node and is not held again by the time the
  report goes (``drain_dropped``).
- An object a reader found damaged, whose bytes fail its checksum here too, is removed
  (``drop_damaged``): a put of the key stores it again.
- Tenants (the ``@tenant`` suffix of a key's namespace): bytes held and bytes reserved per
  tenant are counted; a reservation is charged when made, credited back when it lapses or is
  given back, and moves to the bytes held at commit. A tenant with a quota (this node's share,
  sent by the master) that a reservation would take over it evicts its own least recently used
  objects first (SSD-only ones, then DRAM), never another tenant's, and the write fails if
  that cannot make room: no batch overruns a quota.
"""
from __future__ import annotations

import logging
import time
from collections import defaultdict
from typing import Optional

import xxhash

from ..keys import tenant_of
from ..protocol import MAX_TENANTS, RESERVE_BUSY, RESERVE_FULL, RESERVE_STORED
from .dram import DramTier, Obj
from .ssd import Job, SsdTier
from .writeback import WriteBack

log = logging.getLogger(__name__)



class TieredStore:
    def __init__(self, dram: DramTier, ssd: Optional[SsdTier], durability: str, fsync_interval_s: float):
        self.dram = dram
        self.ssd = ssd
        self.durability = durability if ssd else "none"
        self.fsync_interval_s = fsync_interval_s
        dram.drop_dirty = ssd is None
        self.writeback = WriteBack(dram, ssd, self.durability, fsync_interval_s, self._lost_on_ssd)
        self.quotas: dict[str, int] = {}                      # tenant -> bytes this node may hold
        self.usage: dict[str, int] = defaultdict(int)         # tenant -> bytes held (any tier)
        self.reserved_bytes: dict[str, int] = defaultdict(int)  # tenant -> bytes reserved, not committed
        self._settled = 0                                     # dram.dropped[:_settled] are out of usage
        self.quota_evictions = 0
        if ssd is not None:
            for key, rec in ssd.index.items():
                self.usage[tenant_of(key)] += rec.size

    # ------------------------------------------------------------ lookups

    def contains(self, key: str) -> bool:
        return key in self.dram.objects or (self.ssd is not None and key in self.ssd.index)

    def meta(self, key: str) -> Optional[tuple[int, int]]:
        """(size, checksum) wherever the object lives."""
        obj = self.dram.objects.get(key)
        if obj is not None:
            return obj.size, obj.checksum
        rec = self.ssd.index.get(key) if self.ssd else None
        return (rec.size, rec.checksum) if rec else None

    def unlease(self, key: str, offset: int) -> None:
        """A reader released its lease on ``key`` at ``offset``, or a writer gave back its
        reservation (see DramTier.unlease)."""
        given_back = self.dram.unlease(key, offset)
        if given_back:
            self.reserved_bytes[tenant_of(key)] -= given_back

    def lease(self, key: str, now: float) -> Optional[Obj]:
        """The object in DRAM, leased (an SSD-only object is staged in first); None when
        absent, or when on SSD only and DRAM has no room to stage it now."""
        obj = self.dram.lease(key, now)
        if obj is not None or self.ssd is None:
            return obj
        rec = self.ssd.get(key)
        if rec is None:
            return None
        if self.dram.reserve(key, rec.size, now, 0.0) < 0:
            return None
        obj = self.dram.reserved[key][0]
        if not self.ssd.read_into(rec, self.dram.view(obj)):
            self.dram.reserved.pop(key)
            self.dram._free(obj, now)
            self._lost_on_ssd(key)
            return None
        self.dram.commit(key, rec.checksum)
        obj.on_ssd = True
        self.ssd.counters["promotions"] += 1
        return self.dram.lease(key, now)

    def on_ssd_only(self, key: str) -> bool:
        """Whether the key is held on SSD and not in DRAM (a lease must stage it first)."""
        return self.ssd is not None and key in self.ssd.index and key not in self.dram.objects

    def _lost_on_ssd(self, key: str) -> None:
        log.warning("ssd record of %s is damaged; dropped it", key)
        rec = self.ssd.remove(key)
        obj = self.dram.objects.get(key)
        if obj is not None:
            obj.on_ssd = False
        else:
            self.dram.dropped.append((key, rec.size if rec else 0))

    # ------------------------------------------------------------ writes

    def durable(self, key: str) -> Optional[bool]:
        """True: stored as the policy promises (acknowledge a duplicate put); False: being
        stored right now (reserved, or with ``sync`` not yet on disk); None: absent."""
        if self.ssd is not None and key in self.ssd.index:
            return True
        obj = self.dram.objects.get(key)
        if obj is not None:
            return obj.on_ssd or self.durability != "sync"
        return False if key in self.dram.reserved else None

    def reserve(self, key: str, size: int, now: float, hold_s: float) -> int:
        state = self.durable(key)
        if state is not None:   # a second writer of the same key is acknowledged only once it holds
            return RESERVE_STORED if state else RESERVE_BUSY
        if not self._within_quota(key, size, now):
            return RESERVE_FULL
        offset = self.dram.reserve(key, size, now, hold_s)
        if offset == -1:
            offset = self.writeback.room_by_waiting(
                size, now, lambda: self.dram.reserve(key, size, time.monotonic(), hold_s))
        if offset >= 0:
            self.reserved_bytes[tenant_of(key)] += size
        return offset

    def reserve_many(self, keys: list[str], sizes: list[int], now: float, hold_s: float,
                     max_value: int) -> list[int]:
        """``reserve`` for a batch (RESERVE_FULL for sizes out of 0..``max_value``). Keys not
        stored, not being stored and under no quota take one free range together
        (``DramTier.reserve_fresh``); the rest, or all when no range is big enough, go
        key by key."""
        out = [RESERVE_FULL] * len(keys)
        fresh, seen = [], set()
        objects, reserved = self.dram.objects, self.dram.reserved
        on_ssd = self.ssd.index if self.ssd is not None else {}
        for i, (key, size) in enumerate(zip(keys, sizes)):
            if size < 0 or size > max_value:
                continue
            if key in seen or key in objects or key in reserved or key in on_ssd or \
                    (self.quotas and tenant_of(key) in self.quotas):
                out[i] = None       # the careful way, below
            else:
                fresh.append(i)
            seen.add(key)
        if fresh:
            got = self.dram.reserve_fresh([keys[i] for i in fresh], [sizes[i] for i in fresh],
                                          now, hold_s)
            if got is None:
                for i in fresh:
                    out[i] = None
            else:
                for i, off in zip(fresh, got):
                    out[i] = off
                    self.reserved_bytes[tenant_of(keys[i])] += sizes[i]
        for i, off in enumerate(out):
            if off is None:
                out[i] = self.reserve(keys[i], sizes[i], now, hold_s)
        return out

    def commit(self, key: str, checksum: int) -> bool:
        """Make a reserved slot a readable object."""
        return self.commit_many([key], [checksum])[0] is not None

    def commit_many(self, keys: list[str], checksums: list[int],
                    offsets: Optional[list[int]] = None) -> list[Optional[Obj]]:
        """``commit`` for a batch: the committed object per key (None: nothing reserved, or,
        with ``offsets``, reserved at another offset: another writer's slot)."""
        out = []
        usage, charged, tenants = self.usage, self.reserved_bytes, {}
        reserved, objects = self.dram.reserved, self.dram.objects
        for i, (key, checksum) in enumerate(zip(keys, checksums)):
            entry = reserved.get(key)
            if entry is None or (offsets is not None and entry[0].offset != offsets[i]):
                out.append(None)
                continue
            del reserved[key]
            obj = entry[0]
            obj.checksum = checksum
            objects[key] = obj
            out.append(obj)
            ns = key.partition("/")[0]
            tenant = tenants.get(ns)
            if tenant is None:
                tenant = tenants[ns] = tenant_of(ns)
            usage[tenant] += obj.size
            charged[tenant] -= obj.size
        return out

    # ------------------------------------------------------------ tenants

    def _within_quota(self, key: str, size: int, now: float) -> bool:
        """Make room for ``size`` more bytes of ``key``'s tenant (held and reserved) by evicting
        only its own objects."""
        tenant = tenant_of(key)
        quota = self.quotas.get(tenant)
        if quota is None:
            return True
        self._settle()      # objects evicted since the last drain no longer count
        need = self.usage[tenant] + self.reserved_bytes[tenant] + size - quota
        if need <= 0:
            return True
        if size > quota:
            return False
        victims = []
        if self.ssd is not None:   # SSD-only objects are the colder ones
            victims += [k for k in self.ssd.index
                        if k not in self.dram.objects and tenant_of(k) == tenant]
        victims += [k for k, o in self.dram.objects.items()
                    if not o.busy and tenant_of(k) == tenant]
        for k in victims:
            if need <= 0:
                break
            need -= self._evict_entirely(k, now)
        return need <= 0

    def _evict_entirely(self, key: str, now: float) -> int:
        """Remove ``key`` from every tier of this node (the master is told); returns its size."""
        size = 0
        obj = self.dram.objects.pop(key, None)
        if obj is not None:
            size = obj.size
            self.dram._free(obj, now)
            self.dram.evictions += 1
        rec = self.ssd.remove(key) if self.ssd is not None else None
        if rec is not None:
            size = rec.size
        self.dram.dropped.append((key, size))
        self.quota_evictions += 1
        return size

    def _settle(self) -> None:
        """Take the objects that left the node since the last call out of their tenants' usage."""
        dropped = self.dram.dropped
        for key, size in dropped[self._settled:]:
            self.usage[tenant_of(key)] -= size
        self._settled = len(dropped)

    def drain_dropped(self) -> list[str]:
        """Keys that left this node since the last call, for the master: not those stored
        again meanwhile (their commit is reported already; this report must not undo it).
        Updates usage."""
        self._settle()
        dropped, self.dram.dropped, self._settled = self.dram.dropped, [], 0
        return [k for k, _ in dropped if not self.contains(k)]

    # ------------------------------------------------------------ removal

    def remove(self, keys: list[str], now: float) -> list[str]:
        for key in keys:
            meta = self.meta(key)
            if meta is not None:
                self.usage[tenant_of(key)] -= meta[0]
        objects = self.dram.objects
        # objects on their way to disk: their records land before the tombstones queued here
        writing = {k for k in keys if k in objects and objects[k].busy}
        gone = set(self.dram.remove(keys, now))
        if self.ssd is not None:
            on_disk = {k for k in keys if self.ssd.remove(k) is not None}
            if on_disk or writing:
                self.ssd.writer.jobs.put(Job("tombstone", sorted(on_disk | writing)))
            gone |= on_disk
        return [k for k in keys if k in gone]

    def drop_damaged(self, keys: list[str], offsets: list[int], now: float) -> list[str]:
        """Remove the objects a reader found damaged: those still at the offset it read
        (the same object) whose bytes do not match their checksum here either (a commit that
        named another checksum, bytes changed since). Returns the keys removed."""
        bad = [k for k, off in dict(zip(keys, offsets)).items()
               if (obj := self.dram.objects.get(k)) is not None and obj.offset == off
               and xxhash.xxh3_64_intdigest(self.dram.view(obj)) != obj.checksum]
        if bad:
            log.warning("%d objects do not match their checksums (e.g. %s); dropped them",
                        len(bad), bad[0][:200])
        return self.remove(bad, now)

    def clear(self, prefix: str, now: float, tenant: Optional[str] = None) -> list[str]:
        """Remove the keys starting with ``prefix`` (of ``tenant`` only, unless None)."""
        keys = set(k for k in self.dram.objects if k.startswith(prefix))
        if self.ssd is not None:
            keys.update(k for k in self.ssd.index if k.startswith(prefix))
        if tenant is not None:
            keys = {k for k in keys if tenant_of(k) == tenant}
        return self.remove(sorted(keys), now)

    # ------------------------------------------------------------ the SSD tier's side

    def persist(self, keys: list[str], waiter: object = None) -> bool:
        """Write newly committed objects through (see ``WriteBack.persist``)."""
        return self.writeback.persist(keys, waiter)

    def maintain(self, now: float) -> None:
        for key, size in self.dram.maintain(now):     # reservations that lapsed
            self.reserved_bytes[tenant_of(key)] -= size
        self.writeback.maintain(now)

    def poll_done(self, now: float) -> None:
        self.writeback.poll_done(now)

    def next_request(self) -> None:
        self.writeback.next_request()

    # ------------------------------------------------------------ reporting

    def inventory(self) -> list[tuple[str, int, int]]:
        items = {k: (o.size, o.checksum) for k, o in self.dram.objects.items()}
        if self.ssd is not None:
            for k, r in self.ssd.index.items():
                items.setdefault(k, (r.size, r.checksum))
        return [(k, s, c) for k, (s, c) in items.items()]

    def stats(self) -> dict:
        st = self.dram.stats()
        st["objects"] = len(self.dram.objects)
        if self.ssd is not None:
            st.update(self.ssd.stats())
            st["objects_total"] = len(set(self.dram.objects) | set(self.ssd.index))
        else:
            st["objects_total"] = st["objects"]
        st["tenants"] = top_tenants(self.usage)
        st["quota_evictions"] = self.quota_evictions
        st["degraded"] = self.writeback.problem     # "" while every tier works
        return st

    def close(self) -> None:
        self.writeback.close()
        if self.ssd is not None:
            self.ssd.close()
        self.dram.close()


def top_tenants(usage: dict[str, int], most: int = MAX_TENANTS) -> dict[str, int]:
    """The bytes of the ``most - 1`` biggest tenants, the rest summed under "(other)": a
    node's stats stay within what a heartbeat may carry however many tenants write to it."""
    held = {t: b for t, b in usage.items() if b}
    if len(held) < most:
        return held
    top = dict(sorted(held.items(), key=lambda kv: kv[1], reverse=True)[: most - 1])
    top["(other)"] = sum(held.values()) - sum(top.values())
    return top
