"""Read-your-writes fences: lookups the master holds until it has applied the commits they name.

A writer's lookups carry its latest commit per node (``after = {node id: [segment, seq]}``);
the master answers such a lookup only once it has applied that node's reports up to ``seq``, or
after ``FENCE_WAIT_S``. A fence on a node that is gone, or on another segment of it, holds
nothing. A fence names any number its sender likes, so what is held is bounded: at most
``MAX_PARKED`` lookups and ``MAX_PARKED_KEYS`` keys; past either, lookups are answered at once.
"""
from __future__ import annotations

import time
from typing import Any, Callable, NamedTuple

FENCE_WAIT_S = 1.0      # a lookup waits at most this long for the commits its fence names
MAX_PARKED = 10000
MAX_PARKED_KEYS = 1 << 20


class Parked(NamedTuple):
    until: float            # answered without its commits at this time (monotonic)
    task: Any               # the request (server.Task)
    resume: Callable        # what answers it: a reply, or the work of one


class Fences:
    """The lookups held; ``registry`` says how far each live node's reports are applied."""

    def __init__(self, registry):
        self.registry = registry
        self.parked: list[Parked] = []
        self.keys = 0

    def __bool__(self) -> bool:
        return bool(self.parked)

    def behind(self, after: dict) -> bool:
        """Whether a (checked) fence names a commit of a live node (same segment) not applied yet."""
        for node_id, (segment, seq) in after.items():
            st = self.registry.nodes.get(node_id)
            if st is not None and st.segment == segment and st.seq < seq:
                return True
        return False

    def park(self, msg, task, resume: Callable) -> bool:
        """Hold ``task`` (its request ``msg``) when its fence is ahead: True."""
        if not msg.after or not self.behind(msg.after) or len(self.parked) >= MAX_PARKED or \
                self.keys + len(msg.keys) > MAX_PARKED_KEYS:
            return False
        self.parked.append(Parked(time.monotonic() + FENCE_WAIT_S, task, resume))
        self.keys += len(msg.keys)
        return True

    def ready(self) -> list[Parked]:
        """The held lookups whose fences hold no more (the commits came, the node went)."""
        return self._take(lambda p: not self.behind(p.task.msg.after))

    def late(self, now: float) -> list[Parked]:
        """The held lookups that waited FENCE_WAIT_S."""
        return self._take(lambda p: p.until <= now)

    def _take(self, done: Callable[[Parked], bool]) -> list[Parked]:
        out = [p for p in self.parked if done(p)]
        if out:
            self.parked = [p for p in self.parked if not done(p)]
            self.keys -= sum(len(p.task.msg.keys) for p in out)
        return out
