"""Node membership: heartbeat x liveness expiry, and which nodes may take new objects."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

from ..protocol import NodeInfo, segment_of


@dataclass
class NodeState:
    info: NodeInfo
    slot: int
    last_seen: float
    stats: dict = field(default_factory=dict)
    planned: int = 0        # bytes placed on it since its last heartbeat (not yet in its stats)
    # bytes placed in the interval before: a heartbeat's stats may predate their commit, so
    # they count until the next one (twice, at worst: a busy node looks fuller, never emptier)
    planned_before: int = 0
    record: dict = field(default_factory=dict)   # info.to_dict(), built once: replies carry it
    seq: int = 0            # the node's last report (Committed, Evicted) applied (fences)
    ident: bytes = b""      # the connection it registered on: its reports count only from there

    def __post_init__(self):
        self.record = self.info.to_dict()
        self.segment = segment_of(self.info)

    @property
    def free(self) -> int:
        used = int(self.stats.get("used", 0))
        return self.info.capacity - used - self.planned - self.planned_before


# A node whose heartbeat is this many intervals old has missed one: it takes no new objects,
# though what it holds is still looked up until it expires (interval x liveness). Half an
# interval of slack: a loaded node's loop runs its heartbeat a little late.
MISSED_BEAT = 1.5
LOST_FOR_S = 3600.0     # an expired node is named in stats (LOST) this long


class NodeRegistry:
    """Live nodes. A node silent for ``interval * liveness`` seconds is expired."""

    def __init__(self, interval_s: float, liveness: int):
        self.expiry_s = interval_s * liveness
        self.missed_s = interval_s * MISSED_BEAT
        self.nodes: dict[str, NodeState] = {}
        # node id -> (address, when it expired): nodes that missed their heartbeats and have
        # not registered again, named in stats for LOST_FOR_S (a node removed on purpose ages out)
        self._lost: dict[str, tuple[str, float]] = {}
        self._by_ident: dict[bytes, NodeState] = {}     # the connection each registered on

    def upsert(self, info: NodeInfo, slot: int, ident: bytes = b"") -> NodeState:
        self._lost.pop(info.node_id, None)
        old = self.nodes.get(info.node_id)
        if old is not None:
            self._by_ident.pop(old.ident, None)
        st = NodeState(info, slot, time.monotonic(), ident=ident)
        self.nodes[info.node_id] = st
        self._by_ident[ident] = st
        return st

    def heard(self, ident: bytes, now: float) -> None:
        """A message came in on connection ``ident``: the node registered on it is alive, even
        while the message waits to be handled (liveness is judged by receipt)."""
        st = self._by_ident.get(ident)
        if st is not None and st.last_seen < now:
            st.last_seen = now

    def reporter(self, node_id: str, ident: bytes) -> Optional[NodeState]:
        """The node ``node_id`` when ``ident`` is the connection it registered on, else None."""
        st = self.nodes.get(node_id)
        return st if st is not None and st.ident == ident else None

    def touch(self, node_id: str, ident: bytes, stats: dict) -> Optional[NodeState]:
        st = self.reporter(node_id, ident)
        if st is not None:
            st.last_seen = time.monotonic()
            st.stats = stats
            st.planned_before, st.planned = st.planned, 0
        return st

    def expire(self, now: float) -> list[NodeState]:
        dead = [st for st in self.nodes.values() if now - st.last_seen > self.expiry_s]
        for st in dead:
            del self.nodes[st.info.node_id]
            self._lost[st.info.node_id] = (st.info.address, now)
            self._by_ident.pop(st.ident, None)
        return dead

    def lost_nodes(self, now: float) -> list[dict]:
        """The nodes that expired in the last LOST_FOR_S and have not registered again."""
        for node_id in [n for n, (_, at) in self._lost.items() if now - at > LOST_FOR_S]:
            del self._lost[node_id]
        return [{"node_id": n, "address": a, "lost_s": round(now - at, 1)}
                for n, (a, at) in self._lost.items()]

    def live_slots(self) -> set[int]:
        return {st.slot for st in self.nodes.values()}

    def reachable(self, avoid) -> set[int]:
        """The live slots but those of the nodes ``avoid`` names (a reader's open circuits)."""
        return {st.slot for st in self.nodes.values() if st.info.node_id not in avoid} \
            if avoid else self.live_slots()

    def takers(self, avoid) -> list[NodeState]:
        """The nodes that may take new objects: live, not in ``avoid``, and not late with a
        heartbeat (unless every one of them is: a loaded host, not dead nodes)."""
        now = time.monotonic()
        usable = [st for st in self.nodes.values() if st.info.node_id not in avoid]
        return [st for st in usable if now - st.last_seen <= self.missed_s] or usable

    def slots_on(self, host: str) -> frozenset:
        """The slots of the live nodes on ``host`` (a reader's own: copies there first)."""
        return frozenset(st.slot for st in self.nodes.values() if st.info.host == host) \
            if host else frozenset()
