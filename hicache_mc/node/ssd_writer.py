"""SsdWriter: the one thread that appends to the SSD tier's segment files (``ssd_format.py``).

It owns the active segment and does every write (appends, tombstones, compaction copies,
fsync), a ``Job`` at a time in the order submitted; the node loop hears of finished jobs
through ``SsdTier.next_done`` (and a wake-up callback).
"""
from __future__ import annotations

import errno
import logging
import os
import queue
import struct
import threading
from dataclasses import dataclass, field
from typing import Callable, Optional

from .ssd_format import KIND_OBJECT, KIND_TOMBSTONE, Rec, header_for, scan_segment

log = logging.getLogger(__name__)


@dataclass
class Job:
    kind: str                                  # "append" | "tombstone" | "compact" | "fsync"
    items: list = field(default_factory=list)  # append: (key, buffer, checksum); tombstone: keys
    fsync: bool = False
    tag: object = None                         # returned untouched with the result
    result: list = field(default_factory=list) # (key, Rec | None) per item
    error: Optional[str] = None
    seg: int = -1                              # compact: the segment it empties ...
    tombs: list = field(default_factory=list)  # ... and the keys of that segment's tombstones
    seg_sizes: dict = field(default_factory=dict)  # segment -> bytes written so far (after the job)


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
                except OSError as exc:
                    log.warning("ssd writer: fsync of segment %d failed: %s", self.seg, exc)
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
            if job.kind == "compact":   # what the loop must carry on before the file goes
                job.tombs = [key for kind, key, _ in scan_segment(self.path(job.seg), job.seg)
                             if kind == KIND_TOMBSTONE]
        elif job.kind == "tombstone":
            for key in job.items:
                self._append(KIND_TOMBSTONE, key, b"", 0)
        if (job.fsync or job.kind == "fsync") and self.fd is not None and self.dirty:
            os.fsync(self.fd)
            self.dirty = False

    def stop(self) -> None:
        self.jobs.put(None)
        self.join(timeout=10)
