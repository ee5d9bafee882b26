"""``hicache-mc conductor``: an OpenAI-compatible HTTP router in front of SGLang workers that
sends each request where its predicted TTFT is lowest (the scheduling core, core.py).

Endpoints (what SGLang's router serves, and the conductor's own):

- ``POST /v1/chat/completions``, ``/v1/completions``, ``/generate``: routed, answered with the
  worker's bytes (SSE passed through unchanged) and ``X-Conductor-Worker`` /
  ``X-Conductor-Predicted-TTFT`` headers; ``429`` + ``Retry-After`` when the request would
  miss its SLO (dispatch.py);
- ``GET /v1/models`` (a healthy worker's), ``/health`` (the conductor runs), ``/ready`` (a
  request can be routed: a worker, or a prefill and a decode worker, in the rotation),
  ``/metrics`` (metrics.py);
- ``POST /query``, ``/query_by_hash``: residency per worker and tier (query.py);
- the admin API (only with ``admin_key``, as ``Authorization: Bearer``): ``GET /workers``,
  ``POST /workers`` (``{"url", "name"?, "role"?, "events"?, "replay"?, "bootstrap_port"?}``),
  ``DELETE /workers/{name}``; SGLang's router's ``POST /add_worker?url=``,
  ``POST /remove_worker?url=`` and ``GET /list_workers`` too.

Every request body is read under ``max_body`` and a deadline; ``max_inflight`` bounds the
requests in progress (``503`` beyond). With ``api_key`` set, the generation and query
endpoints want it as a bearer token. Everything runs on one asyncio loop (uvloop when
installed): the router, the fleet's pollers and event streams, and the relays.
"""
from __future__ import annotations

import asyncio
import hmac
import logging
import socket
import time
from dataclasses import asdict
from typing import Optional

import aiohttp
import orjson
import zmq.asyncio
from aiohttp import web

from ..config import ConductorServerConfig
from . import query
from .api import Role, WorkerSpec
from .chain import Chain
from .dispatch import Dispatcher, error_response
from .intake import BadRequest, Kind, read
from .metrics import Metrics, gauge
from .pd import PDRelay
from .prompts import PromptTokenizer
from .proxy import TooLarge, read_capped
from .workers import Fleet, Hooks, WorkerConfig

log = logging.getLogger(__name__)

BODY_DEADLINE_S = 30.0         # a client that has not sent its whole body by then is cut off


def make_router(config: ConductorServerConfig, l3):
    """The scheduling core, configured from the server's settings."""
    from .core import Admission, Conductor, ConductorConfig
    return Conductor(l3, ConductorConfig(
        ttft_slo_s=config.ttft_slo_s, tbt_slo_s=config.tbt_slo_s,
        admission=Admission(config.admission), slo_tolerance=config.slo_tolerance,
        work_weight=config.work_weight, triage=config.triage, max_blocks=config.index_blocks))


def configured_workers(config: ConductorServerConfig) -> list[WorkerConfig]:
    """The workers of the settings: comma-separated ``[NAME=]URL`` (prefill ones
    ``[NAME=]URL [BOOTSTRAP_PORT]``)."""
    out = []
    for text, role in ((config.worker_urls, None), (config.prefill_urls, Role.PREFILL),
                       (config.decode_urls, Role.DECODE)):
        for item in filter(None, (x.strip() for x in text.split(","))):
            url, _, port = item.partition(" ")
            name, eq, rest = url.partition("=")
            if eq and "/" not in name and ":" not in name:
                url = rest
            else:
                name = ""
            out.append(WorkerConfig(url, name=name, role=role,
                                    bootstrap_port=int(port) if port.strip() else None))
    return out


class ConductorServer:
    def __init__(self, config: ConductorServerConfig, router=None,
                 prompts: Optional[PromptTokenizer] = None):
        self.config = config
        self.prompts = prompts or (PromptTokenizer(config.tokenizer) if config.tokenizer else None)
        self.l3 = None
        if config.l3_master:
            from .l3 import L3View
            self.l3 = L3View(config.l3_master, config.l3_namespace, config.token,
                             tuple(p.strip() for p in config.l3_parts.split(",") if p.strip()))
        self.router = router if router is not None else make_router(config, self.l3)
        self.dispatcher = Dispatcher(self)
        self.pd = PDRelay(self)
        self.timeout = aiohttp.ClientTimeout(total=config.request_timeout_s, sock_connect=2.0)
        self.inflight = 0
        self.session: Optional[aiohttp.ClientSession] = None
        self.fleet: Optional[Fleet] = None
        self.runner: Optional[web.AppRunner] = None
        self.port = 0
        self.metrics = Metrics(self._state)

    # ------------------------------------------------------------------ lifecycle

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.max_body)
        r = app.router
        for kind in Kind:
            r.add_post(kind.value, lambda req, k=kind: self.generation(req, k))
        r.add_get("/v1/models", self.models)
        r.add_get("/health", self.health)
        r.add_get("/ready", self.ready)
        r.add_get("/metrics", self.metrics_page)
        r.add_post("/query", lambda req: self.query(req, False))
        r.add_post("/query_by_hash", lambda req: self.query(req, True))
        r.add_get("/workers", self.list_workers)
        r.add_get("/list_workers", self.list_workers)
        r.add_post("/workers", self.add_worker)
        r.add_post("/add_worker", self.add_worker)
        r.add_delete("/workers/{name}", self.remove_worker)
        r.add_post("/remove_worker", self.remove_worker)
        return app

    async def start(self, sock: Optional[socket.socket] = None) -> int:
        """Serve on ``sock`` (or the configured host and port); the port it serves on."""
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300), auto_decompress=False)
        c = self.config
        template = WorkerSpec("", page_tokens=c.page_size, page_bytes=c.kv_bytes_per_token,
                              host_bw=c.host_bw, l3_bw=c.l3_bw)
        hooks = Hooks(self.router.add_worker, self.router.remove_worker,
                      self.router.observe_events, self.router.observe_load)
        self.fleet = Fleet(self.session, zmq.asyncio.Context.instance(), hooks, template,
                           c.poll_s, c.stall_s)
        for wc in configured_workers(c):
            await self.fleet.add(wc)
        self.runner = web.AppRunner(self.app(), access_log=None, handle_signals=False,
                                    shutdown_timeout=c.shutdown_grace_s)
        await self.runner.setup()
        if sock is None:
            sock = socket.socket(socket.AF_INET6 if ":" in c.host else socket.AF_INET)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((c.host, c.port))
        self.port = sock.getsockname()[1]
        await web.SockSite(self.runner, sock, backlog=1024).start()
        log.info("conductor on http://%s:%d: %d workers, %s", c.host, self.port,
                 len(self.fleet.workers), "tokenizer " + c.tokenizer if self.prompts else
                 "no tokenizer (routing on load)")
        return self.port

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
        if self.fleet is not None:
            await self.fleet.close()
        if self.session is not None:
            await self.session.close()
        if self.l3 is not None:
            self.l3.close()

    # ------------------------------------------------------------------ generation

    async def generation(self, request: web.Request, kind: Kind) -> web.StreamResponse:
        arrived = time.monotonic()
        denied = self._auth(request, self.config.api_key)
        if denied is not None:
            return denied
        if self.inflight >= self.config.max_inflight:
            return error_response(503, "the conductor is at its limit of requests in progress",
                                  "service_unavailable", {"Retry-After": "1"})
        self.inflight += 1
        try:
            try:
                body = await asyncio.wait_for(request.read(), BODY_DEADLINE_S)
                intake = read(kind, orjson.loads(body), request.headers, self.prompts,
                              self.fleet.page_size, self._held)
            except web.HTTPRequestEntityTooLarge:
                return error_response(413, f"the body is over {self.config.max_body} bytes",
                                      "invalid_request_error")
            except asyncio.TimeoutError:
                return error_response(408, "the body did not arrive in time", "invalid_request_error")
            except (orjson.JSONDecodeError, BadRequest) as exc:
                return error_response(400, str(exc), "invalid_request_error")
            if intake.tokens is None:
                self.metrics.unroutable.labels(intake.unroutable[:40]).inc()
            return await self.dispatcher.run(request, kind, body, intake, arrived)
        finally:
            self.inflight -= 1

    def _held(self, c: Chain) -> int:
        """Leading pages of ``c`` that some worker (L1 or L2) or the L3 holds."""
        index = getattr(self.router, "index", None)
        best = max((p.gpu + p.host for p in index.prefixes(c.block_hashes).values()), default=0) \
            if index is not None else 0
        if self.l3 is not None and best < len(c.page_hashes):
            best = max(best, self.l3(c.page_hashes))
        return best

    # ------------------------------------------------------------------ info

    async def models(self, request: web.Request) -> web.Response:
        for w in self.fleet.healthy():
            try:
                async with self.session.get(w.config.url + "/v1/models",
                                            timeout=aiohttp.ClientTimeout(total=5)) as resp:
                    if resp.status == 200:
                        return web.Response(body=await read_capped(resp.content, 1 << 20),
                                            content_type="application/json")
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError, TooLarge):
                continue
        return error_response(503, "no worker answers /v1/models", "service_unavailable")

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def ready(self, request: web.Request) -> web.Response:
        roles = {w.spec.role for w in self.fleet.healthy()}
        ok = Role.BOTH in roles or {Role.PREFILL, Role.DECODE} <= roles
        return web.Response(status=200 if ok else 503,
                            text="ready\n" if ok else "no worker (or PD pair) in the rotation\n")

    async def metrics_page(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(),
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    def _state(self):
        """The fleet's and the index's state, for a scrape (on the loop)."""
        workers = list(self.fleet.workers.values()) if self.fleet else []
        yield gauge("worker_healthy", "1 while the worker is in the rotation", ["worker"],
                    [(w.name, w.healthy) for w in workers])
        yield gauge("worker_events_live", "1 while the worker's KV-event stream is live",
                    ["worker"], [(w.name, bool(w.stream and w.stream.live)) for w in workers])
        loads = [(w.name, w.load) for w in workers if w.load is not None]
        for field in ("waiting_reqs", "waiting_tokens", "running_reqs", "running_tokens", "kv_usage"):
            yield gauge("worker_" + field, f"The worker's last load report: {field}", ["worker"],
                        [(n, getattr(r, field)) for n, r in loads])
        streams = [(w.name, asdict(w.stream.counters)) for w in workers if w.stream is not None]
        for field in ("batches", "gaps", "lost", "stalls", "malformed", "restarts"):
            yield gauge("events_" + field, f"KV-event stream: {field} (this stream's life)",
                        ["worker"], [(n, c[field]) for n, c in streams])
        index = getattr(self.router, "index", None)
        if index is not None:
            mem = index.memory()
            yield gauge("index_blocks", "Blocks in the block index", [], [(mem.blocks,)])
            yield gauge("index_bytes", "Bytes the block index holds", [], [(mem.bytes,)])
            yield gauge("index_bytes_per_block", "Bytes per block of the block index", [],
                        [(mem.bytes_per_block,)])
        yield gauge("inflight", "Requests in progress", [], [(self.inflight,)])
        if self.prompts is not None:
            yield gauge("prompt_cache", "Prompt pieces encoded (miss) or found encoded (hit)",
                        ["result"], [("hit", self.prompts.hits), ("miss", self.prompts.misses)])
        if self.l3 is not None:
            yield gauge("l3_lookups", "L3 lookups answered by the view, or 0 while it was out "
                        "of sync", ["result"], [("answered", self.l3.answers),
                                                ("unsynced", self.l3.unsynced)])

    async def query(self, request: web.Request, by_hash: bool) -> web.Response:
        denied = self._auth(request, self.config.api_key)
        if denied is not None:
            return denied
        try:
            body = await asyncio.wait_for(request.read(), BODY_DEADLINE_S)
            blocks, pages, inst = query.parse(orjson.loads(body), by_hash, self.fleet.page_size)
        except (orjson.JSONDecodeError, query.QueryError) as exc:
            return error_response(400, str(exc), "invalid_request_error")
        except web.HTTPRequestEntityTooLarge:
            return error_response(413, "the body is too large", "invalid_request_error")
        except asyncio.TimeoutError:
            return error_response(408, "the body did not arrive in time", "invalid_request_error")
        index = self.router.index
        names = [w.name for w in self.fleet.healthy() if w.spec.role is not Role.DECODE
                 and index.visible(w.name) and (inst is None or w.name == inst)]
        l3 = self.l3(pages) if self.l3 is not None and pages is not None else None
        doc = query.answer(index.prefixes(blocks), names, l3, self.fleet.page_size)
        return web.Response(body=orjson.dumps(doc), content_type="application/json")

    # ------------------------------------------------------------------ admin

    def _auth(self, request: web.Request, key: str) -> Optional[web.Response]:
        if not key:
            return None
        given = request.headers.get("Authorization", "")
        if given.startswith("Bearer ") and hmac.compare_digest(given[7:].encode(), key.encode()):
            return None
        return error_response(401, "a valid bearer token is required", "authentication_error")

    def _admin(self, request: web.Request) -> Optional[web.Response]:
        if not self.config.admin_key:
            return error_response(403, "the admin API is off (set admin_key)", "permission_error")
        return self._auth(request, self.config.admin_key)

    async def list_workers(self, request: web.Request) -> web.Response:
        denied = self._admin(request)
        return denied or web.Response(body=orjson.dumps(
            {"workers": [w.describe() for w in self.fleet.workers.values()]}),
            content_type="application/json")

    async def add_worker(self, request: web.Request) -> web.Response:
        denied = self._admin(request)
        if denied is not None:
            return denied
        try:
            doc = dict(request.query) if request.query.get("url") else \
                orjson.loads(await asyncio.wait_for(request.read(), BODY_DEADLINE_S))
            wc = _worker_config(doc)
            w = await self.fleet.add(wc)
        except (ValueError, TypeError, KeyError, asyncio.TimeoutError) as exc:
            return error_response(400, f"cannot add that worker: {exc}", "invalid_request_error")
        return web.Response(body=orjson.dumps(w.describe()), content_type="application/json")

    async def remove_worker(self, request: web.Request) -> web.Response:
        denied = self._admin(request)
        if denied is not None:
            return denied
        name = request.match_info.get("name") or ""
        url = request.query.get("url", "")
        if url:
            name = next((w.name for w in self.fleet.workers.values()
                         if w.config.url == url.rstrip("/")), "")
        if not await self.fleet.remove(name):
            return error_response(404, f"no worker {name or url!r}", "not_found_error")
        return web.Response(body=orjson.dumps({"removed": name}), content_type="application/json")


def _worker_config(doc) -> WorkerConfig:
    if not isinstance(doc, dict) or not isinstance(doc.get("url"), str):
        raise ValueError("expected {\"url\": ..., ...}")
    role = doc.get("role") or doc.get("worker_type")
    port = doc.get("bootstrap_port")
    return WorkerConfig(doc["url"], name=str(doc.get("name") or ""),
                        role=Role(role) if role in ("prefill", "decode", "both") else None,
                        events=str(doc.get("events") or ""), replay=str(doc.get("replay") or ""),
                        bootstrap_port=int(port) if port not in (None, "") else None)
