"""One generation request from decision to answer: route, relay, observe; retry elsewhere
what a worker failed before it started.

1. The router decides (``route``): a worker with the predicted TTFT, or a rejection. A
   rejection for an SLO is ``429`` with ``Retry-After`` and an OpenAI-style error body; no
   worker at all is ``503``.
2. The request goes to the worker (``proxy.relay``; ``pd.relay`` in PD mode), its answer to
   the client with ``X-Conductor-Worker`` and ``X-Conductor-Predicted-TTFT`` (seconds).
3. A worker that failed the request before the client saw a byte leaves the rotation and the
   request is routed again (at most ``retries`` times); one that failed after is reported in
   the stream itself (proxy.py).
4. The router observes the first bytes (``Started``; for a non-streaming request, its
   predicted TTFT after sending it) and the end (``Finished``, with the usage the answer
   reported); the worker's event stream is told to expect events when the request had prompt
   pages the router did not know the worker held.
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from typing import Optional

import orjson
from aiohttp import web

from . import proxy, reach, usage
from .api import Decision, Finished, Rejection, RejectReason, Request, Started, Tier
from .intake import Intake, Kind
from .proxy import Outcome, Relayed

log = logging.getLogger(__name__)


def error_response(status: int, message: str, type_: str, headers: Optional[dict] = None) -> web.Response:
    """An OpenAI-style error: ``{"error": {"message", "type", "param", "code"}}``."""
    return web.json_response({"error": {"message": message, "type": type_, "param": None,
                                        "code": status}}, status=status, headers=headers,
                             dumps=lambda d: orjson.dumps(d).decode())


def rejection_response(rej: Rejection) -> web.Response:
    retry = str(max(1, math.ceil(rej.retry_after_s)))
    if rej.reason is RejectReason.NO_WORKER:
        return error_response(503, "no worker can take this request now: " + (rej.reasons or
                              "none in the rotation"), "service_unavailable", {"Retry-After": retry})
    return error_response(429, "the request would miss its latency SLO: " + rej.reasons,
                          "rate_limit_exceeded", {"Retry-After": retry})


class Dispatcher:
    """Runs requests against the router and the fleet (both owned by the server)."""

    def __init__(self, server):
        self.s = server

    async def run(self, request: web.Request, kind: Kind, body: bytes, intake: Intake,
                  arrived: float) -> web.StreamResponse:
        s = self.s
        rid = uuid.uuid4().hex
        req = Request(rid, arrived, intake.prompt_tokens, intake.page_hashes,
                      intake.max_new_tokens, intake.ttft_slo_s, intake.tbt_slo_s,
                      intake.block_hashes)
        headers = proxy.forward_headers(request)
        tried: list[str] = []
        for attempt in range(1 + s.config.retries):
            decision = s.router.route(req, time.monotonic())
            if isinstance(decision, Rejection):
                if decision.reason is not RejectReason.NO_WORKER:
                    s.metrics.rejections.labels(decision.reason.value).inc()
                log.debug("reject %s: %s", rid, decision.reasons)
                if tried:
                    return error_response(502, f"the request failed on {', '.join(tried)} before "
                                          "it started, and no other worker can take it",
                                          "worker_failed")
                return rejection_response(decision)
            if attempt == 0:
                s.metrics.overhead.observe(time.monotonic() - arrived)
                if intake.rest:       # what routing did not need, encoded while the worker works
                    reach.warm(s.prompts, intake.rest, asyncio.get_running_loop())
            self._log(rid, decision)
            timer = None if intake.stream else asyncio.get_running_loop().call_later(
                decision.prediction.ttft_s, self._started, decision, req, None)
            try:
                r = await self._relay(request, kind, body, headers, decision, req)
            finally:
                if timer is not None:
                    timer.cancel()
            if r.outcome is not Outcome.NOT_STARTED:
                self._finished(kind, decision, req, r)
                return r.response if r.response is not None else web.Response(status=499)
            tried.append(decision.worker)
            s.metrics.retries.labels(decision.worker).inc()
            log.warning("request %s: worker %s failed it before it started (%s); routing it again",
                        rid, decision.worker, r.error)
            s.fleet.failed(r.worker or decision.worker, r.error)
            s.router.observe_finished(Finished(decision.worker, rid, time.monotonic(), req.prompt_tokens,
                                               0, {}, math.nan, ok=False))
        return error_response(502, f"the request failed on {', '.join(tried)} before it started",
                              "worker_failed")

    def _log(self, rid: str, d: Decision) -> None:
        s = self.s
        p = d.prediction
        s.metrics.decisions.labels(d.worker).inc()
        if d.late:
            s.metrics.late.labels(d.worker).inc()
        s.metrics.predicted.labels(d.worker).observe(p.ttft_s)
        for tier, pages in p.pages.items():
            s.metrics.predicted_pages.labels(Tier(tier).name).inc(pages)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("route %s -> %s%s: ttft %.4fs = queue %.4f + fetch %.4f + prefill %.4f, "
                      "pages %s, recompute %d, tbt %.4fs; %s", rid, d.worker,
                      f" (decode {d.decode_worker})" if d.decode_worker else "", p.ttft_s,
                      p.queue_s, p.fetch_s, p.prefill_s,
                      {Tier(t).name: n for t, n in p.pages.items()}, p.recompute_pages, p.tbt_s,
                      d.reasons)

    async def _relay(self, request, kind: Kind, body: bytes, headers: dict, d: Decision,
                     req: Request) -> Relayed:
        s = self.s
        extra = {"X-Conductor-Worker": d.worker, "X-Conductor-Request-Id": req.rid,
                 "X-Conductor-Predicted-TTFT": f"{d.prediction.ttft_s:.4f}"}
        sent = time.monotonic()
        on_first = lambda at: self._started(d, req, at, sent)      # noqa: E731
        if d.decode_worker is not None:
            extra["X-Conductor-Decode-Worker"] = d.decode_worker
            return await s.pd.relay(request, kind, body, headers, extra, d, on_first)
        w = s.fleet.get(d.worker)
        if w is None:
            return Relayed(Outcome.NOT_STARTED, error="left the fleet", worker=d.worker)
        return await proxy.relay(s.session, request, d.worker, w.config.url + kind.value, body,
                                 headers, extra, s.timeout, on_first)

    def _started(self, d: Decision, req: Request, at: Optional[float], sent: float = 0.0) -> None:
        """A streamed answer's first bytes (``at``); for an answer that comes whole, the
        predicted first token (``None``): the router's clock of the worker's queue moves on
        as it predicted, rather than counting the request as queued until it ends."""
        self.s.router.observe_started(Started(d.worker, req.rid, time.monotonic() if at is None else at))
        if at is not None:
            self._expect(d, req, sent)

    def _expect(self, d: Decision, req: Request, sent: float) -> None:
        """The worker has computed the prompt: the events of pages the router did not know it
        held are due now."""
        known = sum(d.prediction.pages.get(t, 0) for t in (Tier.GPU, Tier.HOST))
        if len(req.page_hashes) > known:
            stream = self.s.fleet.stream(d.worker)
            if stream is not None:
                stream.expect(sent)

    def _finished(self, kind: Kind, d: Decision, req: Request, r: Relayed) -> None:
        s = self.s
        now = time.monotonic()
        u = usage.parse(r.tail, r.streamed) if r.outcome is Outcome.DONE else None
        ttft = (r.first_s - r.sent_s) if r.streamed and r.first_s is not None else \
            (u.worker_ttft_s if u is not None and u.worker_ttft_s is not None else math.nan)
        if not math.isnan(ttft):
            s.metrics.actual.labels(d.worker).observe(ttft)
            s.metrics.error.observe(ttft - d.prediction.ttft_s)
        cached: dict = {}
        if u is not None:
            s.metrics.prompt_tokens.inc(u.prompt_tokens)
            for tier, n in u.cached.items():
                s.metrics.cached_tokens.labels(tier if isinstance(tier, str) else tier.name).inc(n)
                cached[Tier.GPU if tier == usage.UNSPLIT else tier] = \
                    cached.get(Tier.GPU if tier == usage.UNSPLIT else tier, 0) + n
        ok = r.outcome is Outcome.DONE and r.status < 400
        if ok and not r.streamed:
            self._expect(d, req, r.sent_s)
        s.router.observe_finished(Finished(
            d.worker, req.rid, now, u.prompt_tokens if u else req.prompt_tokens,
            u.completion_tokens if u else 0, cached, ttft, ok=ok))
        s.metrics.requests.labels(kind.value, r.outcome.value).inc()
        if r.outcome is Outcome.FAILED:
            s.fleet.failed(r.worker or d.worker, r.error)
