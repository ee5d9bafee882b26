"""What a transport does, and the raw-memory helpers all of them share.

A transport moves object bytes between caller memory (raw addresses, as SGLang's host pool
gives them) and one storage node. The client has already asked the master where each key
lives (get) or where it goes (put); a transport is called once per node per batch.

- ``read(node, keys, ptrs, sizes, deadline) -> list[bool]``: fill ``ptrs[i]`` with the object
  ``keys[i]``; True only when the stored size equals ``sizes[i]`` and the checksum matches.
- ``write(node, keys, ptrs, sizes, deadline) -> list[bool]``: store and commit; True once the
  node has committed the key and sent its report to the master (a key already stored is True
  as well). The transport computes the
  checksums where it is cheapest: on the copy it makes (shm), as each chunk lands on the node
  (tcp's stream port), or over the source (the TE).

Bytes are copied and hashed by ``copy_many`` / ``hash_many``: chunk by chunk, so the hash
reads what the copy just wrote from cache, and split across a small thread pool for batches
of big objects (4 MiB or more, 256 KiB or more per object on average; ``memmove`` and xxh3
release the GIL).

Transport failures (timeouts, error replies) raise; the client turns them into misses.
"""
from __future__ import annotations

import ctypes
import logging
import os
import socket
import threading
import time
from abc import ABC, abstractmethod
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional, Sequence

import xxhash

from .. import protocol as P
from ..errors import HicacheError
from ..protocol import NodeInfo

log = logging.getLogger(__name__)


def buffer_at(ptr: int, size: int) -> memoryview:
    """A writable byte view of ``size`` bytes at raw address ``ptr`` (no copy)."""
    if size == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_ubyte * size).from_address(ptr)).cast("B")


def checksum_at(ptr: int, size: int) -> int:
    """xxh3-64 of raw memory: ~10+ GB/s, far below memcpy cost per byte on the paths here."""
    return xxhash.xxh3_64_intdigest(buffer_at(ptr, size))


def checksum(data) -> int:
    return xxhash.xxh3_64_intdigest(data)


memmove = ctypes.memmove  # a foreign call: releases the GIL while it copies

ROUND_BYTES = 64 << 20      # one lease / reservation covers at most this much
CHUNK = 256 << 10           # copy, then hash from cache, this much at a time
PARALLEL_MIN = 4 << 20       # batches smaller than this are copied on the calling thread
COPY_THREADS = max(1, min(4, os.cpu_count() or 1))   # the calling thread + helpers

_pool: Optional[ThreadPoolExecutor] = None
_pool_lock = threading.Lock()


def _helpers() -> Optional[ThreadPoolExecutor]:
    global _pool
    if COPY_THREADS < 2:
        return None
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(COPY_THREADS - 1, thread_name_prefix="hicache-mc-copy")
        return _pool


def copy_hash(dst: int, src: int, size: int, digest: bool = True) -> Optional[int]:
    """memmove ``size`` bytes from ``src`` to ``dst``; with ``digest``, the xxh3-64 of the copy,
    computed a chunk at a time right after that chunk is copied (same value as one-shot)."""
    if not digest:
        memmove(dst, src, size)
        return None
    if size <= CHUNK:
        memmove(dst, src, size)
        return checksum_at(dst, size)
    h, view = xxhash.xxh3_64(), buffer_at(dst, size)
    for off in range(0, size, CHUNK):
        n = min(CHUNK, size - off)
        memmove(dst + off, src + off, n)
        h.update(view[off: off + n])
    return h.intdigest()


def _split(sizes: Sequence[int], parts: int) -> list[range]:
    """Contiguous index ranges of about equal bytes."""
    total, bounds, acc, want = sum(sizes), [0], 0, 1
    for i, s in enumerate(sizes):
        acc += s
        if acc * parts >= total * want and len(bounds) < parts and i + 1 < len(sizes):
            bounds.append(i + 1)
            want += 1
    bounds.append(len(sizes))
    return [range(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


def run_split(job: Callable[[int], object], sizes: Sequence[int]) -> list:
    """``[job(i) for i in range(len(sizes))]``, the indices shared by bytes between the calling
    thread and the copy pool when the batch is large enough to be worth it."""
    total = sum(sizes)
    # many small objects: per-object Python work would make the threads trade the GIL more
    # than they copy (measured: 128 x 64 KiB ran faster on one thread, 8 x 1 MiB on two)
    pool = _helpers() if total >= PARALLEL_MIN and total >= CHUNK * len(sizes) > CHUNK else None
    if pool is None:
        return [job(i) for i in range(len(sizes))]
    shares = _split(sizes, COPY_THREADS)
    futures = [pool.submit(lambda r=r: [job(i) for i in r]) for r in shares[1:]]
    out = [job(i) for i in shares[0]]
    for f in futures:
        out += f.result()
    return out


def copy_many(dsts: Sequence[int], srcs: Sequence[int], sizes: Sequence[int],
              digest: bool = True) -> list[Optional[int]]:
    """``copy_hash`` over a batch (in parallel when large); the checksums in order."""
    return run_split(lambda i: copy_hash(dsts[i], srcs[i], sizes[i], digest), sizes)


def hash_many(ptrs: Sequence[int], sizes: Sequence[int]) -> list[int]:
    """xxh3-64 of each buffer (in parallel when large)."""
    return run_split(lambda i: checksum_at(ptrs[i], sizes[i]), sizes)


def _ignore_commit(node: NodeInfo, seq: int) -> None:
    pass


class Transport(ABC):
    name = "base"
    # called with each commit reply's node and sequence number (the client fences its
    # lookups with them: read-your-writes; see protocol.py)
    committed: Callable[[NodeInfo, int], None] = staticmethod(_ignore_commit)

    @abstractmethod
    def read(self, node: NodeInfo, keys: list[str], ptrs: list[int], sizes: list[int],
             deadline: float) -> list[bool]:
        """Copy objects into caller memory; see the module docstring."""

    @abstractmethod
    def write(self, node: NodeInfo, keys: list[str], ptrs: list[int], sizes: list[int],
              deadline: float) -> list[bool]:
        """Store objects from caller memory; see the module docstring."""

    def close(self) -> None:
        """Release what the transport holds (mappings, registrations)."""


def groups(sizes: Sequence[int], capacity: int) -> list[list[int]]:
    """Indices in order, grouped so each group's sizes sum to at most ``capacity`` (an item
    bigger than that goes alone)."""
    out, cur, total = [], [], 0
    for i, s in enumerate(sizes):
        if cur and total + s > capacity:
            out.append(cur)
            cur, total = [], 0
        cur.append(i)
        total += s
    if cur:
        out.append(cur)
    return out


class LeasedTransport(Transport):
    """Reads under the node's ``Lease``, writes under ``Reserve`` + ``Commit``; a subclass moves
    the bytes between caller memory and node offsets (``fetch`` / ``store``): shm through a
    mapping, mooncake with the Transfer Engine, tcp through the node's stream port.

    A batch goes in rounds of at most ``ROUND_BYTES``, each under its own lease or reservation,
    so a round ends far inside it. A read that outlives its lease is a miss (the slots may have
    been reused); a write that outlives its reservation is not committed.
    """

    def __init__(self, channel_for, checks: "ChecksumCounter", verify: bool = True):
        self.channel_for = channel_for      # node address -> this thread's channel
        self.checks = checks
        self.verify = verify

    @abstractmethod
    def fetch(self, node: NodeInfo, offsets: list[int], dsts: list[int], sizes: list[int],
              until: float) -> list[Optional[int]]:
        """Copy node ranges into caller memory before ``until``; the checksum of each copy
        (when ``verify``; None otherwise)."""

    @abstractmethod
    def store(self, node: NodeInfo, offsets: list[int], srcs: list[int], sizes: list[int],
              until: float) -> list[int]:
        """Copy caller memory into reserved node ranges before ``until``; their checksums."""

    def read(self, node, keys, ptrs, sizes, deadline):
        out = [False] * len(keys)
        pending = list(range(len(keys)))
        while pending:
            later = []
            try:
                for group in groups([sizes[i] for i in pending], ROUND_BYTES):
                    later += self._read_round(node, [pending[j] for j in group], keys, ptrs,
                                              sizes, deadline, out)
            except HicacheError:
                if len(pending) == len(keys):
                    raise
                break       # a later round failed: what the earlier ones read stands
            if len(later) == len(pending):
                break       # DRAM could stage none of them: misses
            pending = later     # objects DRAM had no room for while the others were leased
        return out

    def _read_round(self, node, idx, keys, ptrs, sizes, deadline, out) -> list[int]:
        """Lease and read objects ``idx``; the ones the node could not stage into DRAM yet."""
        ch, sent = self.channel_for(node.address), time.monotonic()
        reply = P.raise_if_error(ch.recv(ch.send(P.LeaseRequest([keys[i] for i in idx])), deadline))
        if not self.same_segment(node, reply, keys, idx):
            return []
        return self.read_leased(node, idx, keys, ptrs, sizes, reply, sent + reply.ttl, deadline, out)

    def read_leased(self, node, idx, keys, ptrs, sizes, reply, until, deadline, out) -> list[int]:
        """Read objects ``idx`` under the Lease ``reply`` (its entries in ``idx`` order; held
        until ``until`` on this client's clock) into ``out``; the indices answered
        ``LEASE_LATER``. Leases on objects of another size than asked are given back unread."""
        todo, sums, offs, spare, spare_offs, later = [], [], [], [], [], []
        for i, off, have, expected in zip(idx, reply.offsets, reply.sizes, reply.checksums):
            if off == P.LEASE_LATER:
                later.append(i)
            elif off >= 0 and have == sizes[i]:
                todo.append(i)
                offs.append(off)
                sums.append(expected)
            elif off >= 0:
                spare.append(keys[i])
                spare_offs.append(off)
        got = self.fetch(node, offs, [ptrs[i] for i in todo], [sizes[i] for i in todo],
                         min(deadline, until)) if todo else []
        if todo and time.monotonic() > until:
            log.warning("%s read of %d objects outlived its lease; treated as misses",
                        self.name, len(todo))
            damaged = []
        else:
            for i, expected, actual in zip(todo, sums, got):
                out[i] = not self.verify or self.checks.check(keys[i], expected, actual)
            # a copy made under the lease that does not match: the object may be damaged
            damaged = [not out[i] for i in todo] + [False] * len(spare)
        # done with the slots: the node may reuse them now (one Release). A failed fetch
        # releases nothing: a transfer it abandoned may still be running.
        self.cancel(node, [keys[i] for i in todo] + spare, offs + spare_offs, damaged, deadline)
        return later

    def write(self, node, keys, ptrs, sizes, deadline):
        out = [False] * len(keys)
        for idx in groups(sizes, ROUND_BYTES):
            self._write_round(node, idx, keys, ptrs, sizes, deadline, out)
        return out

    def _write_round(self, node, idx, keys, ptrs, sizes, deadline, out) -> None:
        ch, sent = self.channel_for(node.address), time.monotonic()
        reply = P.raise_if_error(ch.recv(ch.send(P.ReserveRequest([keys[i] for i in idx],
                                                                  [sizes[i] for i in idx])), deadline))
        if not self.same_segment(node, reply, keys, idx):
            return          # not stored
        self.fill(node, idx, keys, ptrs, sizes, reply.offsets, sent + reply.ttl, deadline, out)

    def same_segment(self, node, reply, keys: list[str], idx: Optional[list[int]] = None) -> bool:
        """Whether a Lease or Reserve reply's offsets (for ``keys[i] for i in idx``, all keys
        when ``idx`` is None) are in the segment ``node`` (the record this client holds)
        describes. When not, the node restarted at the same address since the record was
        made: its leases or slots are given back, and the caller treats the keys as misses /
        not stored until a fresh record comes with a master reply."""
        if reply.segment == P.segment_of(node):
            return True
        asked = keys if idx is None else [keys[i] for i in idx]
        held = [j for j, off in enumerate(reply.offsets) if off >= 0]
        self.cancel(node, [asked[j] for j in held], [reply.offsets[j] for j in held])
        log.info("node %s restarted (segment %s, this client knew %s): %d keys wait for its new "
                 "record", node.node_id, reply.segment, P.segment_of(node), len(asked))
        return False

    def fill(self, node, idx, keys, ptrs, sizes, offsets, until: float, deadline: float, out) -> None:
        """Objects ``idx`` were reserved at ``offsets`` (valid until ``until``): move their
        bytes in, then commit; ``out[i]`` is True for each stored (or stored already)."""
        todo, offs = [], []
        for i, off in zip(idx, offsets):
            if off == P.RESERVE_STORED:
                out[i] = True           # stored already
            elif off >= 0:
                todo.append(i)
                offs.append(off)
        if todo:
            sums = self.store_slots(node, todo, keys, ptrs, sizes, offs, min(deadline, until))
            self.commit(node, todo, keys, sums, offs, until, deadline, out)

    def store_slots(self, node, idx, keys, ptrs, sizes, offsets, until: float) -> list[int]:
        """``store`` objects ``idx`` into their reserved ``offsets``; on a failure the slots
        are given back (left reserved, the keys would answer "busy" to every writer until the
        reservation lapses) and the error raised."""
        try:
            return self.store(node, offsets, [ptrs[i] for i in idx], [sizes[i] for i in idx], until)
        except Exception:
            self.cancel(node, [keys[i] for i in idx], offsets)
            raise

    def commit(self, node, idx, keys, sums, offsets, until: float, deadline: float, out) -> None:
        """Commit objects ``idx``, stored with checksums ``sums`` into the slots at ``offsets``
        reserved until ``until``; ``out[i]`` is True for each the node now has."""
        if time.monotonic() > until:
            log.warning("%s write outlived its reservation; not committing %d objects",
                        self.name, len(idx))
            return
        ch = self.channel_for(node.address)
        reply = P.raise_if_error(ch.recv(ch.send(P.CommitRequest([keys[i] for i in idx], sums, offsets)),
                                         deadline))
        self.committed(node, reply.seq)
        for i, ok in zip(idx, reply.ok):
            out[i] = ok

    def cancel(self, node, keys: list[str], offsets: list[int], damaged: Sequence[bool] = (),
               deadline: float = 0.0) -> None:
        """Give back reserved slots that will not be written, or leases that will not be
        read (the reply is not awaited), or leases that were read: ``damaged`` says of each
        whether its copy failed its checksum. Then the node checks those objects, drops the
        ones that are damaged and tells the master before it answers (awaited until
        ``deadline``): once a read has missed on a damaged object, a put stores it again."""
        if keys:
            ch = self.channel_for(node.address)
            try:
                if any(damaged):
                    ch.recv(ch.send(P.ReleaseRequest(keys, offsets, list(damaged))), deadline)
                else:
                    ch.forget([ch.send(P.ReleaseRequest(keys, offsets))])
            except HicacheError as exc:     # unreleased leases and slots lapse on the node
                log.debug("release on %s failed: %s", node.node_id, exc)


class ChecksumCounter:
    """Counts and logs checksum mismatches (a mismatch is a miss, never a wrong page)."""

    def __init__(self):
        self.failures = 0

    def check(self, key: str, expected: int, actual: int) -> bool:
        if expected == actual:
            return True
        self.failures += 1
        log.warning("checksum mismatch on %s: treated as a miss", key)
        return False


def recv_hash(sock: socket.socket, view: memoryview, digest: bool = True,
               deadline: Optional[float] = None, stall: Optional[float] = None) -> Optional[int]:
    """Fill ``view`` from the socket, all of it by ``deadline`` or each CHUNK within ``stall``
    seconds when given; with ``digest``, the xxh3-64 of what arrived, each chunk hashed as it
    lands (from cache)."""
    h, got, n, mark = xxhash.xxh3_64() if digest else None, 0, len(view), 0
    while got < n:
        if stall is not None and got >= mark:
            deadline, mark = time.monotonic() + stall, got + CHUNK
        if deadline is not None:
            sock.settimeout(max(0.001, deadline - time.monotonic()))
        k = sock.recv_into(view[got:], min(CHUNK, n - got))
        if k == 0:
            raise ConnectionError("connection closed by the peer")
        if h is not None:
            h.update(view[got: got + k])
        got += k
    return h.intdigest() if h is not None else None


def recv_bytes(sock: socket.socket, n: int, deadline: Optional[float] = None) -> bytes:
    buf = bytearray(n)
    recv_hash(sock, memoryview(buf), digest=False, deadline=deadline)
    return bytes(buf)
