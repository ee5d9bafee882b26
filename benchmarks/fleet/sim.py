"""The fleet simulator: any ``api.Router``, unchanged, in front of N simulated SGLang instances
sharing one L3, driven by a trace. Deterministic for a seed.

One event loop (a heap ordered by time, then by push order). What the router gets, and when,
is what it would get in production, and nothing else:

- ``add_worker`` for each instance (its ``WorkerSpec``: page size and bytes, bandwidths,
  pool sizes) before the first request;
- ``route`` at each request's arrival (trace time / load factor), with the request's page
  hashes, prompt length, the client's ``max_new_tokens`` bound and its SLOs;
- KV events through ``channel.EventChannel`` (late, optionally lost and replayed);
- a ``LoadReport`` per instance every ``load_interval_s``;
- ``Started`` at the first token, ``Finished`` when the last token is out;
- the L3 through the ``l3.L3View`` it was built with (``make_router(view)``).

A rejected request is not served: its prompt's pages are never computed, so the next turn of
its conversation (the trace's next request sharing its prefix) finds them in no cache.

Clients give up: a request still queued (not admitted to a prefill) ``patience`` after its
arrival leaves the queue at no compute cost, as SGLang drops a request whose connection
closed, and the router hears ``Finished(ok=False)``; one whose prefill started runs to the
end. It is neither served nor good. Without it, every policy that does not reject collapses
past the fleet's capacity: the queues grow for the rest of the trace.
"""
from __future__ import annotations

import heapq
import random
from dataclasses import dataclass, replace
from typing import Callable, Optional

from hicache_mc.conductor import api
from hicache_mc.conductor.perf import L1_TOKENS, PerfModel

from .channel import EventChannel
from .instance import InstanceConfig, Job, SimInstance
from .l3 import L3View, SharedL3
from .metrics import RunResult, summarize
from .workload import BLOCK_TOKENS, TraceRequest, Workload

WAKE, PREFETCH, DELIVER, TICK, ABANDON = 1, 2, 3, 4, 5
GB = 1e9


@dataclass(frozen=True)
class FleetConfig:
    instances: int = 8
    l1_pages: int = L1_TOKENS // BLOCK_TOKENS       # 781: SGLang's pool on one H100
    l2_pages: int = 2 * (L1_TOKENS // BLOCK_TOKENS)  # SGLang's --hicache-ratio 2
    host_bw: float = 25 * GB          # L2 -> L1 over PCIe Gen5 x16, what HiCache loads reach
    l3_pages: int = 0                 # 0: no shared L3
    l3_bandwidth: float = 200 * GB    # the pool's aggregate: 8 storage hosts x 200 Gb/s
    l3_path_bw: float = 25 * GB       # one instance's path: a 200 Gb/s RDMA NIC (Transfer Engine)
    view_lag_s: float = 0.005         # the residency view behind the master
    event_delay_s: float = 0.05       # KV events, publisher to router
    event_loss: float = 0.0
    replay_s: float = 0.5
    load_interval_s: float = 0.5      # /v1/loads poll
    perturb_sigma: float = 0.0        # lognormal timing noise: prediction error
    overlap_load: bool = True         # L2 -> L1 under the compute, layer by layer (SGLang's)
    ttft_slo_base_s: float = 0.5      # TTFT SLO = base + factor x cold prefill alone
    ttft_slo_factor: float = 2.0
    tbt_slo_s: float = 0.1            # mean time per output token after the first
    max_new_tokens: int = 2048        # the client's bound the router sees
    abandon_floor_s: float = 30.0     # a client gives up on a request still queued after
    abandon_slo_factor: float = 10.0  # max(floor, factor x its TTFT SLO); both 0: never

    def without_l3(self) -> "FleetConfig":
        return replace(self, l3_pages=0)


def ttft_slo(perf: PerfModel, fleet: FleetConfig, prompt_tokens: int) -> float:
    """Twice what a cold prefill of this prompt costs on an idle instance, plus half a second
    (network, tokenization, a short queue): 0.6 s for 1k tokens, 1.3 s for 12k, 22 s for
    100k. A fixed TTFT SLO cannot fit prompts from 500 to 126k tokens."""
    return fleet.ttft_slo_base_s + fleet.ttft_slo_factor * perf.prefill_s(prompt_tokens)


def patience(fleet: FleetConfig, ttft_slo_s: float) -> Optional[float]:
    """How long a client waits for a request to start before giving up (None: forever)."""
    if fleet.abandon_floor_s <= 0 and fleet.abandon_slo_factor <= 0:
        return None
    return max(fleet.abandon_floor_s, fleet.abandon_slo_factor * ttft_slo_s)


def worker_spec(name: str, fleet: FleetConfig, perf: PerfModel) -> api.WorkerSpec:
    return api.WorkerSpec(name=name, page_tokens=BLOCK_TOKENS,
                          page_bytes=perf.page_bytes(BLOCK_TOKENS), host_bw=fleet.host_bw,
                          l3_bw=fleet.l3_path_bw, l1_pages=fleet.l1_pages,
                          l2_pages=fleet.l2_pages)


class FleetSim:
    def __init__(self, workload: Workload, fleet: FleetConfig,
                 make_router: Callable[[L3View], api.Router], load: float = 1.0,
                 seed: int = 0, perf: Optional[PerfModel] = None):
        if load <= 0:
            raise ValueError(f"load must be > 0, got {load}")
        self.workload, self.fleet, self.load = workload, fleet, load
        self.perf = perf or PerfModel()
        self.rng = random.Random(seed)
        self.names = workload.names
        self.l3 = SharedL3(fleet.l3_pages, fleet.l3_bandwidth,
                           self.perf.page_bytes(BLOCK_TOKENS), fleet.view_lag_s)
        self.view = L3View(self.l3, self.names.block_of)
        self.router = make_router(self.view)
        cfg = InstanceConfig(fleet.l1_pages, fleet.l2_pages, fleet.host_bw, fleet.l3_path_bw,
                             overlap_load=fleet.overlap_load)
        self.instances = [
            SimInstance(i, f"w{i}", cfg, self.perf, self.l3, self.names,
                        random.Random(seed * 1000 + i + 1), fleet.perturb_sigma)
            for i in range(fleet.instances)]
        self.by_name = {inst.name: inst for inst in self.instances}
        self.channel = EventChannel(fleet.event_delay_s, fleet.event_loss, fleet.replay_s,
                                    random.Random(seed + 7))
        self.heap: list = []
        self.seq = 0
        self.outstanding = 0
        self.served: list[Job] = []
        self.rejected: list[int] = []
        self.abandoned: list[Job] = []
        self.slo: dict = {}                                   # rid -> (ttft SLO, tbt SLO)

    def run(self) -> RunResult:
        for inst in self.instances:
            self.router.add_worker(worker_spec(inst.name, self.fleet, self.perf))
        arrivals = self.workload.requests
        t0 = arrivals[0].timestamp_s if arrivals else 0.0
        self._push(t0 / self.load, TICK, None, None)
        i, n, heap = 0, len(arrivals), self.heap
        while i < n or self.outstanding:
            next_arrival = (arrivals[i].timestamp_s / self.load) if i < n else float("inf")
            if heap and heap[0][0] <= next_arrival:
                t, _, kind, a, b = heapq.heappop(heap)
                self._handle(t, kind, a, b, i < n)
            else:
                self._arrive(arrivals[i], next_arrival)
                i += 1
        span = (arrivals[-1].timestamp_s - t0) / self.load if n else 0.0
        if span <= 0:                   # all at once: per second of the whole run instead
            span = max((j.finish for j in self.served), default=1.0) - t0 / self.load or 1.0
        return summarize(self.served, self.rejected, len(self.abandoned), self.slo, n, span,
                         self.l3, self.workload.previous)

    # -- events -----------------------------------------------------------------------------

    def _push(self, t: float, kind: int, a, b) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, a, b))

    def _handle(self, t: float, kind: int, a, b, more: bool) -> None:
        if kind == WAKE:
            inst = self.instances[a]
            if inst.version == b:
                self._wake(inst, inst.wake(t), t)
        elif kind == PREFETCH:
            inst = self.instances[a]
            inst.prefetched(b, t)
            self._wake(inst, inst.poke(t), t)
        elif kind == ABANDON:
            self._abandon(self.instances[a], b, t)
        elif kind == DELIVER:
            self.router.observe_events(a if b is None else self.channel.replay(b))
        elif kind == TICK:
            for inst in self.instances:
                self.router.observe_load(inst.load(t))
            if more or self.outstanding:
                self._push(t + self.fleet.load_interval_s, TICK, None, None)

    def _arrive(self, tr: TraceRequest, now: float) -> None:
        fleet, perf = self.fleet, self.perf
        slo = (ttft_slo(perf, fleet, tr.input_tokens), fleet.tbt_slo_s)
        self.slo[tr.index] = slo
        req = api.Request(rid=str(tr.index), arrival_s=now, prompt_tokens=tr.input_tokens,
                          page_hashes=self.workload.page_hashes[tr.index],
                          max_new_tokens=fleet.max_new_tokens, ttft_slo_s=slo[0],
                          tbt_slo_s=slo[1])
        self.view.now_s = now
        decision = self.router.route(req, now)
        if isinstance(decision, api.Rejection):
            self.rejected.append(tr.index)
            return
        inst = self.by_name.get(decision.worker)
        if inst is None:
            raise RuntimeError(f"router chose unknown worker {decision.worker!r}")
        noise = self.rng.lognormvariate(0.0, fleet.perturb_sigma) if fleet.perturb_sigma else 1.0
        job = Job(tr.index, tr.hash_ids, tr.input_tokens, tr.output_tokens, now, noise,
                  BLOCK_TOKENS)
        self.outstanding += 1
        wait = patience(fleet, slo[0])
        if wait is not None:
            self._push(now + wait, ABANDON, inst.index, job)
        prefetch_done = inst.arrive(job, now)
        if prefetch_done is not None:
            self._push(prefetch_done, PREFETCH, inst.index, job)
            self._drain(inst, now)
        else:
            self._wake(inst, inst.poke(now), now)

    def _abandon(self, inst: SimInstance, job: Job, now: float) -> None:
        """The client gave up; SGLang ends a request still queued, and its response says so."""
        if inst.abandon(job):
            self.abandoned.append(job)
            self.outstanding -= 1
            self.router.observe_finished(api.Finished(
                inst.name, str(job.rid), now, job.prompt, 0, {}, now - job.arrival, None,
                ok=False))

    def _wake(self, inst: SimInstance, until: Optional[float], now: float) -> None:
        if until is not None:
            self._push(until, WAKE, inst.index, inst.version)
        self._drain(inst, now)

    def _drain(self, inst: SimInstance, now: float) -> None:
        """Hand what ``inst`` did to the router: events through the channel, first tokens and
        ends at once."""
        if inst.outbox:
            for d in self.channel.publish(inst.name, inst.outbox, now):
                self._push(d.at_s, DELIVER, d.events, d.replay_of or None)
            inst.outbox = []
        router = self.router
        if inst.started:
            for job in inst.started:
                router.observe_started(api.Started(inst.name, str(job.rid), now))
            inst.started = []
        if inst.finished:
            for job in inst.finished:
                router.observe_finished(api.Finished(
                    inst.name, str(job.rid), now, job.prompt, job.output,
                    {api.Tier.GPU: job.gpu, api.Tier.HOST: job.host, api.Tier.L3: job.l3},
                    job.first_token - job.arrival, job.compute_s))
                self.served.append(job)
            self.outstanding -= len(inst.finished)
            inst.finished = []
