"""StorageNode: the data plane (ROUTER) plus its link to the master, in one loop.

Requests from clients (Lease, Release, Reserve, Commit, Clear) are answered from the storage
core (``store.py``); what the master must hear of goes through ``master_link.py``, before the
writer is answered (see there for the report order and the fences it gives writers). The
stream port's threads move only the bytes of ranges the loop granted (``transport/grants.py``);
the SSD writer thread wakes the loop through a pipe.
"""
from __future__ import annotations

import contextlib
import logging
import os
import time
import uuid
from typing import NamedTuple

from .. import protocol as P
from ..config import NodeConfig
from ..rpc import Service
from ..transport.shm import host_identity
from ..transport.grants import Grants
from ..transport.stream import StreamServer
from .dram import HEADER_BYTES, DramTier
from .master_link import MasterLink, Waiter
from .metrics import node_families
from .naming import advertised_host, node_name
from .ssd import SsdTier
from .pending import PendingWrite
from .segment_file import PREFIX, remove_unowned
from .store import NODE_OBJECT_BYTES, Leased, Reserved, TieredStore
from .wire import lease_reply, reserve_reply

log = logging.getLogger(__name__)


class Held(NamedTuple):
    """A reply held until the tombstones of the SSD records its request removed are written
    (``TieredStore.bury``): then ``keys`` are reported to the master, and the reply goes once
    it acknowledges them (``failed`` when it does not)."""
    ident: bytes
    req_id: int
    reply: P.Message
    failed: P.Message
    keys: list[str]
    cleared: bool = False       # removed by a clear, not evicted (the master counts them apart)


class StorageNode(Service):
    roles = {"NodeStatsRequest": ("admin",)}

    def __init__(self, config: NodeConfig):
        super().__init__(f"tcp://{config.host}:{config.port}", config.token, "node")
        self.config = config
        self.node_id, self._name_lock = node_name(config, int(self.address.rsplit(":", 1)[1]))
        remove_unowned(config.shm_dir)
        seg_id = uuid.uuid4().hex[:8]
        path = os.path.join(config.shm_dir, f"{PREFIX}{os.getpid()}-{seg_id}")
        # what each peer may move through the stream port, and the transfers moving it now
        self.grants = Grants()
        self.segment_id, self.dram, self.store = seg_id, None, None
        try:        # (a start that fails, or is interrupted, leaves no segment file)
            self.dram = DramTier(path, config.dram, seg_id, config.lease_s, config.high_watermark,
                                 config.low_watermark, config.prefault, transfers=self.grants,
                                 object_bytes=NODE_OBJECT_BYTES)
            self._start(config, path)
        except BaseException:
            if self.store is not None:
                self.store.close()          # its SSD tier's writer and lock too
            elif self.dram is not None:
                self.dram.close()
            raise
        self.enable_metrics(config.metrics_host, config.metrics_port)
        self.counters = {"reads": 0, "read_hits": 0, "writes": 0, "bytes_in": 0}

    def _start(self, config: NodeConfig, path: str) -> None:
        """The rest of the node around its DRAM tier: the SSD tier, the ports, the master link."""
        ssd = None
        if config.ssd > 0:
            self._wake_r, self._wake_w = os.pipe()
            os.set_blocking(self._wake_r, False)
            ssd = SsdTier(config.ssd_dir or os.path.join(config.data_dir, "ssd"), config.ssd,
                          config.ssd_segment, config.ssd_high_watermark, config.ssd_low_watermark,
                          wake=self._wake)
            self.add_socket(self._wake_r, self._on_ssd_done)
        self.store = TieredStore(self.dram, ssd, config.durability, config.ssd_fsync_interval_s)
        host = advertised_host(config)      # the host part of every address the node publishes
        self.te = self._transfer_engine(config, self.dram, host)
        try:
            self.streams = StreamServer(self.dram.mm, config.host, config.data_port, HEADER_BYTES,
                                        self.segment_id, self.guard.stream_key, self.grants)
        except OSError:
            if self.te is not None:
                self.te.close()
            raise
        port = self.address.rsplit(":", 1)[1]
        self.info = P.NodeInfo(self.node_id, f"tcp://{host}:{port}", host_identity(), path,
                               config.dram,
                               config.prefault, te_address=self.te.address if self.te else "",
                               te_base=self.te.base if self.te else 0,
                               te_protocol=config.te_protocol,
                               data_address=f"{host}:{self.streams.address.rsplit(':', 1)[1]}")
        self.master = MasterLink(self.ctx, config, self.info, self.reply)
        self._held: dict[int, Held] = {}     # bury ticket -> the reply waiting for it
        self.add_socket(self.master.events, self.master.check)   # why it cannot reach the master
        self.add_socket(self.master.sock, self._on_master)

    @staticmethod
    def _transfer_engine(config: NodeConfig, dram: DramTier, host: str):
        """With ``te_protocol`` set: a Mooncake TE serving the whole DRAM segment to remote
        clients (one-sided reads and writes under the same leases and reservations as shm).
        A TE that cannot start fails the node: an explicit setting is never silently dropped."""
        if not config.te_protocol:
            return None
        from ..transport.mooncake import NodeEngine
        return NodeEngine(dram.mm, host, config.te_protocol, config.te_device, config.te_metadata)

    # -------------------------------------------------------------- ssd writer

    def _wake(self) -> None:
        """Called on the SSD writer thread when a job is done."""
        # a full pipe already holds wake-ups the loop has not read (the pipe is closed only
        # after the writer stopped)
        with contextlib.suppress(BlockingIOError):
            os.write(self._wake_w, b"\0")

    def _on_ssd_done(self) -> None:
        with contextlib.suppress(BlockingIOError):     # an earlier turn read its wake-ups
            os.read(self._wake_r, 4096)
        now = time.monotonic()
        done = self.store.poll_done(now)
        for pw, ok in done.writes:
            failed = [k for k, good in zip(pw.keys, ok) if not good]
            if failed:   # not on disk as the policy promised: neither acknowledged nor kept
                self.store.remove(failed, now)
                pw.drop(set(failed))
            self._report(pw)
        for ticket in done.buried:
            held = self._held.pop(ticket, None)
            if held is not None:
                self._answer(held)
        self.store.bury()

    def _hold(self, ident: bytes, req_id: int, reply: P.Message, failed: P.Message,
              removed: list[str], cleared: bool = False) -> None:
        """Answer a request that removed ``removed`` (reported to the master first): once the
        tombstones of the SSD records it removed are written, at once when there are none."""
        held = Held(ident, req_id, reply, failed, removed, cleared)
        ticket = self.store.bury()
        if ticket is not None:
            self._held[ticket] = held
        else:
            self._answer(held)

    def _answer(self, held: Held) -> None:
        if held.keys and self.master.evicted(held.keys, Waiter(*held[:4]), held.cleared):
            return      # answered once the master acknowledges
        # (not registered: the inventory it registers with leaves the keys out)
        self.reply(held.ident, held.req_id, held.reply)

    # -------------------------------------------------------------- master

    def _on_master(self) -> None:
        quotas = self.master.on_readable()
        if quotas is not None:
            self.store.set_quotas(quotas)

    def tick(self, now: float) -> None:
        self.master.tick(now, self.store.inventory, self.stats)
        self.store.maintain(now)
        self.store.bury()
        self.grants.purge(now)
        dropped = self.store.drain_dropped()
        if dropped:
            self.master.evicted(dropped)

    def stats(self) -> dict:
        return {**self.store.stats(), **self.counters, **self.streams.counters,
                **({"metrics_url": self.metrics_url} if self.metrics_url else {})}

    # -------------------------------------------------------------- data plane

    def on_LeaseRequest(self, msg: P.LeaseRequest, ident, req_id):
        self.check_tenant(msg.keys)
        now = time.monotonic()
        until = now + self.config.lease_s
        leases = self.store.lease_many(msg.keys, now)
        hits = 0
        for lease in leases:
            if lease.outcome is Leased.OBJECT:
                self.grants.grant(self.peer, lease.offset, lease.size, False, until)
                hits += 1
        self.counters["reads"] += len(msg.keys)
        self.counters["read_hits"] += hits
        # the reader must be done a little before the slot could be reused
        return lease_reply(leases, self.config.lease_s * 0.8, self.segment_id)

    def on_ReleaseRequest(self, msg: P.ReleaseRequest, ident, req_id):
        if len(msg.keys) != len(msg.offsets) or len(msg.damaged) not in (0, len(msg.keys)):
            return P.ErrorReply("bad_request", "Release: keys, offsets and damaged differ in length")
        held = []
        for key, offset in zip(msg.keys, msg.offsets):
            held.append(self.grants.revoke(self.peer, offset))  # only what was leased (reserved) to it
            if held[-1]:
                self.store.release(key, offset)
        bad = [i for i, d in enumerate(msg.damaged) if d and held[i]]
        gone = self.store.drop_damaged([msg.keys[i] for i in bad], [msg.offsets[i] for i in bad],
                                       time.monotonic()) if bad else []
        failed = P.ErrorReply("master_unavailable", "dropped damaged objects; the master did not confirm")
        return self._hold(ident, req_id, P.OkReply(), failed, gone)

    def on_ReserveRequest(self, msg: P.ReserveRequest, ident, req_id):
        if len(msg.keys) != len(msg.sizes):
            return P.ErrorReply("bad_request", "Reserve: keys and sizes differ in length")
        self.check_tenant(msg.keys)
        now = time.monotonic()
        self.store.next_request()
        slots = self.store.reserve_many(msg.keys, msg.sizes, now, self.config.reserve_s,
                                        self.config.max_value)
        until = now + self.config.reserve_s
        for slot, size in zip(slots, msg.sizes):
            if slot.outcome is Reserved.SLOT:
                self.grants.grant(self.peer, slot.offset, size, True, until)
        reply = reserve_reply(slots, self.config.reserve_s * 0.8, self.segment_id)
        # the quota may have evicted SSD records: answered once they are buried for good
        return self._hold(ident, req_id, reply, reply, [])

    def on_CommitRequest(self, msg: P.CommitRequest, ident, req_id):
        if not len(msg.keys) == len(msg.checksums) == len(msg.offsets):
            return P.ErrorReply("bad_request", "Commit: keys, checksums and offsets differ in length")
        # only slots reserved for this peer: another's offset matches no reservation (-1)
        offsets = [off if self.grants.revoke(self.peer, off) else -1 for off in msg.offsets]
        pw = PendingWrite(ident, req_id, list(msg.keys))
        committed = self.store.commit_many(msg.keys, msg.checksums, offsets)
        for i, (key, obj) in enumerate(zip(msg.keys, committed)):
            if obj is not None:
                pw.add(i, key, obj.size, obj.checksum)
        self.counters["bytes_in"] += sum(pw.sizes)
        return self._acknowledge(pw)

    def _acknowledge(self, pw: "PendingWrite"):
        """Persist as the durability policy says, then tell the master, then the client."""
        self.counters["writes"] += len(pw.keys)
        if self.store.write_through(pw.keys, pw):
            return None   # continued in _on_ssd_done
        return self._report(pw)

    def _report(self, pw: "PendingWrite"):
        """Tell the master, then the writer (with the seq to fence its lookups by)."""
        seq = self.master.committed(pw.keys, pw.sizes, pw.sums) if pw.keys else 0
        self.reply(pw.ident, pw.req_id, P.CommitReply(pw.ok, seq))
        return None

    def on_ClearRequest(self, msg: P.ClearRequest, ident, req_id):
        tenant = self.peer.tenant if self.peer.role == "client" else None
        gone = self.store.clear(msg.prefix, time.monotonic(), tenant)
        failed = P.ErrorReply("master_unavailable", f"removed {len(gone)} objects; the master did not confirm")
        return self._hold(ident, req_id, P.ClearReply(len(gone)), failed, gone, cleared=True)

    def metric_families(self) -> list:
        return node_families(self.node_id, self.stats(), self.rejected, self.latency)

    def readiness(self) -> tuple[bool, str]:
        if not self.master.registered:
            problem = self.master.problem
            return False, f"not registered with the master at {self.config.master}" + \
                (f": {problem}" if problem else "")
        problem = self.store.problem
        return not problem, f"degraded: {problem}"

    def on_NodeStatsRequest(self, msg, ident, req_id):
        return P.StatsReply({"node_id": self.node_id, **self.stats()})

    def close(self) -> None:
        super().close()
        self.streams.close()    # before the segment is unmapped: its threads copy into it
        if self.te is not None:
            self.te.close()     # before the segment is unmapped
        self.store.close()
        if self.store.ssd is not None:
            os.close(self._wake_r)
            os.close(self._wake_w)
        if self._name_lock is not None:
            os.close(self._name_lock)       # the name is free for the next node
