"""Read-your-writes fences: this client's latest commit per node, named in its lookups.

A node answers a commit with its report sequence number; a lookup carrying ``after = {node id:
[segment, seq]}`` is answered by the master only once it has applied that node's reports up to
``seq`` (protocol.py). A fence is kept FENCE_TTL_S: far longer than a report takes to arrive.
"""
from __future__ import annotations

import time

from .. import protocol as P

FENCE_TTL_S = 5.0           # a commit is named in this client's lookups for this long at most


class Fences:
    """This client's recent commits per node (threads add and read without a lock)."""

    def __init__(self):
        self._by_node: dict[str, tuple[float, list]] = {}   # node id -> (until, [segment, seq])

    def committed(self, node: P.NodeInfo, seq: int) -> None:
        """A commit on ``node`` answered with report number ``seq``."""
        if seq > 0:
            mark = [P.segment_of(node), seq]
            old = self._by_node.get(node.node_id)
            if old is None or old[1][0] != mark[0] or old[1][1] < seq:   # (threads race here)
                self._by_node[node.node_id] = (time.monotonic() + FENCE_TTL_S, mark)

    def after(self) -> dict:
        """The fence for a lookup: this client's recent commits, per node."""
        if not self._by_node:
            return {}
        now, after = time.monotonic(), {}
        for node_id, (until, mark) in list(self._by_node.items()):
            if until > now:
                after[node_id] = mark
            else:
                self._by_node.pop(node_id, None)
        return after
