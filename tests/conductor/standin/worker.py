"""A stand-in SGLang worker: SGLang's HTTP API over the simulated engine (engine.py).

It serves what the conductor and SGLang's router use: ``/generate``, ``/v1/completions``,
``/v1/chat/completions`` (streaming or not), ``/v1/models``, ``/health``,
``/health_generate``, ``/server_info`` (with SGLang's ``kv_events`` descriptor), ``/v1/loads``
(SGLang's own ``LoadSnapshot``) and ``/flush_cache``. PD roles follow SGLang's disaggregation:
a prefill worker answers after the first token; a decode worker given the same
``bootstrap_room`` waits for that prefill's KV before it decodes.

Test controls under ``/standin/``: ``evict`` (every page down one tier, host pages into the
L3), ``fail`` (answer every call with a status, 0 to stop), ``pause_events`` /
``resume_events`` (hold the KV events, then publish them), ``crash`` (close the port and reset
every connection, as a killed process would), ``sent/{tag}`` (the exact bytes answered to the
request that carried ``X-Standin-Tag: tag``) and ``stats``.
"""
from __future__ import annotations

import asyncio
import json
import socket
import time
import uuid
from typing import Optional

from aiohttp import web
from sglang.srt.disaggregation.kv_events import ZmqEventPublisher

from hicache_mc.conductor.perf import PerfModel

from . import formats as F
from .cache import L3Pages, PageCache
from .engine import Engine, Job, Speeds
from .prompts import Prompts


class StandinWorker:
    def __init__(self, name: str, prompts: Prompts, spec: dict, rooms: dict):
        self.name, self.prompts, self.spec, self.rooms = name, prompts, spec, rooms
        self.role = spec.get("role", "both")
        self.model = spec.get("model", "standin-model")
        self.page_size = spec.get("page_size", 16)
        l3 = L3Pages(spec["l3_master"], spec["l3_namespace"]) if spec.get("l3_master") else None
        self.cache = PageCache(self.page_size, spec.get("gpu_pages", 4096),
                               spec.get("host_pages", 0), l3)
        self.publisher = ZmqEventPublisher(0, "tcp://127.0.0.1:*", "tcp://127.0.0.1:*",
                                           buffer_steps=spec.get("buffer_steps", 10_000), bind=True)
        self.engine = Engine(self.cache, self.publisher, PerfModel(), spec.get("time_scale", 1.0),
                             Speeds(spec.get("host_bw", 20e9), spec.get("l3_bw", 10e9)),
                             chunk=spec.get("chunk", 8192))
        self.fail_status = 0
        self.sent: dict[str, bytes] = {}
        self.served = 0
        self.paired = 0                  # PD requests that named a bootstrap room
        self.live: set = set()           # transports of requests in progress
        self.runner: Optional[web.AppRunner] = None
        self.port = 0
        self.crashed = False

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        app = web.Application(client_max_size=256 << 20)
        r = app.router
        for path in ("/health", "/health_generate"):
            r.add_get(path, self.health)
        r.add_get("/v1/models", self.models)
        r.add_get("/server_info", self.server_info)
        r.add_get("/get_server_info", self.server_info)
        r.add_get("/v1/loads", self.loads)
        r.add_post("/generate", self.generate)
        r.add_post("/v1/completions", self.completions)
        r.add_post("/v1/chat/completions", self.chat)
        r.add_route("*", "/flush_cache", self.flush)
        r.add_post("/standin/evict", self.evict)
        r.add_post("/standin/fail", self.fail)
        r.add_post("/standin/pause_events", self.pause_events)
        r.add_post("/standin/resume_events", self.resume_events)
        r.add_post("/standin/crash", self.crash)
        r.add_get("/standin/sent/{tag}", self.sent_bytes)
        r.add_get("/standin/stats", self.stats)
        self.runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self.runner.setup()
        sock = socket.socket()
        sock.bind(("127.0.0.1", self.spec.get("port", 0)))
        self.port = sock.getsockname()[1]
        await web.SockSite(self.runner, sock).start()
        self.task = asyncio.ensure_future(self.engine.run())

    def describe(self) -> dict:
        src = self.publisher.describe_local_source(self.page_size)
        return {"name": self.name, "url": f"http://127.0.0.1:{self.port}", "role": self.role,
                "events": src["endpoint"], "replay": src["replay_endpoint"],
                "bootstrap_port": self.spec.get("bootstrap_port")}

    async def close(self) -> None:
        self.engine.stop()
        for t in list(self.live):
            t.abort()
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None
        self.publisher.shutdown()
        if self.cache.l3 is not None:
            self.cache.l3.close()

    # ------------------------------------------------------------------ info endpoints

    def _failing(self) -> Optional[web.Response]:
        if self.fail_status:
            return web.json_response(F.error(self.fail_status, "stand-in told to fail"),
                                     status=self.fail_status)
        return None

    async def health(self, request):
        return self._failing() or web.Response(text="")

    async def models(self, request):
        return web.json_response({"object": "list", "data": [
            {"id": self.model, "object": "model", "created": 0, "owned_by": "sglang",
             "root": self.model, "max_model_len": 131072}]})

    async def server_info(self, request):
        src = self.publisher.describe_local_source(self.page_size)
        host, _, port = src["endpoint"].rpartition(":")
        replay_port = src["replay_endpoint"].rpartition(":")[2]
        return web.json_response({
            "model_path": self.model, "served_model_name": self.model, "page_size": self.page_size,
            "disaggregation_mode": {"both": "null"}.get(self.role, self.role),
            "disaggregation_bootstrap_port": self.spec.get("bootstrap_port"), "version": "0.5.23",
            "kv_events": {"publisher": "zmq", "endpoint_host": host[len("tcp://"):],
                          "endpoint_port_base": int(port), "topic": "", "block_size": self.page_size,
                          "dp_size": 1, "replay_endpoint_port_base": int(replay_port)}})

    async def loads(self, request):
        return self._failing() or web.json_response({
            "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()),
            "version": "0.5.23", "accelerator": None, "num_accelerators": 1,
            "loads": [self.engine.load().to_dict()]})

    async def flush(self, request):
        self.engine.publish(self.cache.clear())
        return web.Response(text="Cache flushed.\n")

    # ------------------------------------------------------------------ generation

    async def generate(self, request):
        return await self._serve(request, "generate", self.prompts.generate)

    async def completions(self, request):
        return await self._serve(request, "text_completion", lambda b: self.prompts.text(b["prompt"]))

    async def chat(self, request):
        return await self._serve(request, "chat.completion", self.prompts.chat)

    async def _serve(self, request: web.Request, kind: str, tokenize):
        failing = self._failing()
        if failing is not None:
            return failing
        body = await request.json()
        tokens = tokenize(body)
        params = body.get("sampling_params") or {}
        max_new = body.get("max_tokens") or body.get("max_completion_tokens") \
            or params.get("max_new_tokens") or 16
        job = Job(rid=uuid.uuid4().hex, tokens=tokens, max_new=int(max_new))
        if self.role != "both" and body.get("bootstrap_room") is None:
            return web.json_response(F.error(400, f"a {self.role} worker needs bootstrap_room"),
                                     status=400)
        self._pd(job, body)
        self.served += 1
        self.engine.submit(job)
        out = F.Out(job.rid, body.get("model") or self.model, len(tokens), {}, [])
        self.live.add(request.transport)
        try:
            if body.get("stream"):
                return await self._stream(request, kind, job, out, body)
            while (token := await job.out.get()) is not None:
                self._grow(out, job, token)
            out.finished, out.e2e_s = True, time.monotonic() - job.arrival
            doc = {"generate": F.generate_doc, "text_completion": F.text_full,
                   "chat.completion": F.chat_full}[kind](out)
            if body.get("standin_pad"):           # a test's large answer (bytes of padding)
                doc["pad"] = "x" * int(body["standin_pad"])
            data = json.dumps(doc).encode()
            self._record(request, data)
            return web.Response(body=data, content_type="application/json")
        finally:
            self.live.discard(request.transport)
            self.engine.abort(job)

    def _pd(self, job: Job, body: dict) -> None:
        if self.role == "both":
            return
        key = (body.get("bootstrap_port"), body["bootstrap_room"])
        self.paired += 1
        fut = self.rooms.setdefault(key, asyncio.get_running_loop().create_future())
        if self.role == "prefill":
            job.prefill_only = True
            job.out = _Notify(job.out, fut)
        else:
            job.wait_for = fut

    def _grow(self, out: F.Out, job: Job, token: int) -> str:
        if not out.ids:
            m, ps = job.match, job.page_size
            out.cached = {"device": m.gpu * ps, "host": m.host * ps, "storage": m.l3 * ps}
        out.ids.append(token)
        piece = self.prompts.decode([token])
        out.text += piece
        return piece

    async def _stream(self, request, kind, job: Job, out: F.Out, body: dict):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
        await resp.prepare(request)
        sent = bytearray()

        async def send(data: bytes):
            sent.extend(data)
            await resp.write(data)
        while (token := await job.out.get()) is not None:
            piece = self._grow(out, job, token)
            if kind == "chat.completion" and len(out.ids) == 1:
                # SGLang sends the role chunk when the first token is out, then the token
                await send(F.sse(F.chat_chunk(out, {"role": "assistant", "content": ""})))
            if kind == "chat.completion":
                await send(F.sse(F.chat_chunk(out, {"content": piece})))
            elif kind == "text_completion":
                await send(F.sse(F.text_chunk(out, piece)))
            else:
                await send(F.sse(F.generate_doc(out)))
        out.finished, out.e2e_s = True, time.monotonic() - job.arrival
        if kind == "chat.completion":
            await send(F.sse(F.chat_chunk(out, {}, "length")))
        elif kind == "text_completion":
            await send(F.sse(F.text_chunk(out, "", "length")))
        else:
            await send(F.sse(F.generate_doc(out)))
        if kind != "generate" and (body.get("stream_options") or {}).get("include_usage"):
            await send(F.sse(F.usage_chunk(out, "chat.completion.chunk" if kind == "chat.completion"
                                           else "text_completion")))
        await send(F.DONE)
        self._record(request, bytes(sent))
        await resp.write_eof()
        return resp

    def _record(self, request, data: bytes) -> None:
        tag = request.headers.get("X-Standin-Tag")
        if tag:
            self.sent[tag] = data

    # ------------------------------------------------------------------ test controls

    async def evict(self, request):
        self.engine.publish(self.cache.evict_all())
        return web.json_response({"ok": True})

    async def fail(self, request):
        self.fail_status = int((await request.json()).get("status", 0))
        return web.json_response({"ok": True})

    async def pause_events(self, request):
        self.engine.events_paused = True
        return web.json_response({"ok": True})

    async def resume_events(self, request):
        self.engine.resume_events()
        return web.json_response({"ok": True})

    async def crash(self, request):
        self.crashed = True
        asyncio.get_running_loop().call_soon(lambda: asyncio.ensure_future(self.close()))
        return web.json_response({"ok": True})

    async def sent_bytes(self, request):
        data = self.sent.get(request.match_info["tag"])
        if data is None:
            raise web.HTTPNotFound()
        return web.Response(body=data, content_type="application/octet-stream")

    async def stats(self, request):
        return web.json_response({"served": self.served, "paired": self.paired,
                                  "gpu_pages": len(self.cache.gpu),
                                  "host_pages": len(self.cache.host),
                                  "waiting": len(self.engine.waiting),
                                  "running": len(self.engine.running)})


class _Notify:
    """A prefill job's output queue that also resolves the PD room when the job ends."""

    def __init__(self, q: asyncio.Queue, fut: asyncio.Future):
        self.q, self.fut = q, fut

    def put_nowait(self, item) -> None:
        if item is None and not self.fut.done():
            self.fut.set_result(True)
        self.q.put_nowait(item)

    async def get(self):
        return await self.q.get()
