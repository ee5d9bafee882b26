"""What a transport does, and the raw-memory helpers all of them share.

A transport moves object bytes between caller memory (raw addresses, as SGLang's host pool
gives them) and ranges of one storage node's DRAM segment, and does nothing else: the client
runs the Lease / Reserve / Commit / Release rounds around it (``client/rounds.py``).

- ``fetch(node, offsets, dsts, sizes, until) -> checksums``: copy each node range into caller
  memory before ``until``; the xxh3-64 of each copy (None when not verifying).
- ``store(node, offsets, srcs, sizes, until) -> checksums``: copy caller memory into reserved
  node ranges; their checksums, taken where it is cheapest: on the copy it makes (shm), as each
  chunk lands on the node (tcp's stream port), or over the source (the TE).

Bytes are copied and hashed by ``copy_many`` / ``hash_many``: chunk by chunk, so the hash
reads what the copy just wrote from cache, and split across a small thread pool for batches
of big objects (4 MiB or more, 256 KiB or more per object on average; ``memmove`` and xxh3
release the GIL).

Transport failures (timeouts, refusals) raise; the client turns them into misses.
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


class Transport(ABC):
    """Moves bytes between caller memory and node ranges; see the module docstring."""
    name = "base"

    def __init__(self, verify: bool = True):
        self.verify = verify        # fetch hashes what it copies

    @abstractmethod
    def fetch(self, node: NodeInfo, offsets: list[int], dsts: list[int], sizes: list[int],
              until: float) -> list[Optional[int]]:
        """Copy node ranges into caller memory before ``until``; the checksum of each copy
        (when ``verify``; None otherwise)."""

    @abstractmethod
    def store(self, node: NodeInfo, offsets: list[int], srcs: list[int], sizes: list[int],
              until: float) -> list[int]:
        """Copy caller memory into reserved node ranges before ``until``; their checksums."""

    def close(self) -> None:
        """Release what the transport holds (mappings, registrations, connections)."""


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


class GrantEnded(ConnectionError):
    """The lease or reservation a transfer moves bytes under ended mid-way: the transfer is cut."""


def recv_hash(sock: socket.socket, view: memoryview, digest: bool = True,
              deadline: Optional[float] = None, stall: Optional[float] = None,
              live: Optional[Callable[[], bool]] = None) -> Optional[int]:
    """Fill ``view`` from the socket, all of it by ``deadline`` or each CHUNK within ``stall``
    seconds when given; with ``digest``, the xxh3-64 of what arrived, each chunk hashed as it
    lands (from cache). ``live`` is asked before each CHUNK: GrantEnded when it says no."""
    h, got, n, mark = xxhash.xxh3_64() if digest else None, 0, len(view), 0
    while got < n:
        if got >= mark:
            if live is not None and not live():
                raise GrantEnded("the reservation ended mid-transfer")
            if stall is not None:
                deadline = time.monotonic() + stall
            mark = got + CHUNK
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
