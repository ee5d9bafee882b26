"""KV events on their way from an instance to the router: late, and sometimes lost.

Each batch an instance publishes (one per forward that changed a pool, as SGLang's publisher
sends one ``KVEventBatch`` per scheduler step) reaches the router ``delay_s`` later. With
``loss`` > 0 a batch is lost with that probability. The router notices the gap when the next
batch arrives (sequence numbers): it gets ``StreamHealth(live=False)`` then, and routes that
worker on load alone; ``replay_s`` later the replay endpoint has sent the lost batch and
every batch held behind it, in order, followed by ``StreamHealth(live=True)``.
"""
from __future__ import annotations

from typing import NamedTuple

from hicache_mc.conductor import api


class Delivery(NamedTuple):
    at_s: float
    events: list              # api events, or empty for a replay marker (see ``replay``)
    replay_of: str = ""       # worker whose held batches are due at ``at_s``


class EventChannel:
    def __init__(self, delay_s: float, loss: float = 0.0, replay_s: float = 0.5, rng=None):
        if loss and rng is None:
            raise ValueError("a lossy channel needs an rng")
        self.delay_s, self.loss, self.replay_s, self.rng = delay_s, loss, replay_s, rng
        self._held: dict[str, list] = {}          # worker -> batches behind a lost one
        self._gap_seen: set = set()
        self.lost = 0

    def publish(self, worker: str, events: list, now: float) -> list:
        """The deliveries one batch published at ``now`` causes."""
        held = self._held.get(worker)
        if held is not None:
            held.append(events)
            if worker in self._gap_seen:
                return []
            self._gap_seen.add(worker)
            at = now + self.delay_s
            return [Delivery(at, [api.StreamHealth(worker, False)]),
                    Delivery(at + self.replay_s, [], worker)]
        if self.loss and self.rng.random() < self.loss:
            self.lost += 1
            self._held[worker] = [events]
            return []
        return [Delivery(now + self.delay_s, events)]

    def replay(self, worker: str) -> list:
        """The held batches of ``worker``, then its stream is live again."""
        out = [e for batch in self._held.pop(worker, []) for e in batch]
        self._gap_seen.discard(worker)
        out.append(api.StreamHealth(worker, True))
        return out
