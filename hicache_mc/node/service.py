"""StorageNode: the data plane (ROUTER) plus a channel to the master, in one loop.

Commits are reported to the master before the writer hears back: the node sends ``Committed``
(numbered: the node's commit sequence) and then answers the writer with that number, without
waiting for the master's acknowledgement. The writer's next lookups carry the number as a
fence, which the master honours before answering (protocol.py), so a put that returns is
visible to its writer at once, and to every other client as soon as the master has read the
message the node sent before answering. A node whose messages to the master are lost
registers again with its whole inventory, so nothing it acknowledged stays unknown to the
master. Evictions travel on the same connection after the commits they follow, so the master
applies both in the node's order.

Before it registers, the node asks the master (``Hello``, over its ZeroMQ DEALER) for its
direct port, connects to it and registers there; everything it reports then goes through that
plain TCP connection, which the master reads before its other peers in each loop turn. A report
is therefore in the master's socket before the writer hears back, and is applied before any
lookup the writer's answer could have led to, from any client on the same host (measured in
``benchmarks/bench_visibility.py``). Until it has registered on a channel the node sends no
reports: the inventory it registers with covers them. A direct connection that breaks sends it
back to the start (``Hello``, register), over the DEALER when the master has no direct port.
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
from ..metrics import counter, gauge, histogram_family
from ..rpc import CONNECT_TIMEOUT_S, DirectConnection, Service, dial, direct_via
from ..transport.shm import host_identity
from ..transport.stream import StreamServer
from .dram import HEADER_BYTES, DramTier
from .ssd import SsdTier
from .store import ON_SSD, TieredStore

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
    def __init__(self, config: NodeConfig):
        super().__init__(f"tcp://{config.host}:{config.port}", config.token, "node",
                         max_frame=max(P.MAX_HEADER_BYTES, config.max_value))
        self.config = config
        self.node_id = config.node_id or f"{config.host}:{self.address.rsplit(':', 1)[1]}"
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
        self.te = self._transfer_engine(config, dram)
        try:
            self.streams = StreamServer(dram.mm, config.host, config.data_port, config.token, HEADER_BYTES,
                                        seg_id)
        except OSError:
            if self.te is not None:
                self.te.close()
            dram.close()
            raise
        if config.direct_port >= 0:
            try:
                self.enable_direct(config.host, config.direct_port)
            except OSError:
                self.streams.close()
                if self.te is not None:
                    self.te.close()
                dram.close()
                raise
        self.info = P.NodeInfo(self.node_id, self.address, host_identity(), path, config.dram,
                               config.prefault, te_address=self.te.address if self.te else "",
                               te_base=self.te.base if self.te else 0,
                               te_protocol=config.te_protocol,
                               data_address=self.streams.address,
                               direct_address=self.direct_address)
        self.master = self.ctx.socket(zmq.DEALER)
        self.master.setsockopt(zmq.LINGER, 0)
        self.master.connect(config.master)
        self.add_socket(self.master, self._on_master_reply)
        self._master_direct: Optional[str] = None   # its direct port; None: not asked, "": none
        self._mconn: Optional[DirectConnection] = None
        self._announced = False     # registered (with the inventory) on the current channel
        self._req = 0
        self._register_req = 0     # request id of the latest RegisterRequest
        self._seq = 0                           # Committed messages sent (see the docstring)
        # req_id -> (deadline, client ident, client req id, reply, reply if the master refuses)
        self._pending: dict[int, tuple[float, bytes, int, P.Message, P.Message]] = {}
        self.epoch: Optional[str] = None
        self._next_heartbeat = 0.0
        self._next_register = 0.0
        self._last_master_reply = time.monotonic()
        self.enable_metrics(config.metrics_host, config.metrics_port)
        self.counters = {"reads": 0, "read_hits": 0, "writes": 0, "bytes_in": 0, "bytes_out": 0}

    @staticmethod
    def _transfer_engine(config: NodeConfig, dram: DramTier):
        """With ``te_protocol`` set: a Mooncake TE serving the whole DRAM segment to remote
        clients (one-sided reads and writes under the same leases and reservations as shm).
        A TE that cannot start fails the node: an explicit setting is never silently dropped."""
        if not config.te_protocol:
            return None
        from ..transport.mooncake import NodeEngine
        try:
            return NodeEngine(dram.mm, config.host, config.te_protocol, config.te_device,
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
        self.store.poll_done(now)
        finished, self.store.finished = self.store.finished, []
        for pw, ok in finished:
            failed = [k for k, good in zip(pw.keys, ok) if not good]
            if failed:   # not on disk as the policy promised: neither acknowledged nor kept
                self.store.remove(failed, now)
                pw.drop(set(failed))
            self._report(pw)

    # -------------------------------------------------------------- master channel

    def _to_master(self, msg: P.Message, waiter: Optional[tuple] = None) -> None:
        """Send to the master; ``waiter`` = (ident, req_id, reply, failure reply) answers a
        client once the master acknowledges."""
        self._req += 1
        frames = P.encode(msg, self._req, self.config.token)
        if self._mconn is not None:
            self._mconn.send(frames)
        else:
            self.master.send_multipart(frames)
        if waiter is not None:
            self._pending[self._req] = (time.monotonic() + MASTER_TIMEOUT_S, *waiter)

    def _register(self, now: float) -> None:
        """Announce this node and its whole inventory (the master may be new); first, unless
        known, ask where the master's direct port is (``_on_hello`` comes back here)."""
        self._next_register = now + self.config.heartbeat_interval_s
        if self._mconn is None and self._master_direct is None:
            self._to_master(P.HelloRequest())
            return
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
        log.info("registering with the master at %s%s (%d objects)", self.config.master,
                 f" through its direct port {self._master_direct}" if self._mconn else "", len(items))

    def _reregister(self, now: float) -> None:
        self._announced, self.epoch = False, None   # (tick retries until a RegisterReply)
        self._register(now)

    def _on_hello(self, msg: P.HelloReply) -> None:
        if self._mconn is not None or self._master_direct is not None:
            return                  # an answer to an earlier Hello
        self._master_direct = ""
        address = direct_via(self.config.master, msg.direct_address)
        if address:
            try:
                sock = dial(address, CONNECT_TIMEOUT_S)
            except (OSError, ValueError) as exc:
                log.warning("master's direct port %s: %s; reporting through ZeroMQ", address, exc)
            else:
                self._master_direct = address
                self._mconn = DirectConnection(sock, self, on_close=self._master_direct_closed)
                self.add_socket(self._mconn.fd, self._on_master_direct)
        self._reregister(time.monotonic())

    def _on_master_direct(self) -> None:
        """The direct connection to the master is readable (or writable again)."""
        conn = self._mconn
        if conn is not None:
            if conn.out:
                conn.flush()
            for frames in conn.read():
                self._on_master_frames(frames)

    def _master_direct_closed(self, conn: DirectConnection) -> None:
        """Back to the start: what was on the wire is lost; waiters fail, the node registers
        again (asking for the direct port again: a restarted master has another)."""
        self.remove_socket(conn.fd)
        if self._mconn is not conn:
            return
        self._mconn, self._master_direct, self._announced = None, None, False
        self.epoch, self._next_register = None, 0.0
        if self.stopping.is_set():
            return
        log.warning("direct connection to the master closed; registering again")
        for req_id in list(self._pending):
            _, ident, client_req, _, failed = self._pending.pop(req_id)
            self.reply(ident, client_req, failed)

    def _on_master_reply(self) -> None:
        """A reply on the DEALER."""
        self._on_master_frames(self.master.recv_multipart(copy=False))

    def _on_master_frames(self, frames: list) -> None:
        try:
            msg, req_id, _, _ = P.decode(frames)
        except Exception as exc:
            log.warning("bad frame from the master: %s", exc)
            return
        self._last_master_reply = time.monotonic()
        if isinstance(msg, P.HelloReply):
            self._on_hello(msg)
        elif isinstance(msg, P.RegisterReply):
            self.epoch = msg.epoch
        elif isinstance(msg, P.HeartbeatReply):
            self.store.quotas = {t: int(q) for t, q in msg.quotas.items()}
            # (while registering, epoch is None and tick retries: no second registration here;
            # nor for a heartbeat sent before this registration, e.g. queued over ZeroMQ while
            # the master was down, that reached it before the registration did)
            if self.epoch is not None and req_id > self._register_req and \
                    (not msg.known or msg.epoch != self.epoch):
                log.info("master epoch %s (was %s): registering again", msg.epoch, self.epoch)
                if msg.epoch != self.epoch and self._mconn is None:
                    self._master_direct = None      # a new master may have a direct port
                self._reregister(time.monotonic())
        elif isinstance(msg, P.ErrorReply):
            log.warning("master refused a request: %s %s", msg.code, msg.message)
            if msg.code == "unknown_node" and req_id > self._register_req and \
                    time.monotonic() >= self._next_register:
                self._reregister(time.monotonic())
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
                # Lazy Pirate: a silent master may have restarted; drop queued frames, reconnect
                self.master.disconnect(self.config.master)
                self.master.connect(self.config.master)
                self._last_master_reply = now
                if self._mconn is not None:
                    self._mconn.close()         # back to the start (see the docstring)
            self._to_master(P.HeartbeatRequest(self.node_id, self.stats()))
        self.store.maintain(now)
        if self.dram.dropped:
            dropped = self.store.drain_dropped()
            if self._announced:     # else the inventory it registers with leaves them out
                self._to_master(P.EvictedRequest(self.node_id, dropped))
        for req_id in [r for r, w in self._pending.items() if w[0] < now]:
            _, ident, client_req, _, failed = self._pending.pop(req_id)
            log.warning("the master did not acknowledge a request in %.0fs", MASTER_TIMEOUT_S)
            self.reply(ident, client_req, failed)

    def stats(self) -> dict:
        return {**self.store.stats(), **self.counters, **self.streams.counters}

    # -------------------------------------------------------------- data plane

    def on_ReadRequest(self, msg: P.ReadRequest, payload, ident, req_id):
        now = time.monotonic()
        sizes, checksums, frames = [], [], []
        for key in msg.keys:
            found = self.store.read(key, now)   # DRAM views are leased: covers zmq's zero-copy send
            if found is None:
                sizes.append(-1)
                checksums.append(0)
                continue
            sizes.append(found[0])
            checksums.append(found[1])
            frames.append(found[2])
            self.counters["bytes_out"] += found[0]
        self.counters["reads"] += len(msg.keys)
        self.counters["read_hits"] += len(frames)
        return P.ReadReply(sizes, checksums), frames

    def on_LeaseRequest(self, msg: P.LeaseRequest, payload, ident, req_id):
        now = time.monotonic()
        offsets, sizes, checksums = [], [], []
        for key in msg.keys:
            obj = self.store.lease(key, now)
            if obj is None or obj is ON_SSD:
                offsets.append(-1 if obj is None else P.LEASE_STREAM)
                sizes.append(-1)
                checksums.append(0)
            else:
                offsets.append(obj.offset)
                sizes.append(obj.size)
                checksums.append(obj.checksum)
        self.counters["reads"] += len(msg.keys)
        self.counters["read_hits"] += sum(o >= 0 for o in offsets)
        # the reader must be done a little before the slot could be reused
        return P.LeaseReply(offsets, sizes, checksums, self.config.lease_s * 0.8, self.segment_id), None

    def on_ReleaseRequest(self, msg: P.ReleaseRequest, payload, ident, req_id):
        if len(msg.keys) != len(msg.offsets):
            return P.ErrorReply("bad_request", "Release: keys and offsets differ in length"), None
        for key, offset in zip(msg.keys, msg.offsets):
            self.store.unlease(key, offset)
        return P.OkReply(), None

    def on_WriteRequest(self, msg: P.WriteRequest, payload, ident, req_id):
        if not len(msg.keys) == len(msg.checksums) == len(payload):
            return P.ErrorReply("bad_request", f"Write: {len(msg.keys)} keys, {len(msg.checksums)} "
                                f"checksums, {len(payload)} payload frames"), None
        now = time.monotonic()
        self.store.next_request()
        pw = PendingWrite(ident, req_id, P.WriteReply, list(msg.keys))
        for i, (key, checksum, frame) in enumerate(zip(msg.keys, msg.checksums, payload)):
            data = frame.buffer
            if len(data) <= self.config.max_value and self.store.write(key, data, checksum, now):
                pw.add(i, key, *self.store.meta(key))   # stored before too: the master may have lost it
                self.counters["bytes_in"] += len(data)
        return self._acknowledge(pw)

    def on_ReserveRequest(self, msg: P.ReserveRequest, payload, ident, req_id):
        if len(msg.keys) != len(msg.sizes):
            return P.ErrorReply("bad_request", "Reserve: keys and sizes differ in length"), None
        now = time.monotonic()
        self.store.next_request()
        offsets = self.store.reserve_many(msg.keys, msg.sizes, now, self.config.reserve_s,
                                          msg.evict, self.config.max_value)
        return P.ReserveReply(offsets, self.config.reserve_s * 0.8, self.segment_id), None

    def on_ArenaRequest(self, msg: P.ArenaRequest, payload, ident, req_id):
        if msg.size < 0:
            return P.ErrorReply("bad_request", f"Arena: size must be >= 0, got {msg.size}"), None
        now = time.monotonic()
        if msg.give_back:
            self.dram.close_arena(msg.give_back, now)
        return P.ArenaReply(*self._lend(msg.size, now)), None

    def _lend(self, size: int, now: float) -> list:
        """ArenaReply's fields for an arena of up to ``size`` bytes (none lent: 0 asked, or no
        room): at most 1/16 of the segment per arena, and dram.ARENA_SHARE in all (lent room
        is not evictable)."""
        got = self.dram.open_arena(min(size, self.dram.capacity // 16), now, self.config.reserve_s) \
            if size else None
        arena, offset, size = got or (0, -1, 0)
        return [arena, offset, size, self.config.reserve_s * 0.8, self.segment_id]

    def on_CommitRequest(self, msg: P.CommitRequest, payload, ident, req_id):
        if not len(msg.keys) == len(msg.checksums) == len(msg.offsets):
            return P.ErrorReply("bad_request", "Commit: keys, checksums and offsets differ in length"), None
        pw = PendingWrite(ident, req_id, P.CommitReply, list(msg.keys))
        if msg.arena:
            return self._commit_arena(msg, pw)
        committed = self.store.commit_many(msg.keys, msg.checksums, msg.offsets)
        for i, (key, obj) in enumerate(zip(msg.keys, committed)):
            if obj is not None:
                pw.add(i, key, obj.size, obj.checksum)
        self.counters["bytes_in"] += sum(pw.sizes)
        return self._acknowledge(pw)

    def _commit_arena(self, msg: P.CommitRequest, pw: "PendingWrite"):
        if len(msg.sizes) != len(msg.keys):
            return P.ErrorReply("bad_request", "Commit: an arena commit needs one size per key"), None
        if msg.lend < 0:
            return P.ErrorReply("bad_request", f"Commit: lend must be >= 0, got {msg.lend}"), None
        why = self.dram.arena_error(msg.arena, msg.offsets, msg.sizes)
        if why is not None:
            code = "unknown_arena" if msg.arena not in self.dram.arenas else "bad_request"
            return P.ErrorReply(code, f"Commit into arena {msg.arena}: {why}"), None
        self.store.next_request()
        done = self.store.commit_arena(msg.arena, msg.keys, msg.checksums, msg.offsets, msg.sizes,
                                       time.monotonic(), self.config.reserve_s, self.config.max_value)
        for i, (key, obj) in enumerate(zip(msg.keys, done)):
            if isinstance(obj, tuple):  # stored before (the master may have lost it)
                pw.add(i, key, *obj)
            elif obj is not None:
                pw.add(i, key, obj.size, obj.checksum)
                self.counters["bytes_in"] += obj.size
        if msg.lend:        # the writer's next arena, from the room this commit left
            pw.more["lent"] = self._lend(msg.lend, time.monotonic())
        return self._acknowledge(pw)

    def _acknowledge(self, pw: "PendingWrite"):
        """Persist as the durability policy says, then tell the master, then the client."""
        self.counters["writes"] += len(pw.keys)
        if self.store.persist(pw.keys, pw):
            return None   # continued in _on_ssd_done
        return self._report(pw)

    def _report(self, pw: "PendingWrite"):
        """Tell the master, then the writer (with the seq to fence its lookups by)."""
        if pw.keys:
            self._seq += 1
            if self._announced:     # else the inventory it registers with has them
                self._to_master(P.CommittedRequest(self.node_id, pw.keys, pw.sizes, pw.sums, self._seq))
        self.reply(pw.ident, pw.req_id, pw.reply_cls(pw.ok, self._seq if pw.keys else 0, **pw.more))
        return None

    def on_ClearRequest(self, msg: P.ClearRequest, payload, ident, req_id):
        gone = self.store.clear(msg.prefix, time.monotonic())
        if not gone:
            return P.ClearReply(0), None
        if not self._announced:     # the inventory it registers with leaves them out
            return P.ClearReply(len(gone)), None
        failed = P.ErrorReply("master_unavailable", f"removed {len(gone)} objects; the master did not confirm")
        self._to_master(P.EvictedRequest(self.node_id, gone), (ident, req_id, P.ClearReply(len(gone)), failed))
        return None

    def metric_families(self) -> list:
        st = self.stats()
        node = self.node_id
        fams = []
        gauges = {"capacity": ("dram_capacity_bytes", "DRAM tier capacity"),
                  "used": ("dram_used_bytes", "DRAM tier bytes in use"),
                  "objects": ("dram_objects", "objects in the DRAM tier"),
                  "ssd_capacity": ("ssd_capacity_bytes", "SSD tier capacity"),
                  "ssd_used": ("ssd_used_bytes", "SSD tier bytes on disk"),
                  "ssd_live": ("ssd_live_bytes", "SSD tier bytes of live records"),
                  "ssd_objects": ("ssd_objects", "objects in the SSD tier"),
                  "objects_total": ("objects", "objects on this node, any tier")}
        for key, (name, help_) in gauges.items():
            if key in st:
                fams.append(gauge(f"hicache_mc_node_{name}", help_, st[key], node=node))
        counters = {"evictions": "objects evicted from DRAM", "reads": "keys asked for",
                    "read_hits": "keys served", "writes": "objects committed",
                    "bytes_in": "object bytes written", "bytes_out": "object bytes sent over tcp",
                    "ssd_demotions": "objects demoted to SSD", "ssd_promotions": "objects staged back into DRAM",
                    "ssd_streamed": "objects read from SSD straight to a tcp reader",
                    "ssd_compactions": "SSD segments compacted", "ssd_evictions": "records evicted from SSD",
                    "ssd_corrupt": "damaged SSD records found (checksum failures)",
                    "ssd_write_errors": "failed SSD writes",
                    "stream_reads": "objects read through the stream port",
                    "stream_writes": "objects written through the stream port",
                    "stream_refused": "stream-port requests refused (bad header, range or token)"}
        for key, help_ in counters.items():
            if key in st:
                fams.append(counter(f"hicache_mc_node_{key}_total", help_, st[key], node=node))
        rejected = counter("hicache_mc_node_rejected_total", "error replies to bad requests, per code")
        for code, n in self.rejected.items():
            rejected.add(n, code=code, node=node)
        fams += [rejected, histogram_family("hicache_mc_node_request_seconds", "request handling time",
                                            "type", self.latency)]
        return fams

    def on_NodeStatsRequest(self, msg, payload, ident, req_id):
        return P.StatsReply({"node_id": self.node_id, **self.stats()}), None

    def close(self) -> None:
        if self._mconn is not None:
            self._mconn.close()
        super().close()
        self.streams.close()    # before the segment is unmapped: its threads copy into it
        if self.te is not None:
            self.te.close()     # before the segment is unmapped
        self.store.close()
        if self.store.ssd is not None:
            os.close(self._wake_r)
            os.close(self._wake_w)


class PendingWrite:
    """A client's write on its way to disk (``sync``) and to the master."""

    def __init__(self, ident: bytes, req_id: int, reply_cls, request_keys: list[str]):
        self.ident, self.req_id, self.reply_cls = ident, req_id, reply_cls
        self.ok = [False] * len(request_keys)
        self.where: list[int] = []           # request position of each stored key
        self.keys: list[str] = []
        self.sizes: list[int] = []
        self.sums: list[int] = []
        self.more: dict = {}                  # other fields of the reply

    def add(self, i: int, key: str, size: int, checksum: int) -> None:
        self.ok[i] = True
        self.where.append(i)
        self.keys.append(key)
        self.sizes.append(size)
        self.sums.append(checksum)

    def drop(self, keys: set) -> None:
        keep = [j for j, k in enumerate(self.keys) if k not in keys]
        for j, k in enumerate(self.keys):
            if k in keys:
                self.ok[self.where[j]] = False
        self.where = [self.where[j] for j in keep]
        self.keys = [self.keys[j] for j in keep]
        self.sizes = [self.sizes[j] for j in keep]
        self.sums = [self.sums[j] for j in keep]
