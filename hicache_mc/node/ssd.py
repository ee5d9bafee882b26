"""SsdTier: append-only segment files on local disk, scanned back after a restart.

On-disk format (little endian), one record after another in ``seg-<n>.dat`` files of at most
``segment_bytes`` each (a larger record gets a segment of its own)::

    magic   4s   b"HCR1"
    version u8   1
    kind    u8   1 = object, 2 = tombstone (the key was removed on purpose)
    key_len u16
    hcrc    u32  crc32 of this header (with hcrc = 0) and the key
    vlen    u64  value bytes that follow the key (0 for a tombstone)
    vsum    u64  xxh3-64 of the value (the object's checksum, as clients verify it)
    key     key_len bytes, UTF-8
    value   vlen bytes

A restart scans every segment in order; a header that fails its magic, version, crc or length
check ends that segment's scan (a torn tail), and later segments go on; a record whose key is
longer than MAX_KEY_BYTES (no message could name it to the master) is left out. A value whose
bytes were damaged is caught when read (its xxh3 is checked before it is served) and dropped.
New records always go to a fresh segment after a restart, never after a possibly torn tail.

Threads: one writer thread owns the active segment and does every write (appends, tombstones,
compaction copies, fsync). The node loop owns the index and does the reads (``pread``); it
hears of finished jobs through ``poll_done``. A segment is deleted only by the loop, after
every live record has left it.
"""
from __future__ import annotations

import errno
import fcntl
import logging
import os
import queue
import struct
import threading
import zlib
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Optional

import xxhash

from ..errors import HicacheError
from ..limits import MAX_KEY_BYTES

log = logging.getLogger(__name__)

HEADER = struct.Struct("<4sBBHIQQ")
MAGIC = b"HCR1"
FORMAT_VERSION = 1
KIND_OBJECT, KIND_TOMBSTONE = 1, 2


@dataclass(slots=True)
class Rec:
    seg: int
    offset: int        # where the value starts in the segment file
    size: int
    checksum: int


@dataclass
class Job:
    kind: str                                  # "append" | "tombstone" | "compact" | "fsync"
    items: list = field(default_factory=list)  # append: (key, buffer, checksum); tombstone: keys
    fsync: bool = False
    tag: object = None                         # returned untouched with the result
    result: list = field(default_factory=list) # (key, Rec | None) per item
    error: Optional[str] = None
    seg_sizes: dict = field(default_factory=dict)  # segment -> bytes written so far (after the job)


def header_for(kind: int, key: bytes, vlen: int, vsum: int) -> bytes:
    crc = zlib.crc32(HEADER.pack(MAGIC, FORMAT_VERSION, kind, len(key), 0, vlen, vsum) + key)
    return HEADER.pack(MAGIC, FORMAT_VERSION, kind, len(key), crc, vlen, vsum) + key


def scan_segment(path: str, seg: int):
    """Yield (kind, key, Rec) for every intact record header of one segment file."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        pos = 0
        while pos + HEADER.size <= size:
            f.seek(pos)
            head = f.read(HEADER.size)
            magic, ver, kind, klen, crc, vlen, vsum = HEADER.unpack(head)
            if magic != MAGIC or ver != FORMAT_VERSION or kind not in (KIND_OBJECT, KIND_TOMBSTONE):
                log.warning("%s: bad record header at %d; ignoring the rest of the segment", path, pos)
                return
            key = f.read(klen)
            value_at = pos + HEADER.size + klen
            if len(key) != klen or value_at + vlen > size:
                log.warning("%s: torn record at %d; ignoring the rest of the segment", path, pos)
                return
            if zlib.crc32(HEADER.pack(MAGIC, ver, kind, klen, 0, vlen, vsum) + key) != crc:
                log.warning("%s: record header checksum mismatch at %d; ignoring the rest", path, pos)
                return
            try:
                name = key.decode()
            except UnicodeDecodeError:
                return
            yield kind, name, Rec(seg, value_at, vlen, vsum)
            pos = value_at + vlen


class SsdWriter(threading.Thread):
    """The one thread that appends to segment files."""

    def __init__(self, directory: str, first_seg: int, segment_bytes: int, wake: Callable[[], None]):
        super().__init__(name="ssd-writer", daemon=True)
        self.dir = directory
        self.segment_bytes = segment_bytes
        self.wake = wake
        self.jobs: "queue.Queue[Optional[Job]]" = queue.Queue()
        self.done: "queue.Queue[Job]" = queue.Queue()
        self.seg = first_seg
        self.fd: Optional[int] = None
        self.pos = 0
        self.dirty = False
        self._touched: dict[int, int] = {}   # segment -> size, for the job in progress

    def path(self, seg: int) -> str:
        return os.path.join(self.dir, f"seg-{seg:08d}.dat")

    def run(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                break
            try:
                self._do(job)
            except OSError as exc:
                job.error = f"{self.dir}: {os.strerror(exc.errno) if exc.errno else exc}"
                self._roll()   # never append after a possibly torn record
            except Exception as exc:  # a bug must not kill the writer
                log.exception("ssd writer: unexpected error")
                job.error = repr(exc)
            job.seg_sizes = self._touched
            self._touched = {}
            self.done.put(job)
            self.wake()
        if self.fd is not None:
            os.close(self.fd)

    def _roll(self) -> None:
        if self.fd is not None:
            self._touched[self.seg] = os.fstat(self.fd).st_size
            if self.dirty:   # a closed segment is a durable one: later fsyncs only see the new fd
                try:
                    os.fsync(self.fd)
                except OSError:
                    pass
                self.dirty = False
            os.close(self.fd)
            self.fd = None
            self.seg += 1
            self.pos = 0

    def _append(self, kind: int, key: str, value, vsum: int) -> Rec:
        kb = key.encode()
        head = header_for(kind, kb, len(value), vsum)
        need = len(head) + len(value)
        if self.fd is not None and self.pos > 0 and self.pos + need > self.segment_bytes:
            self._roll()
        if self.fd is None:
            self.fd = os.open(self.path(self.seg), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            self.pos = os.fstat(self.fd).st_size
        parts = [head, value] if len(value) else [head]
        written = os.writev(self.fd, parts)
        while written < need:  # short writes happen on some filesystems near full
            rest = (head + bytes(value))[written:]
            n = os.write(self.fd, rest)
            if n == 0:
                raise OSError(errno.ENOSPC, "no space left")
            written += n
        rec = Rec(self.seg, self.pos + len(head), len(value), vsum)
        self.pos += need
        self._touched[self.seg] = self.pos
        self.dirty = True
        return rec

    def _do(self, job: Job) -> None:
        if job.kind in ("append", "compact"):
            for key, value, vsum in job.items:
                if job.kind == "compact":
                    value = value()   # compaction reads lazily: the old record's bytes
                    if value is None:
                        job.result.append((key, None))
                        continue
                try:
                    rec = self._append(KIND_OBJECT, key, value, vsum)
                except (struct.error, UnicodeEncodeError) as exc:   # a bad record, not a bad disk
                    log.warning("ssd: cannot write %r: %s", key[:80], exc)
                    rec = None
                job.result.append((key, rec))
        elif job.kind == "tombstone":
            for key in job.items:
                self._append(KIND_TOMBSTONE, key, b"", 0)
        if (job.fsync or job.kind == "fsync") and self.fd is not None and self.dirty:
            os.fsync(self.fd)
            self.dirty = False

    def stop(self) -> None:
        self.jobs.put(None)
        self.join(timeout=10)


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

    def live_records(self, seg: int) -> list[tuple[str, Rec]]:
        return [(k, r) for k, r in self._index.items() if r.seg == seg]

    def delete_segment(self, seg: int) -> None:
        fd = self._fds.pop(seg, None)
        if fd is not None:
            os.close(fd)
        try:
            os.unlink(self.path(seg))
        except FileNotFoundError:
            pass
        self._seg_sizes.pop(seg, None)
        self._seg_live.pop(seg, None)
        self._compacting.discard(seg)

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
