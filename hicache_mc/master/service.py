"""MasterService: key index, node membership, placement and stats on one ROUTER socket.

The master is soft state. Nodes are the truth: each node registers with its inventory when it
starts and whenever it sees a new master epoch, so a restarted master rebuilds its index from
the nodes and loses nothing that a live node still holds.
"""
from __future__ import annotations

import logging
import time
import uuid

from .. import protocol as P
from ..config import MasterConfig
from ..rpc import Service
from .index import KeyIndex, NodeSlots
from .registry import NodeRegistry

log = logging.getLogger(__name__)


class MasterService(Service):
    """One per cluster. Serves clients (exists, locate, place, stats) and nodes."""

    def __init__(self, config: MasterConfig):
        super().__init__(f"tcp://{config.host}:{config.port}", config.token, "master")
        self.config = config
        self.epoch = uuid.uuid4().hex[:12]
        self.slots = NodeSlots()
        self.index = KeyIndex()
        self.registry = NodeRegistry(config.heartbeat_interval_s, config.liveness)
        self.counters = {"exists_calls": 0, "locate_calls": 0, "place_calls": 0,
                         "hits": 0, "misses": 0, "placed": 0, "deduplicated": 0,
                         "committed": 0, "evicted": 0, "nodes_expired": 0}
        self._next_expiry = 0.0

    # -------------------------------------------------------------- timers

    def tick(self, now: float) -> None:
        if now < self._next_expiry:
            return
        self._next_expiry = now + self.config.heartbeat_interval_s / 2
        for st in self.registry.expire(now):
            dropped = self.index.drop_slot(st.slot)
            self.counters["nodes_expired"] += 1
            log.warning("node %s missed its heartbeats; dropped it and its %d keys",
                        st.info.node_id, dropped)

    # -------------------------------------------------------------- clients

    def on_ExistsRequest(self, msg: P.ExistsRequest, payload, ident, req_id):
        self.counters["exists_calls"] += 1
        return P.ExistsReply(self.index.leading_run(msg.keys, self.registry.live_slots())), None

    def on_LocateRequest(self, msg: P.LocateRequest, payload, ident, req_id):
        self.counters["locate_calls"] += 1
        live = self.registry.live_slots()
        entries, nodes = [], {}
        for key in msg.keys:
            hit = self.index.get(key)
            if hit is None or hit[0] not in live:
                break
            node_id = self.slots.node_id(hit[0])
            entries.append([node_id, hit[1], hit[2]])
            if node_id not in nodes:
                nodes[node_id] = self.registry.nodes[node_id].info.to_dict()
        self.counters["hits"] += len(entries)
        self.counters["misses"] += len(msg.keys) - len(entries)
        return P.LocateReply(entries, nodes), None

    def on_PlaceRequest(self, msg: P.PlaceRequest, payload, ident, req_id):
        if len(msg.keys) != len(msg.sizes):
            return P.ErrorReply("bad_request", f"Place: {len(msg.keys)} keys but {len(msg.sizes)} sizes"), None
        self.counters["place_calls"] += 1
        live = self.registry.live_slots()
        todo = [i for i, k in enumerate(msg.keys) if self.index.slot_of(k) not in live]
        chosen = self.registry.place([msg.sizes[i] for i in todo], msg.host)
        targets: list = [None] * len(msg.keys)
        for i, node_id in zip(todo, chosen):
            targets[i] = node_id if node_id is not None else ""
        nodes = {t: self.registry.nodes[t].info.to_dict() for t in set(chosen) if t}
        self.counters["placed"] += len(todo)
        self.counters["deduplicated"] += len(msg.keys) - len(todo)
        return P.PlaceReply(targets, nodes), None

    def on_StatsRequest(self, msg, payload, ident, req_id):
        now = time.monotonic()
        nodes = []
        for st in self.registry.nodes.values():
            nodes.append({**st.info.to_dict(), **st.stats, "age_s": round(now - st.last_seen, 3)})
        stats = {"epoch": self.epoch, "keys": len(self.index), "nodes": nodes,
                 "capacity": sum(st.info.capacity for st in self.registry.nodes.values()),
                 "used": sum(int(st.stats.get("used", 0)) for st in self.registry.nodes.values()),
                 **self.counters}
        return P.StatsReply(stats), None

    # -------------------------------------------------------------- nodes

    def on_RegisterRequest(self, msg: P.RegisterRequest, payload, ident, req_id):
        info = P.NodeInfo.from_dict(msg.node)
        slot = self.slots.slot(info.node_id)
        if info.node_id in self.registry.nodes:
            # a restarted node: whatever it held before is gone unless its inventory says so
            self.index.drop_slot(slot)
        self.registry.upsert(info, slot)
        log.info("node %s registered (%s, %d bytes)", info.node_id, info.address, info.capacity)
        return P.RegisterReply(self.epoch), None

    def on_HeartbeatRequest(self, msg: P.HeartbeatRequest, payload, ident, req_id):
        known = self.registry.touch(msg.node_id, msg.stats) is not None
        return P.HeartbeatReply(self.epoch, known), None

    def on_CommittedRequest(self, msg: P.CommittedRequest, payload, ident, req_id):
        st = self.registry.nodes.get(msg.node_id)
        if st is None:
            return P.ErrorReply("unknown_node", f"node {msg.node_id!r} is not registered"), None
        if not len(msg.keys) == len(msg.sizes) == len(msg.checksums):
            return P.ErrorReply("bad_request", "Committed: keys, sizes and checksums differ in length"), None
        for key, size, checksum in zip(msg.keys, msg.sizes, msg.checksums):
            self.index.add(key, st.slot, size, checksum)
        st.last_seen = time.monotonic()
        self.counters["committed"] += len(msg.keys)
        return P.OkReply(), None

    def on_EvictedRequest(self, msg: P.EvictedRequest, payload, ident, req_id):
        st = self.registry.nodes.get(msg.node_id)
        if st is None:
            return P.ErrorReply("unknown_node", f"node {msg.node_id!r} is not registered"), None
        removed = sum(self.index.remove(k, st.slot) for k in msg.keys)
        self.counters["evicted"] += removed
        return P.OkReply(), None
