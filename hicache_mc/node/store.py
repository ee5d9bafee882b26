"""TieredStore: one node's objects across its DRAM tier and its optional SSD tier.

Policy, in one place:

- Writes land in DRAM. With an SSD tier, ``durability`` decides when they reach disk:
  ``sync`` writes each batch through and fsyncs before the put is acknowledged; ``async`` (the
  default) writes through in the background and fsyncs every ``ssd_fsync_interval_s``;
  ``demote`` writes only what is demoted.
- DRAM above its high watermark: copies already on SSD are dropped at once; the rest are
  demoted (written to SSD in one batch) and their slots freed once the batch is on disk.
  If the disk fails, demotion falls back to dropping, and the failure is logged once.
- A read of an SSD-only object stages it back into DRAM; with no room there for it now, the
  read is a miss.
- SSD above its high watermark: LRU records are forgotten; segments under half live are
  compacted in the background; the master hears of every key that left the node.
- Tenants (the ``@tenant`` suffix of a key's namespace): bytes held per tenant are counted; a
  tenant with a quota (this node's share, sent by the master) that would go over it evicts its
  own least recently used objects first (SSD-only ones, then DRAM), never another tenant's, and
  the write fails if that cannot make room.
"""
from __future__ import annotations

import logging
import queue
import time
from collections import defaultdict
from typing import Optional

from ..keys import tenant_of
from ..protocol import MAX_TENANTS, RESERVE_BUSY, RESERVE_FULL, RESERVE_STORED
from .dram import DramTier, Obj
from .ssd import Job, SsdTier

log = logging.getLogger(__name__)

DEMOTE_BATCH_BYTES = 64 << 20   # one sequential write per batch; bounds the loop's stall
DISK_RETRY_S = 30.0             # after a disk failure, try demoting again this often
ERROR_LOG_INTERVAL_S = 60.0
ROOM_WAIT_S = 1.0               # longest one request waits for the SSD writer to free DRAM


class TieredStore:
    def __init__(self, dram: DramTier, ssd: Optional[SsdTier], durability: str, fsync_interval_s: float):
        self.dram = dram
        self.ssd = ssd
        self.durability = durability if ssd else "none"
        self.fsync_interval_s = fsync_interval_s
        dram.drop_dirty = ssd is None
        self._next_fsync = 0.0
        self._disk_ok = True
        self._disk_retry_at = 0.0
        self._quiet_until = 0.0
        self._demoting = False
        self._turn = 0                 # bumped by the node per request (see _room_by_waiting)
        self._wait_turn, self._wait_left = -1, 0.0
        self.finished: list[tuple[object, list[bool]]] = []   # (waiter, per-key ok) of sync writes
        self.quotas: dict[str, int] = {}                      # tenant -> bytes this node may hold
        self.usage: dict[str, int] = defaultdict(int)         # tenant -> bytes held (any tier)
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
        """A reader released its lease on ``key`` at ``offset`` (see DramTier.unlease)."""
        self.dram.unlease(key, offset)

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
            offset = self._room_by_waiting(size, now, lambda: self.dram.reserve(key, size, time.monotonic(), hold_s))
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
        usage, tenants = self.usage, {}
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
        return out

    # ------------------------------------------------------------ tenants

    def _within_quota(self, key: str, size: int, now: float) -> bool:
        """Make room for ``size`` more bytes of ``key``'s tenant by evicting only its own objects."""
        tenant = tenant_of(key)
        quota = self.quotas.get(tenant)
        if quota is None:
            return True
        need = self.usage[tenant] + size - quota
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

    def drain_dropped(self) -> list[str]:
        """Keys that left this node since the last call (for the master); updates usage."""
        dropped, self.dram.dropped = self.dram.dropped, []
        for key, size in dropped:
            self.usage[tenant_of(key)] -= size
        return [k for k, _ in dropped]

    def persist(self, keys: list[str], waiter: object = None) -> bool:
        """Start writing newly committed DRAM objects through to SSD, as the policy says.

        Returns True when ``waiter`` must wait for the disk (``sync``): it comes back through
        ``finished`` with one ok flag per key."""
        if self.durability not in ("sync", "async") or not keys:
            return False
        items = []
        for key in keys:
            obj = self.dram.objects.get(key)
            if obj is not None and not obj.on_ssd:
                obj.busy += 1
                items.append((key, self.dram.view(obj), obj.checksum))
        sync = self.durability == "sync"
        self.ssd.writer.jobs.put(Job("append", items, fsync=sync, tag=("through", keys, waiter if sync else None)))
        return sync

    # ------------------------------------------------------------ removal

    def remove(self, keys: list[str], now: float) -> list[str]:
        for key in keys:
            meta = self.meta(key)
            if meta is not None:
                self.usage[tenant_of(key)] -= meta[0]
        gone = set(self.dram.remove(keys, now))
        if self.ssd is not None:
            on_disk = [k for k in keys if self.ssd.remove(k) is not None]
            if on_disk:
                self.ssd.writer.jobs.put(Job("tombstone", on_disk))
            gone.update(on_disk)
        return [k for k in keys if k in gone]

    def clear(self, prefix: str, now: float) -> list[str]:
        keys = set(k for k in self.dram.objects if k.startswith(prefix))
        if self.ssd is not None:
            keys.update(k for k in self.ssd.index if k.startswith(prefix))
        return self.remove(sorted(keys), now)

    # ------------------------------------------------------------ background work

    def maintain(self, now: float) -> None:
        self.dram.maintain(now)
        if self.ssd is None:
            return
        self._demote(now)
        for key, size in self.ssd.evict():
            obj = self.dram.objects.get(key)
            if obj is not None:
                obj.on_ssd = False
            else:
                self.dram.dropped.append((key, size))
        self._compact()
        if self.durability == "async" and now >= self._next_fsync:
            self._next_fsync = now + self.fsync_interval_s
            self.ssd.writer.jobs.put(Job("fsync"))

    def _demote(self, now: float, excess: Optional[int] = None) -> None:
        dram = self.dram
        if excess is None:
            if dram.alloc.used <= dram.high:
                return
            excess = dram.alloc.used - dram._quarantined_bytes - dram.low
        if excess <= 0 or self._demoting:
            return
        items, batch = [], 0
        for key, obj in list(dram.objects.items()):
            if excess <= 0 or batch >= DEMOTE_BATCH_BYTES:
                break
            if obj.busy:
                continue
            excess -= obj.size
            if obj.on_ssd:
                dram.drop(key, now)
            elif self._disk_ok or now >= self._disk_retry_at:
                obj.busy += 1
                items.append((key, dram.view(obj), obj.checksum))
                batch += obj.size
            else:
                dram.drop(key, now)    # the disk failed: fall back to dropping
        if items:
            self._demoting = True
            self._disk_retry_at = now + DISK_RETRY_S
            self.ssd.writer.jobs.put(Job("append", items, tag=("demote", None, None)))

    def _compact(self) -> None:
        if self.ssd.compacting:
            return
        for seg in self.ssd.reclaimable()[:1]:
            live = self.ssd.live_records(seg)
            self.ssd.compacting.add(seg)
            if not live:
                self.ssd.delete_segment(seg)
                continue
            items = [(k, self._reader(r), r.checksum) for k, r in live]
            self.ssd.writer.jobs.put(Job("compact", items, tag=("compact", seg, dict(live))))

    def _reader(self, rec):
        ssd = self.ssd
        return lambda: ssd.read(rec)     # runs on the writer thread: pread is thread-safe

    def poll_done(self, now: float) -> None:
        """Apply finished SSD jobs (called by the node loop when the writer wakes it)."""
        if self.ssd is None:
            return
        while True:
            try:
                job = self.ssd.writer.done.get_nowait()
            except queue.Empty:
                return
            self._apply(job, now)

    def next_request(self) -> None:
        """The node starts serving another request: a fresh back-pressure budget."""
        self._turn += 1

    def _apply(self, job: Job, now: float) -> None:
        self.ssd.note_sizes(job.seg_sizes)
        self._disk_status(job)
        kind = job.tag[0] if job.tag else job.kind
        if kind in ("through", "demote"):
            self._written(job, now, demote=kind == "demote")
        elif kind == "compact":
            self._compacted(job)

    def _room_by_waiting(self, size: int, now: float, reserve) -> int:
        """Back-pressure: DRAM is full of objects not yet on disk. Demote the oldest and wait
        for the writer (bounded) rather than drop what was acknowledged or fail the put."""
        if self.ssd is None or not self._disk_ok:
            return -1
        # one budget per node-loop turn: a batch of writes must not hold the loop (and the
        # heartbeats) for long, or the master would take the node for dead
        if self._wait_turn != self._turn:
            self._wait_turn, self._wait_left = self._turn, ROOM_WAIT_S
        start = time.monotonic()
        end = start + self._wait_left
        try:
            return self._wait_for_room(now, end, size, reserve)
        finally:
            self._wait_left = max(0.0, self._wait_left - (time.monotonic() - start))

    def _wait_for_room(self, now: float, end: float, size: int, reserve) -> int:
        while True:
            self._demote(now, excess=size)
            left = end - time.monotonic()
            if left <= 0:
                return -1
            try:
                job = self.ssd.writer.done.get(timeout=left)
            except queue.Empty:
                return -1
            now = time.monotonic()
            self._apply(job, now)
            offset = reserve()
            if offset != -1 or not self._disk_ok:
                return offset

    def _disk_status(self, job: Job) -> None:
        if job.error and self._disk_ok:
            now = time.monotonic()
            if now >= self._quiet_until:   # a flapping disk is logged once a minute, not per job
                log.error("ssd tier unusable (%s): demotion drops objects, sync puts fail, reads "
                          "go on", job.error)
                self._quiet_until = now + ERROR_LOG_INTERVAL_S
            self._disk_ok = False
        elif not job.error and job.result and not self._disk_ok:
            log.info("ssd tier writable again")
            self._disk_ok = True
        if job.error:
            self.ssd.counters["write_errors"] += 1
        self.dram.drop_dirty = not self._disk_ok   # with no disk to demote to, drop like a cache

    def _written(self, job: Job, now: float, demote: bool) -> None:
        written = dict(job.result)
        for key, _, _ in job.items:
            obj = self.dram.objects.get(key)
            rec = written.get(key)
            if rec is not None and obj is not None and not obj.removed:
                self.ssd.add(key, rec)
                obj.on_ssd = True
                self.ssd.counters["demotions"] += demote
            elif rec is not None:     # removed while being written: bury the new record too
                self.ssd.writer.jobs.put(Job("tombstone", [key]))
            if obj is not None:
                self.dram.release(obj, now)
                if demote and obj.on_ssd and key in self.dram.objects and not obj.busy:
                    self.dram.drop(key, now)
        if demote:
            self._demoting = False
        _, keys, waiter = job.tag
        if waiter is not None:
            ok = [written.get(k) is not None or self.ssd.get(k, touch=False) is not None for k in keys]
            self.finished.append((waiter, ok))

    def _compacted(self, job: Job) -> None:
        _, seg, before = job.tag
        for key, rec in job.result:
            if rec is not None and self.ssd.index.get(key) is before.get(key):
                self.ssd.add(key, rec)      # moved; a record replaced meanwhile stays
        if not job.error:
            for key, rec in self.ssd.live_records(seg):
                self._lost_on_ssd(key)      # unreadable during compaction
            self.ssd.delete_segment(seg)
            self.ssd.counters["compactions"] += 1
        else:
            self.ssd.compacting.discard(seg)

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
        return st

    def close(self) -> None:
        if self.ssd is not None:
            if self.durability != "demote":
                self.ssd.writer.jobs.put(Job("fsync"))
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
