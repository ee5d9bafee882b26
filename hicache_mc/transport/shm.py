"""ShmTransport: same-host clients map the node's DRAM segment and copy directly.

get: ``Lease`` returns offsets valid until a deadline; the client copies out of its own
mapping and verifies the checksum on the copy (a slot rewritten mid-copy cannot pass).
put: ``Reserve`` returns slots, the client copies in, hashing what it wrote, then ``Commit``
(with those checksums) makes the keys visible once the master has them. The node never
touches the bytes. Copies go through ``copy_many``: chunked copy-then-hash, several threads
for large batches; the client runs the rounds (``client/rounds.py``).
"""
from __future__ import annotations

import ctypes
import logging
import mmap
import os
import socket
import threading
import time
from contextlib import contextmanager
from typing import Optional

from .. import protocol as P
from ..errors import StoreUnavailable
from .base import Transport, copy_many

log = logging.getLogger(__name__)

SWEEP_S = 1.0   # how often mapped segments are checked for a deleted file
MAGIC = b"HICACHEMC-SEG-1\0"   # first bytes of every segment, then the segment id


def host_identity() -> str:
    """The kernel's boot id (a random UUID per boot): equal for the processes of one machine,
    containers included, whatever their hostnames; they may share shared memory if their
    mounts let them (a client that cannot open a node's segment file uses tcp). The hostname
    where the kernel has no boot id."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return "boot-" + f.read().strip()
    except OSError:
        return "host-" + socket.gethostname()


class Segment:
    """One node's segment mapped into this process."""

    def __init__(self, path: str, populate: bool = False):
        fd = os.open(path, os.O_RDWR)
        try:
            flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
            self.mm = mmap.mmap(fd, os.fstat(fd).st_size, flags=flags)
        finally:
            os.close(fd)
        seg_id = os.path.basename(path).rsplit("-", 1)[-1].encode()
        if self.mm[: len(MAGIC) + len(seg_id)] != MAGIC + seg_id:
            self.mm.close()
            raise OSError(f"{path} is not the segment it claims to be")
        self._anchor = ctypes.c_char.from_buffer(self.mm)
        self.base = ctypes.addressof(self._anchor)
        self.size = len(self.mm)
        self.path = path
        self.users = 0          # reads/writes copying through this mapping right now
        self.retired = False    # unmap when the last user is done

    def close(self) -> None:
        del self._anchor
        try:
            self.mm.close()
        except BufferError:
            pass


class ShmTransport(Transport):
    name = "shm"

    def __init__(self, verify: bool = True):
        super().__init__(verify)
        self._segments: dict[str, Optional[Segment]] = {}
        self._lock = threading.Lock()
        self._next_sweep = 0.0

    def segment(self, node: P.NodeInfo) -> Optional[Segment]:
        """The node's mapped segment, or None when it cannot be mapped from here."""
        with self._lock:
            return self._segment_locked(node)

    def _segment_locked(self, node: P.NodeInfo) -> Optional[Segment]:
        """The segment (mapping it, sweeping dead ones); the caller holds ``_lock``."""
        now = time.monotonic()
        if node.shm_path not in self._segments or now >= self._next_sweep:
            self._next_sweep = now + SWEEP_S   # a new segment often means an old one died
            self._sweep()
        if node.shm_path not in self._segments:   # (again: the sweep may have dropped it)
            try:
                self._segments[node.shm_path] = Segment(node.shm_path, node.prefault)
            except (OSError, ValueError) as exc:
                log.info("node %s: segment not mappable (%s); using tcp", node.node_id, exc)
                self._segments[node.shm_path] = None
        return self._segments[node.shm_path]

    def _sweep(self) -> None:
        """Unmap segments whose file is gone (a node restarted or stopped): the memory of a
        deleted /dev/shm file stays allocated while anyone maps it."""
        for path, seg in list(self._segments.items()):
            if not os.path.exists(path):
                del self._segments[path]
                if seg is not None:
                    self._retire(seg)

    def _retire(self, seg: Segment) -> None:
        seg.retired = True
        if seg.users == 0:
            seg.close()

    @contextmanager
    def _using(self, node: P.NodeInfo):
        """The node's segment, kept mapped until the copy through it is done."""
        with self._lock:   # look up and pin in one step: a sweep must not unmap it in between
            seg = self._segment_locked(node)
            if seg is None:
                raise StoreUnavailable(f"node {node.node_id}: segment not mappable")
            seg.users += 1
        try:
            yield seg
        finally:
            with self._lock:
                seg.users -= 1
                if seg.retired and seg.users == 0:
                    seg.close()

    def fetch(self, node, offsets, dsts, sizes, until):
        with self._using(node) as seg:
            return copy_many(dsts, self._at(seg, offsets, sizes), sizes, self.verify)

    def store(self, node, offsets, srcs, sizes, until):
        with self._using(node) as seg:    # checksums of the stored copies, taken as they are written
            return copy_many(self._at(seg, offsets, sizes), srcs, sizes)

    @staticmethod
    def _at(seg: Segment, offsets: list[int], sizes: list[int]) -> list[int]:
        for off, size in zip(offsets, sizes):
            if off + size > seg.size:
                raise StoreUnavailable(f"node offset {off}+{size} is past its segment ({seg.size} bytes)")
        return [seg.base + off for off in offsets]

    def close(self) -> None:
        with self._lock:
            for seg in self._segments.values():
                if seg is not None:
                    self._retire(seg)
            self._segments.clear()
