"""Dynamo's KV router cost as an ``api.Router``, from its documented rules (ai-dynamo/dynamo
``docs/components/router/router-concepts.md`` and ``router-configuration.md``):

    raw_prefill_blocks      = active_prefill_blocks + incoming_prompt_blocks
    adjusted_prefill_blocks = max(raw_prefill_blocks - overlap_credit_blocks, 0)
    decode_blocks           = active_decode_blocks + incoming_active_blocks
    cost                    = prefill_load_scale x adjusted_prefill_blocks + decode_blocks

and the lowest cost wins (``router_temperature`` 0, the default: deterministic; ties go to a
seeded random pick among the tied). With a temperature > 0 it samples a softmax over the
costs normalized to [0, 1].

- ``overlap_credit_blocks``: each block of the request's cached prefix credited once, at the
  weight of the nearest tier holding it: device (``overlap_score_credit``, 1.0), host
  (``host_cache_hit_weight``, 0.75), disk (``disk_cache_hit_weight``, 0.25: no disk tier
  here), the shared pool (``shared_cache_hit_weight``, 0.5). Device and host prefixes come
  from the worker's KV events; the shared pool's from the L3 lookup. No bandwidths, no
  congestion: a credit is a fixed fraction of a block.
- ``active_prefill_blocks``: the uncached prompt blocks (after credit) of the requests sent
  to the worker that have no first token yet; released at ``Started``.
- ``active_decode_blocks``: the distinct prompt blocks of the worker's requests in flight
  (KV reuse assumed: a block shared by two of them counts once); released at ``Finished``.
  ``incoming_active_blocks``: the request's blocks not already active there.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import NamedTuple, Sequence, Union

from hicache_mc.conductor import api

from .baselines import InFlightRouter
from .workload import block_hash


class _Sent(NamedTuple):
    worker: str
    prefill_blocks: float           # still counted as active prefill (0 once started)
    blocks: tuple                   # its distinct block hashes, counted as active decode


@dataclass(frozen=True)
class DynamoConfig:
    overlap_score_credit: float = 1.0       # device
    host_cache_hit_weight: float = 0.75
    disk_cache_hit_weight: float = 0.25
    shared_cache_hit_weight: float = 0.5
    prefill_load_scale: float = 1.0
    temperature: float = 0.0


class DynamoKvRouter(InFlightRouter):
    def __init__(self, l3: api.L3Lookup, config: DynamoConfig = DynamoConfig(), seed: int = 0):
        super().__init__()
        self.l3, self.config, self.rng = l3, config, random.Random(seed)
        self.page_tokens = 0
        self.cached: dict[str, dict] = {}       # worker -> {Tier: set of block hashes}
        self.prefill: dict[str, float] = {}     # worker -> active prefill blocks
        self.active: dict[str, dict] = {}       # worker -> block hash -> requests using it
        self._req: dict[str, _Sent] = {}

    def add_worker(self, spec: api.WorkerSpec) -> None:
        super().add_worker(spec)
        self.page_tokens = spec.page_tokens
        self.cached[spec.name] = {api.Tier.GPU: set(), api.Tier.HOST: set()}
        self.prefill[spec.name] = 0.0
        self.active[spec.name] = {}

    def remove_worker(self, name: str) -> None:
        super().remove_worker(name)
        for d in (self.cached, self.prefill, self.active):
            d.pop(name, None)

    def observe_events(self, events: Sequence[api.Event]) -> None:
        for e in events:
            tiers = self.cached.get(e.worker)
            if tiers is None:
                continue
            if isinstance(e, api.BlocksStored) and e.tier in tiers:
                tiers[e.tier].update(e.block_hashes)
            elif isinstance(e, api.BlocksRemoved) and e.tier in tiers:
                tiers[e.tier].difference_update(e.block_hashes)
            elif isinstance(e, api.Cleared):
                for s in tiers.values():
                    s.clear()

    def observe_started(self, started: api.Started) -> None:
        self._release_prefill(started.rid)

    def observe_finished(self, finished: api.Finished) -> None:
        super().observe_finished(finished)
        self._release_prefill(finished.rid)
        sent = self._req.pop(finished.rid, None)
        active = self.active.get(sent.worker) if sent else None
        if active is not None:
            for h in sent.blocks:
                left = active.get(h, 0) - 1
                if left > 0:
                    active[h] = left
                else:
                    active.pop(h, None)

    def _release_prefill(self, rid: str) -> None:
        sent = self._req.get(rid)
        if sent and sent.prefill_blocks and sent.worker in self.prefill:
            self.prefill[sent.worker] -= sent.prefill_blocks
            self._req[rid] = sent._replace(prefill_blocks=0.0)

    def credit(self, worker: str, blocks: Sequence[int], shared: int) -> float:
        """Overlap credit in blocks: the leading run per tier, each block at its nearest."""
        c, tiers = self.config, self.cached[worker]
        gpu, host, n, end = tiers[api.Tier.GPU], tiers[api.Tier.HOST], 0, len(blocks)
        while n < end and blocks[n] in gpu:
            n += 1
        dev = n
        while n < end and blocks[n] in host:
            n += 1
        return (c.overlap_score_credit * dev + c.host_cache_hit_weight * (n - dev)
                + c.shared_cache_hit_weight * max(0, shared - n))

    def route(self, req: api.Request, now_s: float) -> Union[api.Decision, api.Rejection]:
        if not self.workers:
            return self.no_worker()
        c = self.config
        blocks = [block_hash(h) for h in req.page_hashes]
        shared = self.l3(req.page_hashes) if c.shared_cache_hit_weight else 0
        incoming = req.prompt_tokens / max(1, self.page_tokens)
        costs, uncached = [], {}
        for w in self.workers:
            credit = self.credit(w, blocks, shared)
            uncached[w] = max(incoming - credit, 0.0)
            adjusted = max(self.prefill[w] + incoming - credit, 0.0)
            active = self.active[w]
            decode = len(active) + sum(1 for h in set(blocks) if h not in active)
            costs.append(c.prefill_load_scale * adjusted + decode)
        worker = self.pick(costs)
        self.prefill[worker] += uncached[worker]
        active = self.active[worker]
        unique = tuple(set(blocks))
        for h in unique:
            active[h] = active.get(h, 0) + 1
        self._req[req.rid] = _Sent(worker, uncached[worker], unique)
        return self.send(req, worker, f"cost {min(costs):.1f}")

    def pick(self, costs: list) -> str:
        lo = min(costs)
        if self.config.temperature <= 0:
            return self.rng.choice([w for w, x in zip(self.workers, costs) if x == lo])
        span = (max(costs) - lo) or 1.0
        weights = [math.exp(-(x - lo) / span / self.config.temperature) for x in costs]
        return self.rng.choices(self.workers, weights)[0]
