"""Cache-blind baselines as ``api.Router``s: random, round-robin, least-load, and the
admission control (least-load that rejects by a cache-blind length cap).

Each counts its own requests in flight per worker (sent, not yet finished), as SGLang's
router and Dynamo's do: load reports and KV events are ignored.
"""
from __future__ import annotations

import random
from typing import Union

from hicache_mc.conductor import api
from hicache_mc.conductor.perf import PerfModel


def decision(worker: str, reasons: str = "") -> api.Decision:
    """A choice made without a TTFT prediction (the prediction's figures are 0)."""
    return api.Decision(worker, api.Prediction(worker, 0.0, 0.0, 0.0, 0.0), reasons=reasons)


class InFlightRouter:
    """The workers and the requests in flight on each; subclasses choose in ``route``."""

    def __init__(self) -> None:
        self.workers: list[str] = []
        self.inflight: dict[str, int] = {}
        self._sent: dict[str, str] = {}                 # rid -> worker

    def add_worker(self, spec: api.WorkerSpec) -> None:
        if spec.name not in self.inflight:
            self.workers.append(spec.name)
        self.inflight[spec.name] = 0

    def remove_worker(self, name: str) -> None:
        if name in self.inflight:
            self.workers.remove(name)
            del self.inflight[name]

    def observe_events(self, events) -> None:
        """Cache-blind: KV events are not used."""

    def observe_load(self, report: api.LoadReport) -> None:
        """Load is the router's own count of requests in flight."""

    def observe_started(self, started: api.Started) -> None:
        """Only the end of a request changes the count."""

    def observe_finished(self, finished: api.Finished) -> None:
        worker = self._sent.pop(finished.rid, None)
        if worker in self.inflight:
            self.inflight[worker] -= 1

    def send(self, req: api.Request, worker: str, reasons: str = "") -> api.Decision:
        self.inflight[worker] += 1
        self._sent[req.rid] = worker
        return decision(worker, reasons)

    def no_worker(self) -> api.Rejection:
        return api.Rejection(api.RejectReason.NO_WORKER, 1.0, reasons="no workers")


class RandomRouter(InFlightRouter):
    def __init__(self, seed: int = 0):
        super().__init__()
        self.rng = random.Random(seed)

    def route(self, req: api.Request, now_s: float) -> Union[api.Decision, api.Rejection]:
        if not self.workers:
            return self.no_worker()
        return self.send(req, self.rng.choice(self.workers))


class RoundRobinRouter(InFlightRouter):
    def __init__(self) -> None:
        super().__init__()
        self.next = 0

    def route(self, req: api.Request, now_s: float) -> Union[api.Decision, api.Rejection]:
        if not self.workers:
            return self.no_worker()
        worker = self.workers[self.next % len(self.workers)]
        self.next += 1
        return self.send(req, worker)


class LeastLoadRouter(InFlightRouter):
    """The worker with the fewest requests in flight; ties go round-robin (a rotating start),
    so an idle fleet is used evenly."""

    def __init__(self) -> None:
        super().__init__()
        self.turn = 0

    def least_loaded(self) -> str:
        ws, n = self.workers, len(self.workers)
        start = self.turn % n
        self.turn += 1
        return min((ws[(start + k) % n] for k in range(n)), key=self.inflight.__getitem__)

    def route(self, req: api.Request, now_s: float) -> Union[api.Decision, api.Rejection]:
        if not self.workers:
            return self.no_worker()
        return self.send(req, self.least_loaded())


class LengthCapRouter(LeastLoadRouter):
    """The admission control: least-load, rejecting a request when the prompt work queued on
    its worker plus its own, all priced as cold prefills (``perf.prefill_s`` of each prompt,
    no cache), exceeds ``slack`` x its TTFT SLO. Cache-blind: whatever the worker holds, a
    prompt counts in full, so a long prompt is capped at the same SLO the core works to."""

    def __init__(self, perf: PerfModel, slack: float = 1.0, default_slo_s: float = 5.0):
        super().__init__()
        self.perf, self.slack, self.default_slo_s = perf, slack, default_slo_s
        self.queued_s: dict[str, float] = {}            # worker -> cold prefill s not started
        self._cost: dict[str, float] = {}               # rid -> its cold prefill s

    def add_worker(self, spec: api.WorkerSpec) -> None:
        super().add_worker(spec)
        self.queued_s[spec.name] = 0.0

    def remove_worker(self, name: str) -> None:
        super().remove_worker(name)
        self.queued_s.pop(name, None)

    def observe_started(self, started: api.Started) -> None:
        cost = self._cost.pop(started.rid, 0.0)
        if started.worker in self.queued_s:
            self.queued_s[started.worker] = max(0.0, self.queued_s[started.worker] - cost)

    def route(self, req: api.Request, now_s: float) -> Union[api.Decision, api.Rejection]:
        if not self.workers:
            return self.no_worker()
        worker = self.least_loaded()
        cost = self.perf.prefill_s(req.prompt_tokens)
        predicted = self.queued_s[worker] + cost
        slo = req.ttft_slo_s if req.ttft_slo_s is not None else self.default_slo_s
        if predicted > self.slack * slo:
            why = f"cold prefill {predicted:.2f} s > {self.slack} x {slo:.2f}"
            return api.Rejection(api.RejectReason.TTFT_SLO, retry_after_s=self.queued_s[worker],
                                 reasons=why)
        self.queued_s[worker] += cost
        self._cost[req.rid] = cost
        return self.send(req, worker)
