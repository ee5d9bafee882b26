"""Node membership (heartbeat x liveness expiry) and placement."""
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
    record: dict = field(default_factory=dict)   # info.to_dict(), built once: replies carry it
    seq: int = 0            # the node's last report (Committed, Evicted) applied (fences)
    ident: bytes = b""      # the connection it registered on: its reports count only from there

    def __post_init__(self):
        self.record = self.info.to_dict()
        self.segment = segment_of(self.info)

    @property
    def free(self) -> int:
        used = int(self.stats.get("used", 0))
        return self.info.capacity - used - self.planned


# A node whose heartbeat is this many intervals old has missed one: it takes no new objects,
# though what it holds is still looked up until it expires (interval x liveness). Half an
# interval of slack: a loaded node's loop runs its heartbeat a little late.
MISSED_BEAT = 1.5


class NodeRegistry:
    """Live nodes. A node silent for ``interval * liveness`` seconds is expired."""

    def __init__(self, interval_s: float, liveness: int):
        self.expiry_s = interval_s * liveness
        self.missed_s = interval_s * MISSED_BEAT
        self.nodes: dict[str, NodeState] = {}

    def upsert(self, info: NodeInfo, slot: int, ident: bytes = b"") -> NodeState:
        st = NodeState(info, slot, time.monotonic(), ident=ident)
        self.nodes[info.node_id] = st
        return st

    def reporter(self, node_id: str, ident: bytes) -> Optional[NodeState]:
        """The node ``node_id`` when ``ident`` is the connection it registered on, else None."""
        st = self.nodes.get(node_id)
        return st if st is not None and st.ident == ident else None

    def touch(self, node_id: str, ident: bytes, stats: dict) -> Optional[NodeState]:
        st = self.reporter(node_id, ident)
        if st is not None:
            st.last_seen = time.monotonic()
            st.stats = stats
            st.planned = 0
        return st

    def expire(self, now: float) -> list[NodeState]:
        dead = [st for st in self.nodes.values() if now - st.last_seen > self.expiry_s]
        for st in dead:
            del self.nodes[st.info.node_id]
        return dead

    def live_slots(self) -> set[int]:
        return {st.slot for st in self.nodes.values()}

    def place(self, sizes: list[int], host: str) -> list[Optional[str]]:
        """A node per object: the writer's own host first, then the most free space; a node
        that missed its last heartbeat only when every node did.

        Within the candidate set each object goes to the node with the most estimated free
        space, so one batch spreads over equal nodes. None where no live node exists.
        """
        now = time.monotonic()
        everyone = [st for st in self.nodes.values() if now - st.last_seen <= self.missed_s] \
            or list(self.nodes.values())     # (every node late: a loaded host, not a dead one)
        local = [st for st in everyone if st.info.host == host]
        only = local or everyone
        if len(only) == 1 and only[0].free >= sum(sizes):   # the usual batch: all in one place
            only[0].planned += sum(sizes)
            return [only[0].info.node_id] * len(sizes)
        free = {st.info.node_id: st.free for st in everyone}     # kept current as we place
        result: list[Optional[str]] = []
        for size in sizes:
            pool = local if any(free[st.info.node_id] >= size for st in local) else everyone
            if not pool:
                result.append(None)
                continue
            best = pool[0] if len(pool) == 1 else max(pool, key=lambda st: free[st.info.node_id])
            best.planned += size
            free[best.info.node_id] -= size
            result.append(best.info.node_id)
        return result
