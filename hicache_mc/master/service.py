"""MasterService: key index, node membership, placement and stats on one ROUTER socket.

The master is soft state. Nodes are the truth: each node registers with its inventory when it
starts and whenever it sees a new master epoch, so a restarted master rebuilds its index from
the nodes and loses nothing that a live node still holds.
"""
from __future__ import annotations

import logging
import time
import uuid
from functools import partial
from typing import Callable

from .. import protocol as P
from ..config import MasterConfig
from ..link import PortProbe, local_address
from ..keys import foreign_key, tenant_of
from ..server import Service
from .fences import FENCE_WAIT_S, Fences
from .index import SIZE_MASK, KeyIndex, NodeSlots
from . import report, slices
from .namespaces import NamespaceCounts
from .publisher import Publisher
from . import placement
from .registry import NodeRegistry

log = logging.getLogger(__name__)



class MasterService(Service):
    """One per cluster. Serves clients (exists, locate, place, stats) and nodes."""

    # A node reports a commit before it answers the writer: nodes' messages read in the same
    # loop turn as lookups are applied first (in the order each node sent them), so a lookup
    # that the writer's answer led to (from any client) finds the key when the report got
    # here before it.
    first = (P.RegisterRequest, P.HeartbeatRequest, P.CommittedRequest, P.EvictedRequest)
    roles = {"RegisterRequest": ("node",), "HeartbeatRequest": ("node",),
             "CommittedRequest": ("node",), "EvictedRequest": ("node",),
             "QuotaRequest": ("admin",)}

    def __init__(self, config: MasterConfig):
        super().__init__(f"tcp://{config.host}:{config.port}", config.token, "master",
                         max_connections=config.max_connections)
        self.config = config
        self.epoch = uuid.uuid4().hex[:12]
        self.slots = NodeSlots()
        self.index = KeyIndex()
        self.registry = NodeRegistry(config.heartbeat_interval_s, config.liveness)
        self.branches = placement.Branches()    # parents of recent Places: chains that branched there
        self.counters = {"exists_calls": 0, "locate_calls": 0, "place_calls": 0,
                         "hits": 0, "misses": 0, "placed": 0, "copies_placed": 0, "deduplicated": 0,
                         "committed": 0, "evicted": 0, "cleared": 0, "nodes_expired": 0,
                         "fence_waits": 0,
                         "snapshots": 0, "key_limited": 0}
        self._next_expiry = 0.0
        self.by_namespace = NamespaceCounts()
        self.quotas: dict[str, int] = config.quotas()  # tenant -> bytes across the cluster
        self.key_limits: dict[str, int] = config.key_limits()   # tenant ("*": others) -> keys
        self.fences = Fences(self.registry)   # lookups whose fence is ahead of the master
        self.publisher = None       # residency updates (master/publisher.py), unless turned off
        self._moved: dict[str, tuple[str, int]] = {}   # node -> [segment, seq] moved this turn
        if config.publish_port >= 0:
            self.publisher = Publisher(self.ctx, self.guard, config.host, config.publish_port,
                                       self.epoch, config.publish_beat_s, config.max_connections,
                                       self.index.namespace_size)
            self.index.journal = {}
            self.index.key_spaces = self.publisher.key_spaces    # one set: the publisher fills it
            self.add_socket(self.publisher.sock, self.publisher.on_readable)
            self.add_socket(self.publisher.connections.monitor, self.publisher.connections.on_readable)
        self._publish_probe = None if self.publisher is None else PortProbe(
            local_address(config.host), self.publisher.port)
        self.enable_metrics(config.metrics_host, config.metrics_port)

    def close(self) -> None:
        if self.publisher is not None:
            self.publisher.close()
        super().close()

    # -------------------------------------------------------------- timers

    def tick(self, now: float) -> None:
        if self.publisher is not None:
            self.publisher.connections.age(now)
        if self.fences and self.fences.parked[0].until <= now:
            late = self.fences.late(now)
            log.warning("%d lookups waited %.1fs for commits the master has not seen; answered "
                        "without them", len(late), FENCE_WAIT_S)
            self._answer(late)
        if now >= self._next_expiry:
            self._expire(now)
        if self.publisher is not None:
            self.publisher.flush(self.index.journal, self._node_marks, self._moved, now,
                                 self.index.key_journal)
            self._moved = {}

    def received(self, ident: bytes, peer, now: float) -> None:
        # a node's heartbeat read in a turn counts from then, however long the turn's work
        self.registry.heard(ident, now)

    def _node_marks(self) -> dict:
        """Each live node's reports applied: node id -> [segment, seq] (a residency beat)."""
        return {n: (st.segment, st.seq) for n, st in self.registry.nodes.items()}

    def _expire(self, now: float) -> None:
        self._next_expiry = now + self.config.heartbeat_interval_s / 2
        for st in self.registry.expire(now):
            dropped = self.index.drop_slot(st.slot)
            self._moved[st.info.node_id] = ("", 0)     # a mark no fence matches: views ask
            self.counters["nodes_expired"] += 1
            log.warning("node %s missed its heartbeats; dropped it and its %d keys",
                        st.info.node_id, dropped)
            self._answer(self.fences.ready())     # fences on a node that is gone hold no more

    # -------------------------------------------------------------- fences

    def _park(self, msg, resume: Callable) -> bool:
        """Hold the lookup being handled when its fence is ahead (True): once the commits
        arrive, or after FENCE_WAIT_S, ``resume()`` gives its answer (or the work of it)."""
        if not self.fences.park(msg, self.task, resume):
            return False
        self.counters["fence_waits"] += 1
        return True

    def _answer(self, parked) -> None:
        """Lookups let go go back to the backlog, to be answered as things stand now."""
        for p in parked:
            self.resume(p.task, p.resume())

    # -------------------------------------------------------------- clients

    def call(self, handler, msg, ident, req_id):
        """A wide request is worked in slices (slices.py), its fence checked once for all and
        each slice's keys checked as they come."""
        if not slices.wide(msg):
            return handler(msg, ident, req_id)
        if isinstance(msg, P.PlaceRequest):
            return slices.run(msg, lambda part: handler(part, ident, req_id))
        work = partial(slices.run, msg, partial(self._slice, handler, ident, req_id))
        return None if self._park(msg, work) else work()

    def _slice(self, handler, ident, req_id, part):
        self.check_tenant(part.keys)
        return handler(part, ident, req_id, fenced=True)

    def on_ExistsRequest(self, msg: P.ExistsRequest, ident, req_id, fenced=False):
        if not fenced:
            self.check_tenant(msg.keys)
        if not fenced and self._park(msg, partial(self.on_ExistsRequest, msg, ident, req_id, fenced=True)):
            return None
        self.counters["exists_calls"] += 1
        found, where = self._locate(msg.keys, stop_at_miss=True, near=msg.near, avoid=msg.avoid)
        # the probe's run is what a get will read (it skips Locate): count it like Locate does
        self.counters["hits"] += found
        self.counters["misses"] += len(msg.keys) - found
        self.by_namespace.count(msg.keys, [True] * found + [False] * (len(msg.keys) - found))
        return P.ExistsReply(found, *where)

    def _locate(self, keys: list[str], stop_at_miss: bool, near: str = "", avoid=()):
        """(how many keys were found, [held_by, holders, sizes, nodes] as in
        ``P.Locations``). With ``stop_at_miss`` only the leading run is located. The hot path
        of every probe: column-wise, in comprehensions rather than calls per key. A key with
        copies is located on a live one the reader does not ``avoid``, on its host first."""
        live = self.registry.reachable(avoid)
        values = self.index.get_many(keys, live, self.registry.slots_on(near))
        slots = [-1 if v is None else v >> 104 for v in values]
        on_live = list(map(live.__contains__, slots))
        if stop_at_miss:
            run = on_live.index(False) if False in on_live else len(keys)
            values, slots, on_live = values[:run], slots[:run], on_live[:run]
        found = sum(on_live)
        held = sorted(set(slots) & live)
        held_by = [self.slots.ids[s] for s in held]
        if len(held) == 1 and found == len(slots):
            holders = [0] * found
        else:
            pos = {s: i for i, s in enumerate(held)}
            holders = [pos[s] if ok else -1 for s, ok in zip(slots, on_live)]
        if found == len(values):
            sizes = [(v >> 64) & SIZE_MASK for v in values]
        else:
            sizes = [0 if v is None else (v >> 64) & SIZE_MASK for v in values]
        nodes = {n: self.registry.nodes[n].record for n in held_by}
        return found, [held_by, holders, sizes, nodes]

    def on_ContainsRequest(self, msg: P.ContainsRequest, ident, req_id, fenced=False):
        if not fenced:
            self.check_tenant(msg.keys)
        if not fenced and self._park(msg, partial(self.on_ContainsRequest, msg, ident, req_id, fenced=True)):
            return None
        self.counters["exists_calls"] += 1
        live = self.registry.live_slots()
        return P.ContainsReply([v is not None and v >> 104 in live for v in self.index.get_many(msg.keys, live)])

    def on_LocateRequest(self, msg: P.LocateRequest, ident, req_id, fenced=False):
        if not fenced:
            self.check_tenant(msg.keys)
        if not fenced and self._park(msg, partial(self.on_LocateRequest, msg, ident, req_id, fenced=True)):
            return None
        self.counters["locate_calls"] += 1
        found, where = self._locate(msg.keys, stop_at_miss=False, near=msg.near, avoid=msg.avoid)
        self.counters["hits"] += found
        self.counters["misses"] += len(msg.keys) - found
        self.by_namespace.count(msg.keys, [h >= 0 for h in where[1]])
        return P.LocateReply(*where)

    def on_SnapshotRequest(self, msg: P.SnapshotRequest, ident, req_id):
        """The keys of one namespace, for a client's residency view (see master/publisher.py)."""
        self.check_tenant([msg.namespace + "/"])
        if self.publisher is None:
            return P.ErrorReply("unavailable", "this master publishes no residency (publish_port -1)")
        self.counters["snapshots"] += 1     # views out of sync keep asking (an alert rule)
        return self.publisher.snapshot(msg.namespace, self.index, self._node_marks())

    def on_PlaceRequest(self, msg: P.PlaceRequest, ident, req_id):
        if len(msg.keys) != len(msg.sizes):
            return P.ErrorReply("bad_request", f"Place: {len(msg.keys)} keys but {len(msg.sizes)} sizes")
        if any(size < 0 for size in msg.sizes):
            return P.ErrorReply("bad_request", "Place: sizes must be >= 0")
        self.check_tenant(msg.keys + [msg.parent] if msg.parent else msg.keys)
        self.counters["place_calls"] += 1
        ask = placement.ask_of(msg, self.index, self.registry, self.slots, self.branches)
        reply, counts = placement.answer(ask, placement.place(self.registry, ask), self.registry)
        for name, n in counts._asdict().items():
            self.counters[name] += n
        if self.key_limits:
            reply = self._within_key_limits(msg.keys, ask, reply)
        return reply

    def _within_key_limits(self, keys: list[str], ask, reply: P.PlaceReply) -> P.PlaceReply:
        """``reply`` with no node for the keys new to the index past their tenants' key limits
        (their put answers False). Counted against the keys the index holds now: Places in
        flight may take a tenant over by what they place."""
        room: dict[str, float] = {}
        t = tenant_of(keys[0]) if keys else ""
        one = foreign_key(keys, t) is None      # the usual Place: one tenant's keys
        targets, copies, over = list(reply.targets), list(reply.copies), 0
        for i, held in enumerate(ask.held):
            if held:
                continue
            tenant = t if one else tenant_of(keys[i])
            left = room.get(tenant)
            if left is None:
                limit = self.key_limits.get(tenant, self.key_limits.get("*"))
                left = float("inf") if limit is None else limit - self.index.tenant_keys.get(tenant, 0)
            room[tenant] = left - 1
            if left <= 0:
                targets[i], over = "", over + 1
                if copies:
                    copies[i] = []
        self.counters["key_limited"] += over
        self.counters["placed"] -= over
        return P.PlaceReply(targets, reply.nodes, copies if any(copies) else []) if over else reply

    def on_StatsRequest(self, msg, ident, req_id):
        return P.StatsReply(report.stats(self, self.peer))

    # -------------------------------------------------------------- nodes

    def on_RegisterRequest(self, msg: P.RegisterRequest, ident, req_id):
        info = P.NodeInfo.from_dict(msg.node)
        slot = self.slots.slot(info.node_id)
        if info.node_id in self.registry.nodes:
            # a restarted node: whatever it held before is gone unless its inventory says so
            self.index.drop_slot(slot)
        st = self.registry.upsert(info, slot, ident)
        self._moved[info.node_id] = (st.segment, 0)
        if self.fences:
            self._answer(self.fences.ready())   # a node that restarted: fences on its old segment are void
        log.info("node %s registered (%s, %d bytes)", info.node_id, info.address, info.capacity)
        return P.RegisterReply(self.epoch)

    def on_HeartbeatRequest(self, msg: P.HeartbeatRequest, ident, req_id):
        st = self.registry.touch(msg.node_id, ident, msg.stats)
        return P.HeartbeatReply(self.epoch, st is not None, self._quota_shares(st))

    def _quota_shares(self, st) -> dict:
        """Each node enforces its share of a tenant's quota, in proportion to its capacity."""
        if st is None or not self.quotas:
            return {}
        cap = lambda s: s.info.capacity + int(s.stats.get("ssd_capacity", 0))  # noqa: E731
        total = sum(cap(s) for s in self.registry.nodes.values()) or 1
        return {t: q * cap(st) // total for t, q in self.quotas.items()}

    def on_QuotaRequest(self, msg: P.QuotaRequest, ident, req_id):
        from ..keys import check_tenant
        try:
            check_tenant(msg.tenant)
        except ValueError as exc:
            return P.ErrorReply("bad_request", str(exc))
        if msg.quota < 0:
            self.quotas.pop(msg.tenant, None)
        elif msg.tenant not in self.quotas and len(self.quotas) >= P.MAX_TENANTS:
            # each node learns its shares in a heartbeat reply, which carries at most this many
            return P.ErrorReply("too_many_quotas", f"{P.MAX_TENANTS} tenants have quotas already; "
                                "remove one first")
        else:
            self.quotas[msg.tenant] = msg.quota
        log.info("quota of tenant %r: %s", msg.tenant, "none" if msg.quota < 0 else f"{msg.quota} bytes")
        return P.OkReply()

    def on_CommittedRequest(self, msg: P.CommittedRequest, ident, req_id):
        st = self.registry.reporter(msg.node_id, ident)
        if st is None:
            return P.ErrorReply("unknown_node", f"node {msg.node_id!r} is not registered here")
        if not len(msg.keys) == len(msg.sizes) == len(msg.checksums):
            return P.ErrorReply("bad_request", "Committed: keys, sizes and checksums differ in length")
        if msg.keys and msg.seq and msg.seq != st.seq + 1:     # (seq 0: the inventory)
            return self._gap(msg, st)
        self.index.add_many(msg.keys, st.slot, msg.sizes, msg.checksums)
        st.last_seen = time.monotonic()
        self.counters["committed"] += len(msg.keys)
        self._applied(st, msg.seq)
        return P.OkReply()

    def on_EvictedRequest(self, msg: P.EvictedRequest, ident, req_id):
        st = self.registry.reporter(msg.node_id, ident)
        if st is None:
            return P.ErrorReply("unknown_node", f"node {msg.node_id!r} is not registered here")
        if msg.keys and msg.seq != st.seq + 1:
            return self._gap(msg, st)
        removed = sum(self.index.remove(k, st.slot) for k in msg.keys)
        self.counters["cleared" if msg.cleared else "evicted"] += removed
        self._applied(st, msg.seq)
        return P.OkReply()

    @staticmethod
    def _gap(msg, st) -> P.ErrorReply:
        """A node's numbered report that does not follow the last one applied: one before it
        was lost (a dropped connection), or this one comes late. Applied, it could drop a key
        committed since or miss one; refused, the node registers again with its inventory."""
        return P.ErrorReply("report_gap", f"node {msg.node_id!r}: report {msg.seq} after "
                            f"{st.seq}; register again")

    def _applied(self, st, seq: int) -> None:
        """The node's reports up to ``seq`` are applied: lookups fenced on them may go."""
        if seq > st.seq:
            st.seq = seq
            self._moved[st.info.node_id] = (st.segment, seq)
            if self.fences:
                self._answer(self.fences.ready())

    # -------------------------------------------------------------- metrics

    def close(self) -> None:
        if self._publish_probe is not None:
            self._publish_probe.close()
        super().close()

    def readiness(self) -> tuple[bool, str]:
        live, expect = len(self.registry.nodes), self.config.expect_nodes
        if not live:
            return False, "no live storage node"
        if live < expect:
            return False, f"degraded: {live} of {expect} storage nodes live (expect_nodes)"
        problem = self._publish_probe.problem() if self._publish_probe is not None else ""
        if problem:
            return False, (f"degraded: the publish port {self.publisher.port} takes no connection "
                           f"({problem}): clients' views ask the master for every lookup")
        return True, ""

    def metric_families(self) -> list:
        return report.families(self)
