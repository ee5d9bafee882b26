"""WriteBack: a node's DRAM objects on their way to its SSD tier, as ``durability`` says.

- ``sync`` writes each batch through and fsyncs before the put is acknowledged; ``async``
  writes through in the background and fsyncs every ``fsync_interval_s``; ``demote`` writes
  only what is demoted.
- DRAM above its high watermark: copies already on SSD are dropped at once; the rest are
  demoted (written to SSD in one batch) and their slots freed once the batch is on disk. If the
  disk fails, demotion falls back to dropping, and the failure is logged once a minute at most.
- A write that finds DRAM full of objects not yet on disk waits for the oldest to be demoted
  (``room_by_waiting``, bounded per request of the node loop) rather than drop what was
  acknowledged or fail the put.
- SSD above its high watermark: LRU records are forgotten (the store buries them); segments
  under half live are compacted in the background, and deleted once the tombstones in them
  that still bury a record in an older segment are carried on.
- Tombstones (``bury``) follow every record queued before them, so they bury it.

The SSD tier's writer thread does every write; the node loop owns the indexes and applies
finished jobs (``poll_done``). A job names the DRAM objects it was started for, not their keys:
a key removed and stored again meanwhile is another object, which the old job leaves alone.
Without an SSD tier every method is a no-op.
"""
from __future__ import annotations

import logging
import time
from typing import Callable, NamedTuple, Optional

from .dram import DramTier, Slot
from .ssd import Job, SsdTier

log = logging.getLogger(__name__)

DEMOTE_BATCH_BYTES = 64 << 20   # one sequential write per batch; bounds the loop's stall
DISK_RETRY_S = 30.0             # after a disk failure, try demoting again this often
ERROR_LOG_INTERVAL_S = 60.0
ROOM_WAIT_S = 1.0               # longest one request waits for the SSD writer to free DRAM


class Writing(NamedTuple):
    """The tag of a write-through or demotion job."""
    demote: bool
    objs: list[Slot]            # the DRAM object of each item, held until applied
    waiter: object = None       # a sync write's waiter: returned by ``take_finished``


class Compaction(NamedTuple):
    """The tag of a compaction job."""
    seg: int
    before: dict                # key -> the record it moves (a record replaced meanwhile stays)


class Finished(NamedTuple):
    waiter: object
    ok: list                    # per key: on disk, and not removed meanwhile


class Burial(NamedTuple):
    """The tag of a tombstone job: the store's ticket for it."""
    ticket: int


class Carried(NamedTuple):
    """The tag of the tombstones a compaction carries on: the segment deleted after them."""
    seg: int


class WriteBack:
    def __init__(self, dram: DramTier, ssd: Optional[SsdTier], durability: str,
                 fsync_interval_s: float, lost: Callable[[str], None]):
        self.dram, self.ssd = dram, ssd
        self.durability = durability
        self.fsync_interval_s = fsync_interval_s
        self._lost = lost               # an SSD record found damaged: the store drops it
        self._next_fsync = 0.0
        self._disk_ok = True
        self.problem = ""           # why the SSD tier is unusable now ("" while it is fine)
        self._disk_retry_at = 0.0
        self._quiet_until = 0.0
        self._demoting = False
        self._turn = 0                 # bumped by the node per request (see room_by_waiting)
        self._wait_turn, self._wait_left = -1, 0.0
        self._finished: list[Finished] = []     # sync writes done with the disk
        self._buried: list[int] = []            # tickets of tombstone jobs done (see bury)

    def persist(self, keys: list[str], waiter: object = None) -> bool:
        """Start writing newly committed DRAM objects through to SSD, as the policy says.

        Returns True when ``waiter`` must wait for the disk (``sync``): it comes back through
        ``take_finished`` with one ok flag per key."""
        if self.durability not in ("sync", "async") or not keys:
            return False
        items, objs = [], []
        for key in keys:     # just committed: the key's object is the one to write
            slot = self.dram.get(key)
            if slot is not None and not slot.on_ssd:
                items.append((key, self.dram.start_writing(slot), slot.checksum))
                objs.append(slot)
        sync = self.durability == "sync"
        self.ssd.submit(Job("append", items, fsync=sync, tag=Writing(False, objs, waiter if sync else None)))
        return sync

    def maintain(self, now: float) -> list[str]:
        """Demote, evict and compact as the watermarks say; the periodic fsync of ``async``.
        Returns the keys whose SSD records it evicted (they need tombstones; those not in DRAM
        left the node)."""
        if self.ssd is None:
            return []
        self._demote(now)
        gone = []
        for key, _ in self.ssd.evict():
            self.dram.set_on_ssd(key, False)
            gone.append(key)
        self._compact()
        if self.durability == "async" and now >= self._next_fsync:
            self._next_fsync = now + self.fsync_interval_s
            self.ssd.submit(Job("fsync"))
        return gone

    def _demote(self, now: float, excess: Optional[int] = None) -> None:
        dram = self.dram
        if excess is None:
            excess = dram.excess()
        if excess <= 0 or self._demoting:
            return
        items, objs, batch = [], [], 0
        for key, slot in dram.items():
            if excess <= 0 or batch >= DEMOTE_BATCH_BYTES:
                break
            if slot.busy:
                continue
            excess -= slot.size
            if slot.on_ssd:
                dram.drop(key, now)
            elif self._disk_ok or now >= self._disk_retry_at:
                items.append((key, dram.start_writing(slot), slot.checksum))
                objs.append(slot)
                batch += slot.size
            else:
                dram.drop(key, now)    # the disk failed: fall back to dropping
        if items:
            self._demoting = True
            self._disk_retry_at = now + DISK_RETRY_S
            self.ssd.submit(Job("append", items, tag=Writing(True, objs)))

    def _compact(self) -> None:
        if self.ssd.compacting():
            return
        for seg in self.ssd.reclaimable()[:1]:
            # the writer copies the live records on and reads the segment's tombstones (even
            # with nothing live: a tombstone may still bury an older record)
            live = self.ssd.start_compaction(seg)
            items = [(k, self._reader(r), r.checksum) for k, r in live]
            self.ssd.submit(Job("compact", items, tag=Compaction(seg, dict(live)), seg=seg))

    def _reader(self, rec):
        ssd = self.ssd
        return lambda: ssd.read(rec)     # runs on the writer thread: pread is thread-safe

    def poll_done(self, now: float) -> None:
        """Apply finished SSD jobs (called by the node loop when the writer wakes it)."""
        if self.ssd is None:
            return
        while (job := self.ssd.next_done()) is not None:
            self._apply(job, now)

    def take_finished(self) -> list[Finished]:
        """The sync writes done with the disk since the last call."""
        out, self._finished = self._finished, []
        return out

    def bury(self, keys: list[str], ticket: int) -> None:
        """Queue tombstones for ``keys`` (after every record queued so far: they bury it);
        ``take_buried`` names ``ticket`` once they are written (and, with ``sync``, fsynced)."""
        self.ssd.submit(Job("tombstone", keys, fsync=self.durability == "sync", tag=Burial(ticket)))

    def take_buried(self) -> list[int]:
        """The tickets of tombstone jobs done since the last call."""
        out, self._buried = self._buried, []
        return out

    def next_request(self) -> None:
        """The node starts serving another request: a fresh back-pressure budget."""
        self._turn += 1

    def _apply(self, job: Job, now: float) -> None:
        self._disk_status(job)
        if isinstance(job.tag, Writing):
            self._written(job, job.tag, now)
        elif isinstance(job.tag, Compaction):
            self._compacted(job, job.tag)
        elif isinstance(job.tag, Burial):
            if job.error:       # the disk failed: the deletion is not durable (logged above)
                log.warning("tombstones of %d keys were not written: a restart may bring them "
                            "back", len(job.items))
            self._buried.append(job.tag.ticket)
        elif isinstance(job.tag, Carried):
            self._carried(job)

    def room_by_waiting(self, size: int, now: float,
                        reserve: Callable[[], Optional[Slot]]) -> Optional[Slot]:
        """Back-pressure: DRAM is full of objects not yet on disk. Demote the oldest and wait
        for the writer (bounded) rather than drop what was acknowledged or fail the put;
        ``reserve`` tries again after each finished job (None: no room yet)."""
        if self.ssd is None or not self._disk_ok:
            return None
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

    def _wait_for_room(self, now: float, end: float, size: int, reserve) -> Optional[Slot]:
        while True:
            self._demote(now, excess=size)
            left = end - time.monotonic()
            if left <= 0:
                return None
            job = self.ssd.next_done(timeout=left)
            if job is None:
                return None
            now = time.monotonic()
            self._apply(job, now)
            slot = reserve()
            if slot is not None or not self._disk_ok:
                return slot

    def _disk_status(self, job: Job) -> None:
        if job.error and self._disk_ok:
            now = time.monotonic()
            if now >= self._quiet_until:   # a flapping disk is logged once a minute, not per job
                log.error("ssd tier unusable (%s): demotion drops objects, sync puts fail, reads "
                          "go on", job.error)
                self._quiet_until = now + ERROR_LOG_INTERVAL_S
            self._disk_ok = False
            self.problem = f"ssd tier unusable ({job.error})"[:200]
        elif not job.error and job.result and not self._disk_ok:
            log.info("ssd tier writable again")
            self._disk_ok = True
            self.problem = ""
        self.dram.drop_dirty(not self._disk_ok)   # with no disk to demote to, drop like a cache

    def _written(self, job: Job, tag: Writing, now: float) -> None:
        """Apply a write-through or demotion to the objects it was started for. One removed
        meanwhile keeps its slot until now (``removed``); its record is buried by the
        tombstone ``TieredStore.remove`` queued behind it."""
        recs = [rec for _, rec in job.result]
        recs += [None] * (len(job.items) - len(recs))      # a failed job stops part way
        for (key, _, _), slot, rec in zip(job.items, tag.objs, recs):
            on_disk = rec is not None and not slot.removed
            if on_disk:
                self.ssd.add(key, rec)
                self.ssd.count("demotions", tag.demote)
            self.dram.written(slot, on_disk, now)
            if tag.demote and slot.on_ssd and not slot.busy and self.dram.get(key) is slot:
                self.dram.drop(key, now)
        if tag.demote:
            self._demoting = False
        if tag.waiter is not None:
            self._finished.append(Finished(tag.waiter, [o.on_ssd for o in tag.objs]))

    def _compacted(self, job: Job, tag: Compaction) -> None:
        """The live records of a segment were copied on: the segment goes once the tombstones
        in it that still bury an older record are carried on too."""
        seg, before = tag
        for key, rec in job.result:
            if rec is not None and self.ssd.get(key, touch=False) is before.get(key):
                self.ssd.add(key, rec)      # moved; a record replaced meanwhile stays
        if job.error:
            self.ssd.abandon_compaction(seg)
            return
        for key, rec in self.ssd.live_records(seg):
            self._lost(key)      # unreadable during compaction
        carry = self._still_burying(list(dict.fromkeys(job.tombs)), seg)
        if carry:
            self.ssd.submit(Job("tombstone", carry, fsync=self.durability == "sync",
                                tag=Carried(seg)))
        else:
            self.ssd.delete_segment(seg)
            self.ssd.count("compactions")

    def _still_burying(self, keys: list[str], seg: int) -> list[str]:
        """The keys of tombstones in ``seg`` that must be carried on: an older segment may hold
        a record of the key, and no record of it is live or on its way to disk (a record
        queued before the carried tombstone would be buried by it; a later one is newer)."""
        busy = lambda k: (s := self.dram.get(k)) is not None and s.busy  # noqa: E731
        return [k for k, older in zip(keys, self.ssd.buried_before(keys, seg))
                if older and k not in self.ssd and not busy(k)]

    def _carried(self, job: Job) -> None:
        seg = job.tag.seg
        if job.error:
            self.ssd.abandon_compaction(seg)
            return
        self.ssd.delete_segment(seg)
        self.ssd.count("compactions")

    def close(self) -> None:
        """Flush what ``async`` and ``sync`` wrote (``demote`` fsyncs with each batch)."""
        if self.ssd is not None and self.durability != "demote":
            self.ssd.submit(Job("fsync"))
