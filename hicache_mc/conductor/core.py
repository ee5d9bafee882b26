"""The Conductor: KVCache-centric scheduling (Mooncake FAST'25, Algorithm 1) as an api.Router.

Per request, for every prefill-capable worker ``w`` (one pass over the chain for all of them,
index.py):

    TTFT(w) = max(queue(w), l3_fetch(w)) + load(w) + prefill(w)

- ``queue``: load.py (the last load report plus what this router sent since; the wait for
  room in the GPU pool), scaled by what queued requests measured against their prediction;
- the prefix ``w`` can use: its L1 pages, then its L2 pages, then the pages the shared L3
  holds beyond those (the residency view: one lookup per request, shared by all workers);
  pages this router sent to ``w`` in requests not yet reported count as L1 (pending.py);
- pull or recompute, per worker and tier: the TTFT with the prefix cut after L1, after L2
  and after L3, the lowest kept (with prefill concave in the cached length and fetch linear
  in it, one of these cuts is the optimum);
- ``l3_fetch``, ``load`` and ``prefill``: model.py. SGLang prefetches L3 pages while the
  request waits, so that part hides under the queue; the L2 -> L1 load is at admission.

The request goes to the lowest ``score = TTFT + work_weight x queue(w) / mean work x work``,
``work`` being the GPU time it costs there (its load and compute): a request's work delays
every request that will queue behind it, about ``queue / mean work`` of them, so at an idle
worker the score is the TTFT (Algorithm 1 as written, ``work_weight = 0``) and past the knee
it keeps a prefix where it is cheapest. Ties go to the smaller decode batch, then in turn.

Triage (admission off): a request the queues make late on every worker (its fastest TTFT,
judged at the recent prediction errors, over its SLO, and over ``triage_share`` of it as
predicted; on an idle worker it would be on time) goes to the longest queue: late anywhere,
there it holds up no request that could still be on time.

Admission (admission.py): ``OFF``, ``EARLY`` (the predicted TTFT and the current decode
batch's TBT against the request's SLOs), ``PREDICTIVE`` (the TBT of the decode batch predicted
for when its prefill ends). A candidate that misses makes way for the next best (up to
``ADMISSION_CANDIDATES``); a turn continuing a rejected one gets the cascade margin.

PD mode: ``Role.PREFILL`` workers are candidates for the prefill; the decode worker is the
``Role.DECODE`` worker with the lowest predicted TBT; a rejection checks both.

With ``l3_aware=False`` the core ignores the shared L3 (the paper's local cache-aware variant).
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace
from typing import NamedTuple, Optional, Sequence, Union

from .admission import Admission, Gate
from .api import (Decision, Event, Finished, L3Lookup, LoadReport, Prediction, RejectReason,
                  Rejection, Request, Role, Started, Tier, WorkerSpec)
from .chain import block_hash
from .index import MAX_BLOCKS, BlockIndex, Prefix
from .load import LOST_AFTER_S, REPORT_STALE_S, SPT_EMA, InFlight, WorkerLoad
from .pending import PendingIndex
from .model import DECODE_PRIOR, PREFILL_PRIOR, DecodeModel, Overlap, Paths, PrefillModel

ADMISSION_CANDIDATES = 4      # workers tried, best score first, before a request is rejected
OUT_TOKENS_EMA = 0.05         # weight of the newest finished request in the expected output
UNQUEUED_FRACTION = 0.05      # a TTFT is a prefill sample if its queue was predicted under this
CALIBRATE_MIN_QUEUE_S = 0.05  # queues shorter than this say little about the queue model's scale
MAX_QUEUE_SCALE = 4.0         # one request moves the scale by at most this ratio's share
QUEUE_SCALE_EMA = 0.05        # geometric: the last ~20 queued requests set the scale


@dataclass(frozen=True)
class ConductorConfig:
    ttft_slo_s: float = 2.0               # for requests that carry no SLO of their own
    tbt_slo_s: float = 0.1
    admission: Admission = Admission.OFF
    slo_tolerance: float = 0.0            # reject above SLO x (1 + tolerance)
    cascade_tolerance: float = 1.0        # the same for a turn after a rejected one (admission.py)
    error_quantile: float = 0.95          # judge TTFTs at this quantile of measured / predicted
    l3_aware: bool = True                 # False: the paper's local cache-aware variant
    overlap: Overlap = Overlap.NONE
    work_weight: float = 2.0              # 0: Algorithm 1 as written
    triage: bool = True                   # admission off: late everywhere -> the longest queue
    # triage trusts a prediction under this share of the SLO whatever the recent errors (the
    # ablations sweep it: docs/conductor.md)
    triage_share: float = 0.5
    inflight: bool = True                 # count prefixes sent and not yet reported (pending.py)
    kv_room: bool = True                  # a queue waits for room in the GPU pool (load.py)
    calibrate: bool = True                # scale predicted queues by the waits requests met
    max_blocks: int = MAX_BLOCKS
    report_stale_s: float = REPORT_STALE_S
    out_tokens: float = 256.0             # expected output tokens before any request finished
    prefill_prior: tuple = PREFILL_PRIOR  # model.py: generic priors the online fits start from
    decode_prior: tuple = DECODE_PRIOR


class _Worker:
    __slots__ = ("spec", "name", "paths", "load", "pos", "kind", "prefills")

    def __init__(self, spec: WorkerSpec, stale_s: float, pos: int, kind: int):
        self.spec, self.name, self.paths, self.pos = spec, spec.name, Paths.of(spec), pos
        self.kind = kind              # workers of one kind (paths, page size) cost the same
        self.prefills = spec.role is not Role.DECODE
        self.load = WorkerLoad(stale_s, spec.l1_pages * spec.page_tokens)


class _Sent(NamedTuple):
    prefill: str
    decode: Optional[str]
    prediction: Prediction
    blocks: Sequence[int]         # the pages it will leave cached on its prefill worker
    at_s: float
    raw_queue_s: float            # the queue predicted before calibration


class _Scored(NamedTuple):
    score: float
    batch: float                  # ties: the smaller decode batch, then in turn
    turn: int
    worker: str
    queue_s: float
    ttft_s: float                 # the predicted TTFT there
    cost: "_Cost"


class Conductor:
    """See the module docstring. Not thread-safe: one caller at a time."""

    def __init__(self, l3: Optional[L3Lookup] = None, config: ConductorConfig = ConductorConfig()):
        self.config = config
        self.l3 = l3 if config.l3_aware else None
        self.index = BlockIndex(config.max_blocks)
        self.pending = PendingIndex()
        self.gate = Gate(config.admission, config.slo_tolerance, config.cascade_tolerance,
                         config.ttft_slo_s, config.tbt_slo_s, quantile=config.error_quantile)
        self.prefill_model = PrefillModel(config.prefill_prior)
        self.decode_model = DecodeModel(config.decode_prior)
        self.out_tokens = config.out_tokens
        self._workers: dict[str, _Worker] = {}
        self._sent: dict[str, _Sent] = {}
        self._turn = itertools.count()
        self._kinds: dict = {}
        self._blocks: Sequence[int] = ()    # the chain of the request being routed
        self._cached_any = 0                # its leading pages held by some cache
        self._spt = self.prefill_model.predict(1000, 0) / 1000   # fleet seconds per prompt token
        self._work = self.prefill_model.predict(1000, 0)          # fleet GPU seconds per request
        self.queue_scale = 1.0        # measured wait / predicted queue, recent requests

    # ------------------------------------------------------------ the fleet

    def add_worker(self, spec: WorkerSpec) -> None:
        self.remove_worker(spec.name)
        kind = self._kinds.setdefault((Paths.of(spec), spec.page_tokens), len(self._kinds))
        self._workers[spec.name] = _Worker(spec, self.config.report_stale_s, len(self._workers),
                                           kind)
        self.index.add_worker(spec.name)
        self.pending.add_worker(spec.name)

    def remove_worker(self, name: str) -> None:
        if self._workers.pop(name, None) is not None:
            self.index.remove_worker(name)
            self.pending.remove_worker(name)
            for pos, w in enumerate(self._workers.values()):
                w.pos = pos

    # ---------------------------------------------------------- observations

    def observe_events(self, events: Sequence[Event]) -> None:
        self.index.apply(events)

    def observe_load(self, report: LoadReport) -> None:
        w = self._workers.get(report.worker)
        if w is not None:
            w.load.report(report)
        self._expire(report.at_s)

    def _expire(self, now: float) -> None:
        """Forget requests whose Finished never came (their worker's load drops them too)."""
        while self._sent:
            rid, sent = next(iter(self._sent.items()))
            if now - sent.at_s <= LOST_AFTER_S:
                break
            del self._sent[rid]
            self.pending.remove(sent.prefill, sent.blocks)

    def observe_started(self, started: Started) -> None:
        sent = self._sent.get(started.rid)
        if sent is None:
            return
        for name in (sent.prefill, sent.decode):
            w = self._workers.get(name) if name else None
            if w is not None:
                w.load.started(started.rid, started.at_s, w.load.decode(started.at_s))

    def observe_finished(self, finished: Finished) -> None:
        sent = self._sent.pop(finished.rid, None)
        if sent is None:
            return
        self.pending.remove(sent.prefill, sent.blocks)
        ended = {}
        for name in (sent.prefill, sent.decode):
            w = self._workers.get(name) if name else None
            if w is not None:
                ended[name] = w.load.finished(finished.rid)
        if finished.ok:
            self._learn(finished, sent, ended.get(sent.decode or sent.prefill))

    def _learn(self, f: Finished, sent: _Sent, decoded: Optional[InFlight]) -> None:
        cached = sum(f.cached_tokens.values())
        new = f.prompt_tokens - cached
        p = sent.prediction
        if f.prefill_s is not None:
            self.prefill_model.observe(new, cached, f.prefill_s)
        elif p.queue_s <= UNQUEUED_FRACTION * f.ttft_s:
            self.prefill_model.observe(new, cached, f.ttft_s - p.queue_s - p.fetch_s)
        if math.isfinite(f.ttft_s):         # NaN: an answer without timings, nothing to judge by
            self.gate.observe(p.ttft_s, f.ttft_s)
            if self.config.calibrate and sent.raw_queue_s > CALIBRATE_MIN_QUEUE_S:
                compute = f.prefill_s if f.prefill_s is not None else p.prefill_s
                waited = f.ttft_s - compute - p.fetch_s
                ratio = min(MAX_QUEUE_SCALE, max(1 / MAX_QUEUE_SCALE, waited / sent.raw_queue_s))
                self.queue_scale *= (ratio / self.queue_scale) ** QUEUE_SCALE_EMA
        if decoded is not None and decoded.started_s is not None and f.completion_tokens > 1:
            tbt = (f.at_s - decoded.started_s) / (f.completion_tokens - 1)
            self.decode_model.observe(decoded.batch_at_start + 1,
                                      decoded.kv_at_start + f.prompt_tokens, tbt)
        self.out_tokens += OUT_TOKENS_EMA * (f.completion_tokens - self.out_tokens)

    # -------------------------------------------------------------- routing

    def predict(self, req: Request, now_s: float) -> list[Prediction]:
        """Every prefill candidate's prediction for ``req``, best score first (no side effect)."""
        return [_prediction(s) for s in self._score(req, now_s, 0)]

    def route(self, req: Request, now_s: float) -> Union[Decision, Rejection]:
        scored = self._score(req, now_s, next(self._turn))
        if not scored:
            return Rejection(RejectReason.NO_WORKER, 1.0, reasons="no prefill worker")
        gate, out = self.gate, self._expected_out(req)
        limits = gate.limits(req)
        late = min(s.ttft_s for s in scored) if gate.open and self.config.triage else None
        if late is not None and limits.queued_late(
                late, min(s.cost.l3_s + s.cost.load_s + s.cost.prefill_s for s in scored),
                self.config.triage_share):
            s = max(scored, key=lambda s: s.queue_s)
            p = _prediction(s)
            decode = self._decode_place(p, req, now_s, out)
            if decode is not None:
                return self._send(req, now_s, s, replace(p, tbt_s=decode[1]), decode[0], out,
                                  late=late)
        tried = []
        for s in scored[:1 if gate.open else ADMISSION_CANDIDATES]:
            p = _prediction(s)
            decode = self._decode_place(p, req, now_s, out)
            if decode is None:
                return Rejection(RejectReason.NO_WORKER, 1.0, p, "no decode worker")
            p = replace(p, tbt_s=decode[1])
            if gate.open or limits.met(p):
                return self._send(req, now_s, s, p, decode[0], out)
            tried.append((s, p, decode[0]))
        page = gate.continued(self._blocks)
        if page is not None:
            relaxed = gate.limits(req, self.config.cascade_tolerance)
            for s, p, decode in tried:
                if relaxed.met(p):
                    gate.admitted_cascade(page)
                    return self._send(req, now_s, s, p, decode, out)
        last = self._usable(req, tried[0][0].worker)
        if last > self._cached_any:                 # a page only this conversation has
            gate.remember(self._blocks[last - 1])
        return gate.reject(tried[0][1], limits, out)

    def _usable(self, req: Request, worker: str) -> int:
        """The request's whole pages SGLang can cache (it computes at least the last token)."""
        return max(0, (req.prompt_tokens - 1) // self._workers[worker].spec.page_tokens)

    def _expected_out(self, req: Request) -> float:
        return min(self.out_tokens, req.max_new_tokens) if req.max_new_tokens else self.out_tokens

    def _send(self, req: Request, now: float, s: _Scored, p: Prediction, decode: Optional[str],
              out: float, late: Optional[float] = None) -> Decision:
        """Dispatch; ``late``: the best TTFT, when the request was late everywhere (triage)."""
        # the GPU's work: the load and the compute (the L3 prefetch runs beside the queue)
        work = s.cost.load_s + s.cost.prefill_s
        if req.prompt_tokens > 0:
            self._spt += SPT_EMA * (work / req.prompt_tokens - self._spt)
        self._work += SPT_EMA * (work - self._work)
        self._workers[p.worker].load.dispatch(
            InFlight(req.rid, now, req.prompt_tokens, work, out), now)
        if decode is not None:
            self._workers[decode].load.dispatch(
                InFlight(req.rid, now, req.prompt_tokens, 0.0, out), now)
        blocks = ()
        if self.config.inflight:
            blocks = self._blocks[:self._usable(req, p.worker)]
            self.pending.add(p.worker, blocks)
        self._sent[req.rid] = _Sent(p.worker, decode, p, blocks, now, p.queue_s / self.queue_scale)
        if late is None:
            return Decision(p.worker, p, decode)
        return Decision(p.worker, p, decode, f"late everywhere (best TTFT {late:.3f}s): "
                        "the longest queue", late=True)

    def _decode_place(self, p: Prediction, req: Request, now: float,
                      out: float) -> Optional[tuple[Optional[str], float]]:
        """(decode worker or None for the prefill worker itself, predicted TBT there)."""
        w = self._workers[p.worker]
        if w.spec.role is Role.BOTH:
            return None, self._tbt(w, req, now, p.ttft_s)
        best = None
        for d in self._workers.values():
            if not d.prefills:
                tbt = self._tbt(d, req, now, p.ttft_s)
                if best is None or tbt < best[1]:
                    best = (d.spec.name, tbt)
        return best

    def _tbt(self, w: _Worker, req: Request, now: float, ttft: float) -> float:
        if self.config.admission is Admission.PREDICTIVE:
            tbt_now = self.decode_model.predict(*w.load.decode(now))
            load = w.load.decode_at(now, now + ttft, tbt_now)
        else:
            load = w.load.decode(now)
        return self.decode_model.predict(load.batch + 1, load.kv_tokens + req.prompt_tokens)

    def _score(self, req: Request, now: float, turn: int) -> list[_Scored]:
        blocks = req.block_hashes if req.block_hashes is not None else \
            [block_hash(h) for h in req.page_hashes]
        self._blocks = blocks
        prefixes = self.index.prefixes(blocks)
        l3_now = self.l3(req.page_hashes) if self.l3 is not None and req.page_hashes else 0
        pending = self.pending.lookup(blocks) if self.config.inflight else {}
        self._cached_any = max([l3_now, *pending.values(),
                                *(p.gpu + p.host for p in prefixes.values())])
        n, spt = len(self._workers) or 1, self._spt
        need = req.prompt_tokens + self._expected_out(req)
        scale = self.queue_scale
        # the work's cost to the requests that will queue behind it: about queue / mean work
        ww = self.config.work_weight / max(self._work, 1e-3)
        options: dict = {}                # workers of one kind with one prefix: same options
        kv_room, tbt_of, out = self.config.kv_room, self.decode_model.predict, []
        for w in self._workers.values():
            if not w.prefills:
                continue
            load = w.load
            queue = load.queue_s(now, spt)
            if kv_room and load.capacity:
                queue = max(queue, load.room_wait_s(now, need, tbt_of(*load.decode(now))))
            queue *= scale
            pre = prefixes.get(w.name, _NONE)
            if pending:
                pre = _with_pending(pre, pending.get(w.name, 0))
            opts = options.get((pre, w.kind))
            if opts is None:
                opts = options[pre, w.kind] = self._options(w, req.prompt_tokens, pre, l3_now)
            best, ttft = None, 0.0
            for c in opts:
                t = (queue if queue > c.l3_s else c.l3_s) + c.load_s + c.prefill_s
                if best is None or t < ttft:
                    best, ttft = c, t
            work = best.load_s + best.prefill_s
            out.append(_Scored(ttft + ww * queue * work, len(load.running), (w.pos - turn) % n,
                               w.name, queue, ttft, best))
        out.sort()
        return out

    def _options(self, w: _Worker, prompt: int, pre: Prefix, l3_pages: int) -> list["_Cost"]:
        """The prefix cut after L1, after L2 and after L3 on ``w``: pull or recompute."""
        pt = w.spec.page_tokens
        top = max(0, (prompt - 1) // pt)          # SGLang computes at least the last token
        g = min(pre.gpu, top)
        h = min(pre.gpu + pre.host, top) - g
        l3 = max(0, min(l3_pages, top) - g - h)
        predict = self.prefill_model.predict
        if not (h or l3):                         # nothing to pull: one option
            cached = g * pt
            return [_Cost(0.0, 0.0, predict(prompt - cached, cached), g, 0, 0, 0)]
        fetch, overlap, out = w.paths.fetch, self.config.overlap, []
        for hp, lp in ((0, 0), (h, 0), (h, l3)):
            cached = (g + hp + lp) * pt
            pre_s = predict(prompt - cached, cached)
            f = fetch(hp, lp, pre_s, overlap)
            out.append(_Cost(f.l3_s, f.load_s, pre_s, g, hp, lp, (h - hp) + (l3 - lp)))
        return out


class _Cost(NamedTuple):
    l3_s: float                   # L3 -> L2, under the queue wait
    load_s: float                 # L2 -> L1 on the critical path
    prefill_s: float
    gpu: int                      # pages used from each tier
    host: int
    l3: int
    recompute: int                # pages held somewhere but recomputed


def _prediction(s: _Scored) -> Prediction:
    c = s.cost
    pages = {t: n for t, n in ((Tier.GPU, c.gpu), (Tier.HOST, c.host), (Tier.L3, c.l3)) if n}
    fetch = s.ttft_s - s.queue_s - c.prefill_s           # what the fetch adds to the queue
    return Prediction(s.worker, s.ttft_s, s.queue_s, fetch, c.prefill_s, pages, c.recompute)


_NONE = Prefix(0, 0)


def _with_pending(pre: Prefix, pending: int) -> Prefix:
    """A worker's prefix with the pages it will hold when a request queued now runs: those
    sent to it in flight count as L1 (they are computed there before this request, FCFS)."""
    if pending <= pre.gpu:
        return pre
    return Prefix(pending, max(0, pre.gpu + pre.host - pending))
