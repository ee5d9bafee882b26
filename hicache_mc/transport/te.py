"""MooncakeTransport: node DRAM read and written one-sided through Mooncake's Transfer Engine.

The client side, over one ``SharedEngine`` per process (``mooncake.py``). get: ``Lease``
(offsets valid for a ttl, exactly as for shm), one batched TE read from ``te_base + offset``
into the destinations, checksum on the destination. put: ``Reserve``, one batched TE write into
the reserved slots, ``Commit``. The node never touches the bytes.

Registered memory: a TE transfer needs its local memory registered (RDMA enforces it; TCP does
not). ``register_buffer(ptr, size)`` registers caller memory once (the SGLang host pool,
benchmark buffers); an object whose caller memory lies inside a registered region moves
straight to or from it. Other caller memory is bounced through a registered staging buffer of
``te_staging`` bytes (one memmove); an object larger than that, through a buffer of its own
size, registered for its one transfer. Caller memory is never registered on the fly: a cached
registration of memory that the caller frees and reallocates would keep the old pages pinned,
and RDMA would then move stale physical pages; and a transfer abandoned at its deadline may
still write into local memory after the caller has freed it (a flat page SGLang drops once the
call returns), where only a buffer the transport owns until the engine is done is safe.

Bounded calls: the TE's sync calls spin until done or ``MC_TRANSFER_TIMEOUT`` (default 30 s,
minimum 5) plus 1 s per GiB, and the first call to a node opens its segment, which waits for
TCP's connect timeout on an unreachable host. So the first transfer to a node runs the sync call
on a worker thread (the binding releases the GIL) and the caller waits only until the call's
deadline; later transfers submit one async TE batch per object and poll them every ``POLL_S``
until done or the deadline. An overrun is a failure (misses). A transfer that outlives the wait
may still finish later: a worker thread waits it out before its staging buffer is freed (never
reused meanwhile); registered caller memory of those keys may still receive bytes (a known
limit, kept short by building the client's TE with ``MC_TRANSFER_TIMEOUT = max(5, timeout_s)``
unless the user set it). ``counters["late_released"]`` counts staging buffers freed only once
an abandoned transfer finished.

Leases, reservations, rounds and verification are the client's (client/rounds.py), shared
with shm and tcp; this module only moves the bytes.
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Callable, Optional

from .. import protocol as P
from ..errors import HicacheError
from .base import Transport, groups, hash_many, memmove
from .mooncake import (MooncakeUnavailable, SharedEngine, Staging, TransferEngineError,
                       resolve_device, route_address)

log = logging.getLogger(__name__)

# Sleep between status polls of a transfer. The TE's sync calls spin a core while they wait.
# Through StoreClient on the 2-core development machine (loopback TCP, load average ~15 from
# other work), polling every 100 us beat the spinning call in all 8 put/get cases of
# 64 KiB x 128 ... 4 MiB x 32 objects (1.08-1.41x, medians of 8), and it leaves a GPU host's
# cores to SGLang: each of its I/O threads would otherwise spin one while its transfer runs.
POLL_S = 1e-4
REAP_LIMIT_S = 300.0  # an abandoned transfer still running after this is left (and its memory leaked)
_NO_BATCH = (0, -1, (1 << 64) - 1)   # batch_transfer_async_* failed: 0, or -1 as uint64


class MooncakeTransport(Transport):
    name = "mooncake"

    def __init__(self, verify: bool = True, *, master: str = "",
                 protocol: str = "", device: str = "", metadata: str = "P2PHANDSHAKE",
                 hostname: str = "", staging_bytes: int = 64 << 20, timeout_s: float = 5.0):
        super().__init__(verify)
        self.master, self.protocol, self.device = master, protocol, device
        self.metadata, self.hostname = metadata, hostname
        self.staging_bytes, self.timeout_s = staging_bytes, timeout_s
        self.engine: Optional[SharedEngine] = None
        self.broken: Optional[str] = None   # why the TE cannot be used (logged once)
        self._regions: dict[int, int] = {}  # this client's registrations: start -> size
        self._region_list: tuple = ()       # snapshot of _regions for lock-free lookups
        self._staging: Optional[Staging] = None
        self._staging_lock = threading.Lock()
        self._lock = threading.Lock()
        # objects moved straight to/from registered memory, through staging, or through a
        # staging buffer of their own; staging buffers freed after an abandoned transfer ended
        self.counters = {"direct": 0, "staged": 0, "one_off": 0, "late_released": 0}

    # -------------------------------------------------------------- engine and registration

    def usable(self, node: P.NodeInfo) -> bool:
        """Whether this node can be reached through the TE (creating the TE if needed)."""
        if not node.te_address:
            return False
        try:
            self._ensure_engine(node.te_protocol)
            return True
        except HicacheError as exc:
            self._give_up(exc)
            return False

    def _give_up(self, exc: Exception) -> None:
        """No TE in this client from now on; one log line says why."""
        with self._lock:
            if self.broken is None:
                self.broken = str(exc)
                log.warning("mooncake transport unavailable, using tcp: %s", exc)

    def _ensure_engine(self, node_protocol: str = "") -> SharedEngine:
        if self.engine is not None:
            return self.engine
        with self._lock:
            if self.broken is not None:
                raise MooncakeUnavailable(self.broken)
            if self.engine is None:
                engine = SharedEngine.get(self.hostname or route_address(self.master), self.metadata,
                                          self.protocol or node_protocol or "tcp",
                                          resolve_device(self.device), self.timeout_s)
                for ptr, size in list(self._regions.items()):
                    try:
                        engine.register(ptr, size)
                    except TransferEngineError as exc:   # that memory goes through staging
                        log.warning("%s; transfers to it are staged", exc)
                        del self._regions[ptr]
                self._region_list = tuple(self._regions.items())
                self.engine = engine
        return self.engine

    def register_buffer(self, ptr: int, size: int, eager: bool = False) -> None:
        """Register caller memory for direct transfers; ``eager`` creates the TE now (else it
        is registered when the TE is first needed)."""
        if size <= 0:
            raise ValueError(f"register_buffer: size must be > 0, got {size}")
        with self._lock:
            if ptr in self._regions:
                return
            if self.engine is not None:
                self.engine.register(ptr, size)
            self._regions[ptr] = size
            self._region_list = tuple(self._regions.items())
        if eager and self.engine is None:
            try:
                self._ensure_engine()
            except HicacheError as exc:
                self._give_up(exc)

    def unregister_buffer(self, ptr: int) -> None:
        with self._lock:
            if self._regions.pop(ptr, None) is not None and self.engine is not None:
                self.engine.unregister(ptr)
            self._region_list = tuple(self._regions.items())

    # -------------------------------------------------------------- bounded TE calls

    def _transfer(self, node: P.NodeInfo, read: bool, local: list[int], remote: list[int],
                  sizes: list[int], deadline: float, after: Optional[Callable[[], None]] = None,
                  abandoned: Optional[Callable[[], None]] = None) -> None:
        """Move ``sizes[i]`` bytes between ``local[i]`` and the node's ``remote[i]``; raises
        TransferEngineError on failure or at ``deadline``. ``after`` runs once the TE is done
        with the memory; ``abandoned`` too, but only when the caller stopped waiting first."""
        engine = self._ensure_engine(node.te_protocol)
        if time.monotonic() >= deadline:
            raise TransferEngineError("TE transfer: no time left before the deadline")
        if node.te_address in engine.opened:
            ok = self._polled(engine, node, read, local, remote, sizes, deadline, after, abandoned)
        else:   # first contact opens the segment, and connect() may block: on a worker thread
            ok = self._in_thread(engine, node, read, local, remote, sizes, deadline, after, abandoned)
        if ok:
            engine.opened.add(node.te_address)
        else:   # next time through the sync call again: on failure it drops a stale segment
            engine.opened.discard(node.te_address)
            raise TransferEngineError(f"TE {'read' if read else 'write'} of {len(sizes)} objects "
                                      f"with {node.te_address} failed")

    @staticmethod
    def _in_thread(engine, node, read, local, remote, sizes, deadline, after, abandoned) -> bool:
        fn = engine.te.batch_transfer_sync_read if read else engine.te.batch_transfer_sync_write
        fut = engine.pool.submit(fn, node.te_address, local, remote, sizes)
        try:
            rc = fut.result(timeout=max(0.0, deadline - time.monotonic()))
        except FutureTimeout:
            for fn_ in (after, abandoned):
                if fn_ is not None:
                    fut.add_done_callback(lambda _f, fn_=fn_: fn_())
            raise TransferEngineError(f"TE transfer with {node.te_address} did not finish in time",
                                      abandoned=True) from None
        if after is not None:
            after()
        return rc == 0

    @staticmethod
    def _polled(engine, node, read, local, remote, sizes, deadline, after, abandoned) -> bool:
        """One async TE batch per object (the binding can poll only a batch's first task
        without blocking), polled every POLL_S until all are done or the deadline."""
        submit = engine.te.batch_transfer_async_read if read else engine.te.batch_transfer_async_write
        pending, ok = [], True
        for args in zip(local, remote, sizes):
            bid = submit(node.te_address, *([a] for a in args))
            if bid in _NO_BATCH:
                ok = False                      # stop submitting; wait for what is in flight
                break
            pending.append(bid)
        i = 0
        while i < len(pending):          # they finish about in order: wait on the oldest
            state = engine.te.transfer_check_status(pending[i])  # 1 done, 0 running, <0 failed
            if state != 0:
                ok = ok and state > 0
                i += 1
            elif time.monotonic() >= deadline:
                engine.pool.submit(_reap, engine.te, pending[i:], [after, abandoned])
                raise TransferEngineError(f"TE transfer with {node.te_address} did not finish in "
                                          f"time", abandoned=True)
            else:
                time.sleep(POLL_S)
        if after is not None:
            after()
        return ok

    def _move(self, node, read: bool, items: list[tuple[int, int, int]], deadline: float) -> None:
        """Transfer ``items`` = (caller ptr, node offset, size): registered caller memory
        directly; other memory through the staging buffer, or, when bigger than it, through a
        staging buffer of its own."""
        items = [it for it in items if it[2] > 0]
        regions = self._region_list
        direct = [it for it in items if _inside(regions, it[0], it[2])]
        if direct:
            self._transfer(node, read, [p for p, _, _ in direct], [node.te_base + o for _, o, _ in direct],
                           [s for _, _, s in direct], deadline)
            self.counters["direct"] += len(direct)
        bounced = [it for it in items if not _inside(regions, it[0], it[2])]
        for item in [it for it in bounced if it[2] > self.staging_bytes]:
            stage = Staging(self._ensure_engine(node.te_protocol), item[2])
            try:
                self._staged(node, read, [item], deadline, stage)
            finally:
                if not stage.held:
                    stage.close()
            self.counters["one_off"] += 1
        small = [it for it in bounced if it[2] <= self.staging_bytes]
        if small:
            with self._staging_lock:
                for idx in groups([it[2] for it in small], self.staging_bytes):
                    stage = self._staging or Staging(self._ensure_engine(), self.staging_bytes)
                    self._staging = stage
                    try:
                        self._staged(node, read, [small[i] for i in idx], deadline, stage)
                    finally:
                        if stage.held:      # the TE may still be using it: never reuse it
                            self._staging = None
                    self.counters["staged"] += len(idx)

    def _staged(self, node, read: bool, chunk: list[tuple[int, int, int]], deadline: float,
                stage: Staging) -> None:
        """One load of ``stage``: copy in (write), transfer, copy out (read). A transfer
        abandoned at the deadline leaves ``stage.held``: the engine frees it once done."""
        at = [stage.base + sum(s for _, _, s in chunk[:i]) for i in range(len(chunk))]
        if not read:
            for (ptr, _, size), a in zip(chunk, at):
                memmove(a, ptr, size)
        try:
            self._transfer(node, read, at, [node.te_base + o for _, o, _ in chunk],
                           [s for _, _, s in chunk], deadline,
                           abandoned=lambda: self._release_late(stage))
        except TransferEngineError as exc:
            stage.held = exc.abandoned
            raise
        if read:
            for (ptr, _, size), a in zip(chunk, at):
                memmove(ptr, a, size)

    def _release_late(self, stage: Staging) -> None:
        """The engine is done with a staging buffer whose transfer was abandoned."""
        stage.close()
        self.counters["late_released"] += 1

    # -------------------------------------------------------------- Transport

    def fetch(self, node, offsets, dsts, sizes, until):
        self._move(node, True, list(zip(dsts, offsets, sizes)), until)
        return hash_many(dsts, sizes) if self.verify else [None] * len(sizes)

    def store(self, node, offsets, srcs, sizes, until):
        sums = hash_many(srcs, sizes)
        self._move(node, False, list(zip(srcs, offsets, sizes)), until)
        return sums

    def close(self) -> None:
        """Unregister this client's memory; the shared TE stays (see SharedEngine)."""
        with self._lock:
            engine, self.engine = self.engine, None
            if engine is None:
                return
            for ptr in self._regions:
                engine.unregister(ptr)
        with self._staging_lock:
            if self._staging is not None:
                self._staging.close()
                self._staging = None


def _reap(te, pending: list[int], callbacks: list) -> None:
    """Wait (on a worker thread) for transfers the caller abandoned, then release their memory."""
    end = time.monotonic() + REAP_LIMIT_S
    while pending and time.monotonic() < end:
        pending = [b for b in pending if te.transfer_check_status(b) == 0]
        time.sleep(0.01)
    if pending:
        log.error("%d abandoned TE transfers still running after %.0f s; their memory is leaked",
                  len(pending), REAP_LIMIT_S)
        return
    for fn in callbacks:
        if fn is not None:
            fn()


def _inside(regions: tuple, ptr: int, size: int) -> bool:
    return any(start <= ptr and ptr + size <= start + n for start, n in regions)
