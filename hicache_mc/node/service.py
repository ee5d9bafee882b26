"""StorageNode: the data plane (ROUTER) plus a channel to the master, in one loop.

Commits are reported to the master before the writer hears back: the node sends ``Committed``
(numbered: the node's report sequence) and then answers the writer with that number, without
waiting for the master's acknowledgement. The writer's next lookups carry the number as a
fence, which the master honours before answering (protocol.py), so a put that returns is
visible to its writer at once, and to every other client as soon as the master has read the
message the node sent before answering. A node whose messages to the master are lost
registers again with its whole inventory, so nothing it acknowledged stays unknown to the
master. Evictions are numbered in the same sequence and travel on the same connection: the
master applies a node's reports only in the node's order (one out of order is refused, and
the node registers again), and an eviction is reported only for a key the node does not hold
again by the time the report goes.

The node reports through its DEALER to the master's ROUTER, which applies reports read in the
same loop turn as lookups before them: a report that reached the master before a lookup that
the writer's answer led to (from any client) is applied first. Until it has registered with
the current master the node sends no reports: the inventory it registers with covers them.
"""
from __future__ import annotations

import glob
import logging
import os
import time
import uuid
from typing import Optional

import zmq

from .. import protocol as P
from ..config import NodeConfig
from ..auth import issue, secure_client
from ..link import Link
from ..rpc import Service
from ..transport.shm import host_identity
from ..transport.grants import Grants
from ..transport.stream import StreamServer
from .dram import HEADER_BYTES, DramTier
from .metrics import node_families
from .naming import advertised_host, node_name
from .ssd import SsdTier
from .pending import PendingWrite
from .store import Leased, Reserved, TieredStore
from .wire import lease_reply, reserve_reply

log = logging.getLogger(__name__)

INVENTORY_CHUNK = 4096      # keys per Committed message when re-registering
MASTER_TIMEOUT_S = 5.0      # a clear the master has not acknowledged by then fails


def remove_stale_segments(shm_dir: str) -> None:
    """Delete segment files of node processes that died without cleaning up (SIGKILL)."""
    for path in glob.glob(os.path.join(shm_dir, "hicache-mc-*")):
        try:
            pid = int(os.path.basename(path).split("-")[2])
            os.kill(pid, 0)
        except (ValueError, IndexError):
            continue
        except ProcessLookupError:
            try:
                os.unlink(path)
                log.info("removed stale segment %s", path)
            except OSError:
                pass
        except PermissionError:
            continue


class StorageNode(Service):
    roles = {"NodeStatsRequest": ("admin",)}

    def __init__(self, config: NodeConfig):
        super().__init__(f"tcp://{config.host}:{config.port}", config.token, "node")
        self.config = config
        self.node_id, self._name_lock = node_name(config, int(self.address.rsplit(":", 1)[1]))
        remove_stale_segments(config.shm_dir)
        seg_id = uuid.uuid4().hex[:8]
        path = os.path.join(config.shm_dir, f"hicache-mc-{os.getpid()}-{seg_id}")
        dram = DramTier(path, config.dram, seg_id, config.lease_s,
                        config.high_watermark, config.low_watermark, config.prefault)
        ssd = None
        if config.ssd > 0:
            self._wake_r, self._wake_w = os.pipe()
            os.set_blocking(self._wake_r, False)
            ssd = SsdTier(config.ssd_dir or os.path.join(config.data_dir, "ssd"), config.ssd,
                          config.ssd_segment, config.ssd_high_watermark, config.ssd_low_watermark,
                          wake=self._wake)
            self.add_socket(self._wake_r, self._on_ssd_done)
        self.store = TieredStore(dram, ssd, config.durability, config.ssd_fsync_interval_s)
        self.segment_id = seg_id
        self.dram = dram
        host = advertised_host(config)      # the host part of every address the node publishes
        self.te = self._transfer_engine(config, dram, host)
        self.grants = Grants()      # what each peer may move through the stream port
        try:
            self.streams = StreamServer(dram.mm, config.host, config.data_port, HEADER_BYTES, seg_id,
                                        self.guard.stream_key, self.grants)
        except OSError:
            if self.te is not None:
                self.te.close()
            dram.close()
            raise
        port = self.address.rsplit(":", 1)[1]
        self.info = P.NodeInfo(self.node_id, f"tcp://{host}:{port}", host_identity(), path,
                               config.dram,
                               config.prefault, te_address=self.te.address if self.te else "",
                               te_base=self.te.base if self.te else 0,
                               te_protocol=config.te_protocol,
                               data_address=f"{host}:{self.streams.address.rsplit(':', 1)[1]}")
        self.master = secure_client(self.ctx.socket(zmq.DEALER),
                                    issue(config.token, "node") if config.token else None)
        # nothing is queued for a master that is not connected: a send fails at once (and the
        # node registers again later) instead of piling reports up or blocking the loop
        self.master.setsockopt(zmq.IMMEDIATE, 1)
        self._link = Link(self.master, bool(config.token))  # why it cannot reach the master
        self.add_socket(self._link.events, lambda: self._link.check(f"the master at {config.master}"))
        self.master.connect(config.master)
        self.add_socket(self.master, self._on_master_reply)
        self._announced = False     # registered (with the inventory) on the current channel
        self._req = 0
        self._register_req = 0     # request id of the latest RegisterRequest
        self._seq = 0                           # reports numbered (see the docstring)
        # req_id -> (deadline, client ident, client req id, reply, reply if the master refuses)
        self._pending: dict[int, tuple[float, bytes, int, P.Message, P.Message]] = {}
        self.epoch: Optional[str] = None
        self._next_heartbeat = 0.0
        self._next_register = 0.0
        self._last_master_reply = time.monotonic()
        self.enable_metrics(config.metrics_host, config.metrics_port)
        self.counters = {"reads": 0, "read_hits": 0, "writes": 0, "bytes_in": 0}

    @staticmethod
    def _transfer_engine(config: NodeConfig, dram: DramTier, host: str):
        """With ``te_protocol`` set: a Mooncake TE serving the whole DRAM segment to remote
        clients (one-sided reads and writes under the same leases and reservations as shm).
        A TE that cannot start fails the node: an explicit setting is never silently dropped."""
        if not config.te_protocol:
            return None
        from ..transport.mooncake import NodeEngine
        try:
            return NodeEngine(dram.mm, host, config.te_protocol, config.te_device,
                              config.te_metadata)
        except Exception:
            dram.close()
            raise

    # -------------------------------------------------------------- ssd writer

    def _wake(self) -> None:
        """Called on the SSD writer thread when a job is done."""
        try:
            os.write(self._wake_w, b"\0")
        except OSError:
            pass

    def _on_ssd_done(self) -> None:
        try:
            os.read(self._wake_r, 4096)
        except BlockingIOError:
            pass
        now = time.monotonic()
        for pw, ok in self.store.poll_done(now):
            failed = [k for k, good in zip(pw.keys, ok) if not good]
            if failed:   # not on disk as the policy promised: neither acknowledged nor kept
                self.store.remove(failed, now)
                pw.drop(set(failed))
            self._report(pw)

    # -------------------------------------------------------------- master channel

    def _to_master(self, msg: P.Message, waiter: Optional[tuple] = None) -> None:
        """Send to the master; ``waiter`` = (ident, req_id, reply, failure reply) answers a
        client once the master acknowledges. A message that cannot go now (no master
        connected, or one that does not read) is dropped, and the node registers again: its
        inventory covers every report."""
        self._req += 1
        try:
            self.master.send(P.encode(msg, self._req), zmq.NOBLOCK, copy=False)
        except zmq.Again:
            self._announced, self.epoch = False, None
            if waiter is not None:
                self.reply(waiter[0], waiter[1], waiter[3])
            return
        if waiter is not None:
            self._pending[self._req] = (time.monotonic() + MASTER_TIMEOUT_S, *waiter)

    def _register(self, now: float) -> None:
        """Announce this node and its whole inventory (the master may be new)."""
        self._next_register = now + self.config.heartbeat_interval_s
        self._announced = True
        self._to_master(P.RegisterRequest(self.info.to_dict()))
        self._register_req = self._req
        items = self.store.inventory()
        for i in range(0, len(items), INVENTORY_CHUNK):
            chunk = items[i: i + INVENTORY_CHUNK]
            self._to_master(P.CommittedRequest(self.node_id, [c[0] for c in chunk],
                                               [c[1] for c in chunk], [c[2] for c in chunk]))
        # the inventory covers every commit so far: fences up to the current seq hold now
        self._to_master(P.CommittedRequest(self.node_id, [], [], [], self._seq))
        self._next_heartbeat = 0.0      # the master has its stats at once
        if self._announced:         # else a send failed: the master is not there (yet)
            log.info("registering with the master at %s (%d objects)", self.config.master, len(items))

    def _reregister(self, now: float) -> None:
        self._announced, self.epoch = False, None   # (tick retries until a RegisterReply)
        self._register(now)

    def _on_master_reply(self) -> None:
        """A reply on the DEALER."""
        frame = self.master.recv(copy=False)
        try:
            msg, req_id = P.decode(frame, request=False)
        except Exception as exc:
            log.warning("bad frame from the master: %s", exc)
            return
        self._last_master_reply = time.monotonic()
        if isinstance(msg, P.RegisterReply):
            # only the answer to the latest registration, and only while it stands: a send
            # that failed since (or a refused report) means registering again, and a late
            # answer must not mark the node registered while its reports are held back
            if req_id == self._register_req and self._announced:
                self.epoch = msg.epoch
        elif isinstance(msg, P.HeartbeatReply):
            self.store.quotas = {t: int(q) for t, q in msg.quotas.items()}
            # (while registering, epoch is None and tick retries: no second registration here;
            # nor for a heartbeat sent before this registration, e.g. queued over ZeroMQ while
            # the master was down, that reached it before the registration did)
            if self.epoch is not None and req_id > self._register_req and \
                    (not msg.known or msg.epoch != self.epoch):
                log.info("master epoch %s (was %s): registering again", msg.epoch, self.epoch)
                self._reregister(time.monotonic())
        elif isinstance(msg, P.ErrorReply):
            log.warning("master refused a request: %s %s", msg.code, msg.message)
            if req_id >= self._register_req:
                # the registration, a heartbeat or a report the master did not take, whatever
                # the reason (it does not know the node, one before was lost, a limit, a
                # fault): register again, with the whole inventory, which covers them, once
                # the last registration is a heartbeat interval old
                self._announced, self.epoch = False, None
        waiter = self._pending.pop(req_id, None)
        if waiter is not None:
            _, ident, client_req, reply, failed = waiter
            self.reply(ident, client_req, reply if isinstance(msg, P.OkReply) else failed)

    def tick(self, now: float) -> None:
        if self.epoch is None and now >= self._next_register:
            self._register(now)
        if now >= self._next_heartbeat:
            self._next_heartbeat = now + self.config.heartbeat_interval_s
            if now - self._last_master_reply > 3 * self.config.heartbeat_interval_s:
                # Lazy Pirate: a silent master may have restarted; drop queued frames (the
                # registration that follows covers them), reconnect
                self.master.disconnect(self.config.master)
                self.master.connect(self.config.master)
                self._last_master_reply = now
                self._announced, self.epoch = False, None
            self._to_master(P.HeartbeatRequest(self.node_id, self.stats()))
        self.store.maintain(now)
        self.grants.purge(now)
        dropped = self.store.drain_dropped()
        if self._announced and dropped:     # else the inventory it registers with leaves them out
            self._evicted(dropped)
        for req_id in [r for r, w in self._pending.items() if w[0] < now]:
            _, ident, client_req, _, failed = self._pending.pop(req_id)
            log.warning("the master did not acknowledge a request in %.0fs", MASTER_TIMEOUT_S)
            self.reply(ident, client_req, failed)

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
        if gone and self._announced:    # (else the inventory it registers with leaves them out)
            failed = P.ErrorReply("master_unavailable", "dropped damaged objects; the master did not confirm")
            self._evicted(gone, (ident, req_id, P.OkReply(), failed))
            return None
        return P.OkReply()

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
        return reserve_reply(slots, self.config.reserve_s * 0.8, self.segment_id)

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
        if pw.keys:
            self._seq += 1
            if self._announced:     # else the inventory it registers with has them
                self._to_master(P.CommittedRequest(self.node_id, pw.keys, pw.sizes, pw.sums, self._seq))
        self.reply(pw.ident, pw.req_id, P.CommitReply(pw.ok, self._seq if pw.keys else 0))
        return None

    def on_ClearRequest(self, msg: P.ClearRequest, ident, req_id):
        tenant = self.peer.tenant if self.peer.role == "client" else None
        gone = self.store.clear(msg.prefix, time.monotonic(), tenant)
        if not gone:
            return P.ClearReply(0)
        if not self._announced:     # the inventory it registers with leaves them out
            return P.ClearReply(len(gone))
        failed = P.ErrorReply("master_unavailable", f"removed {len(gone)} objects; the master did not confirm")
        self._evicted(gone, (ident, req_id, P.ClearReply(len(gone)), failed), cleared=True)
        return None

    def _evicted(self, keys: list[str], waiter: Optional[tuple] = None, cleared: bool = False) -> None:
        """Tell the master that ``keys`` left this node (evicted, or ``cleared``): a report
        numbered like commits."""
        self._seq += 1
        self._to_master(P.EvictedRequest(self.node_id, keys, self._seq, cleared), waiter)

    def metric_families(self) -> list:
        return node_families(self.node_id, self.stats(), self.rejected, self.latency)

    def readiness(self) -> tuple[bool, str]:
        if self.epoch is None:
            problem = self._link.problem
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
