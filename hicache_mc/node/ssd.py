"""SsdTier: the index and the space of the SSD tier, owned by the node loop.

Records live in append-only segment files (the format: ``ssd_format.py``), written by one
thread (``ssd_writer.py``). A restart scans every segment in order: later records of a key
replace earlier ones, and a tombstone removes it; a record whose key is longer than
MAX_KEY_BYTES (no message could name it to the master) is left out. A value whose bytes were
damaged is caught when read (its xxh3 is checked before it is served) and dropped. New records
always go to a fresh segment after a restart, never after a possibly torn tail.

Threads: the writer thread owns the active segment and does every write; the node loop owns
the index and does the reads (``pread``); it takes finished jobs with ``next_done``. A segment
is deleted only by the loop, after every live record has left it.
"""
from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import queue
from collections import OrderedDict
from typing import Callable, Optional

import xxhash

from ..errors import HicacheError
from ..limits import MAX_KEY_BYTES
from .seg_keys import SegmentKeys
from .ssd_format import KIND_OBJECT, Rec, scan_segment
from .ssd_writer import Job, SsdWriter

__all__ = ["Job", "Rec", "SsdTier", "scan_segment"]

log = logging.getLogger(__name__)


class SsdTier:
    """Index and space accounting of the on-disk tier (owned by the node loop)."""

    def __init__(self, directory: str, capacity: int, segment_bytes: int, high_watermark: float,
                 low_watermark: float, wake: Callable[[], None] = lambda: None):
        self.dir = directory
        self.capacity = capacity
        self.high = int(capacity * high_watermark)
        self.low = int(capacity * low_watermark)
        self._lock_fd = self._lock(directory)
        self._index: "OrderedDict[str, Rec]" = OrderedDict()   # LRU order: oldest first
        self._seg_sizes: dict[int, int] = {}                    # bytes on disk per segment
        self._seg_live: dict[int, int] = {}                     # live value bytes per segment
        self._compacting: set[int] = set()
        self._keys_in = SegmentKeys()       # which segments may hold records of a key
        self._fds: dict[int, int] = {}
        self._counters = {"demotions": 0, "promotions": 0, "compactions": 0, "evictions": 0,
                          "corrupt": 0, "write_errors": 0}
        self._submitted = self._taken = 0     # jobs (see idle)
        last = self._recover()
        self._writer = SsdWriter(directory, last + 1, segment_bytes, wake)
        self._writer.start()

    @staticmethod
    def _lock(directory: str) -> int:
        """One node per folder: a second one would interleave segment numbers. A folder this
        process cannot create files in fails the node at start, rather than every put later."""
        try:
            os.makedirs(directory, exist_ok=True)
            probe = os.path.join(directory, f".probe-{os.getpid()}")
            os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600))
            os.unlink(probe)
            fd = os.open(os.path.join(directory, "LOCK"), os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise HicacheError(f"ssd_dir {directory}: {exc.strerror}; give the SSD tier a folder "
                               "this user can write (--ssd-dir, ssd_dir)") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise HicacheError(f"ssd_dir {directory} is in use by another node") from None
        return fd

    # ------------------------------------------------------------ recovery

    def _recover(self) -> int:
        segs = sorted(int(n[4:12]) for n in os.listdir(self.dir)
                      if n.startswith("seg-") and n.endswith(".dat") and n[4:12].isdigit())
        too_long = 0
        for seg in segs:
            path = self.path(seg)
            self._seg_sizes[seg] = os.path.getsize(path)
            self._seg_live.setdefault(seg, 0)
            for kind, key, rec in scan_segment(path, seg):
                if len(key) > MAX_KEY_BYTES:    # (written before keys were limited) no
                    too_long += 1               # message could name it to the master
                    continue
                old = self._index.pop(key, None)
                if old is not None:
                    self._seg_live[old.seg] -= old.size
                if kind == KIND_OBJECT:
                    self._index[key] = rec
                    self._seg_live[seg] += rec.size
                    self._keys_in.add(seg, key)
        if segs:
            log.info("ssd tier %s: recovered %d objects from %d segments", self.dir, len(self._index), len(segs))
        if too_long:
            log.warning("ssd tier %s: left out %d records whose keys are over %d characters",
                        self.dir, too_long, MAX_KEY_BYTES)
        return segs[-1] if segs else 0

    def path(self, seg: int) -> str:
        return os.path.join(self.dir, f"seg-{seg:08d}.dat")

    # ------------------------------------------------------------ index

    @property
    def used(self) -> int:
        return sum(self._seg_sizes.values())

    def __contains__(self, key: str) -> bool:
        return key in self._index

    def __len__(self) -> int:
        return len(self._index)

    def keys(self):
        return self._index.keys()

    def items(self):
        """(key, record) pairs, least recently used first."""
        return self._index.items()

    def get(self, key: str, touch: bool = True) -> Optional[Rec]:
        rec = self._index.get(key)
        if rec is not None and touch:
            self._index.move_to_end(key)
        return rec

    def add(self, key: str, rec: Rec) -> None:
        self.remove(key)
        self._index[key] = rec
        self._seg_live[rec.seg] = self._seg_live.get(rec.seg, 0) + rec.size

    def remove(self, key: str) -> Optional[Rec]:
        rec = self._index.pop(key, None)
        if rec is not None:
            self._seg_live[rec.seg] -= rec.size
        return rec

    def count(self, event: str, n: int = 1) -> None:
        """Count ``n`` events (demotions, promotions, compactions, corrupt, write_errors)."""
        self._counters[event] += n

    # ------------------------------------------------------------ the writer thread

    def submit(self, job: Job) -> None:
        """Queue a job for the writer thread (jobs run in the order submitted)."""
        self._submitted += 1
        self._writer.jobs.put(job)

    def next_done(self, timeout: Optional[float] = 0.0) -> Optional[Job]:
        """The next finished job, waiting up to ``timeout`` seconds (None: for ever); None
        when none finished in time. The seen segment sizes are taken in first."""
        try:
            job = self._writer.done.get(timeout=timeout) if timeout != 0.0 else \
                self._writer.done.get_nowait()
        except queue.Empty:
            return None
        self._taken += 1
        self._note_sizes(job.seg_sizes)
        if job.kind in ("append", "compact"):
            for key, rec in job.result:
                if rec is not None:
                    self._keys_in.add(rec.seg, key)
        if job.error:
            self._counters["write_errors"] += 1
        return job

    def idle(self) -> bool:
        """Whether every submitted job has finished and been taken."""
        return self._taken == self._submitted

    def _note_sizes(self, seg_sizes: dict) -> None:
        for seg, size in seg_sizes.items():
            if size or seg in self._seg_sizes:
                self._seg_sizes[seg] = size
                self._seg_live.setdefault(seg, 0)

    # ------------------------------------------------------------ reads

    def _fd(self, seg: int) -> int:
        fd = self._fds.get(seg)
        if fd is None:
            fd = self._fds[seg] = os.open(self.path(seg), os.O_RDONLY)
        return fd

    def read_into(self, rec: Rec, out: memoryview) -> bool:
        """Read a record's value into ``out`` and verify it; False when damaged or unreadable."""
        try:
            n = os.preadv(self._fd(rec.seg), [out], rec.offset)
        except OSError as exc:
            log.warning("ssd read failed (%s): treated as a miss", exc)
            return False
        if n != rec.size or xxhash.xxh3_64_intdigest(out) != rec.checksum:
            self._counters["corrupt"] += 1
            return False
        return True

    def read(self, rec: Rec) -> Optional[bytearray]:
        buf = bytearray(rec.size)
        return buf if self.read_into(rec, memoryview(buf)) else None

    # ------------------------------------------------------------ space

    def evict(self) -> list[tuple[str, int]]:
        """Above the high watermark, drop LRU records until live bytes reach the low one;
        returns (key, size) of each."""
        if self.used <= self.high:
            return []
        gone = []
        live = sum(self._seg_live.values())
        while self._index and live > self.low:
            key, rec = self._index.popitem(last=False)
            self._seg_live[rec.seg] -= rec.size
            live -= rec.size
            gone.append((key, rec.size))
        self._counters["evictions"] += len(gone)
        return gone

    def compacting(self) -> bool:
        """Whether a segment is being compacted now."""
        return bool(self._compacting)

    def reclaimable(self) -> list[int]:
        """Closed segments worth compacting (under half live), emptiest first."""
        active = self._writer.seg
        segs = [s for s, size in self._seg_sizes.items()
                if s < active and s not in self._compacting and size > 0
                and self._seg_live.get(s, 0) < size // 2]
        return sorted(segs, key=lambda s: self._seg_live.get(s, 0))

    def start_compaction(self, seg: int) -> list[tuple[str, Rec]]:
        """Mark ``seg`` as being compacted; its live records (to re-append)."""
        self._compacting.add(seg)
        return self.live_records(seg)

    def abandon_compaction(self, seg: int) -> None:
        self._compacting.discard(seg)

    def buried_before(self, keys: list[str], seg: int) -> list[bool]:
        """Per key: whether a segment older than ``seg`` may hold a record of it, which a
        tombstone in ``seg`` buries (see ``SegmentKeys``)."""
        return self._keys_in.may_hold_before(keys, seg)

    def segments(self) -> list[int]:
        """The segment files on disk, oldest first."""
        return sorted(self._seg_sizes)

    def live_records(self, seg: int) -> list[tuple[str, Rec]]:
        return [(k, r) for k, r in self._index.items() if r.seg == seg]

    def delete_segment(self, seg: int) -> None:
        fd = self._fds.pop(seg, None)
        if fd is not None:
            os.close(fd)
        with contextlib.suppress(FileNotFoundError):   # a file gone already is as good
            os.unlink(self.path(seg))
        self._seg_sizes.pop(seg, None)
        self._seg_live.pop(seg, None)
        self._compacting.discard(seg)
        self._keys_in.forget(seg)

    def stats(self) -> dict:
        return {"ssd_objects": len(self._index), "ssd_used": self.used, "ssd_capacity": self.capacity,
                "ssd_live": sum(self._seg_live.values()), "ssd_segments": len(self._seg_sizes),
                **{f"ssd_{k}": v for k, v in self._counters.items()}}

    def close(self) -> None:
        self._writer.stop()
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
