"""Which async HTTP stack to build the Conductor's proxy on: aiohttp, or FastAPI + uvicorn + httpx.
Also uvicorn's fast server with aiohttp's client (Starlette): whether the faster halves combine.

    .venv/bin/python benchmarks/bench_proxy.py [--seconds 5] [--quick]

Each stack runs the same minimal proxy (read the body, POST it to one upstream, send the
answer back; for ``"stream": true`` relay the SSE chunks as they come) in its own process,
pinned to one core. The upstream and the load generator are raw asyncio protocols on the
other core, cheap enough that the proxy is what saturates. Measured, in one run:

- added latency: p50 of a non-streaming request with an 8k-token prompt (~40 KB of JSON),
  sequential, through the proxy minus straight to the upstream;
- the same for a streaming request (64 SSE chunks);
- throughput: requests/s with 64 connections of small non-streaming requests, one core.

All proxies run side by side and each round visits them in turn; a figure is the median of
its rounds. Prints a table and writes benchmarks/results/bench_proxy.json (with the host's
load average: this machine is shared, and its load moves the absolute figures).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import free_port, pct, table, write_json  # noqa: E402

STACKS = ["aiohttp", "aiohttp+uvloop", "fastapi+uvicorn+httpx", "fastapi+uvicorn[uvloop,httptools]+httpx",
          "starlette+uvicorn[uvloop,httptools]+aiohttp-client"]
REPLY = json.dumps({"id": "cmpl-1", "object": "text_completion", "model": "m",
                    "choices": [{"index": 0, "text": "x" * 512, "finish_reason": "length"}],
                    "usage": {"prompt_tokens": 8192, "completion_tokens": 128}}).encode()
CHUNK = b'data: {"id":"cmpl-1","choices":[{"index":0,"text":"tok","finish_reason":null}]}\n\n'
STREAM_CHUNKS = 64


# ------------------------------------------------------------------ upstream (raw asyncio)

class Upstream(asyncio.Protocol):
    """Answers every POST at once: REPLY, or STREAM_CHUNKS SSE chunks when the body asks."""

    def connection_made(self, transport):
        self.t, self.buf = transport, b""

    def data_received(self, data):
        self.buf += data
        while True:
            head_end = self.buf.find(b"\r\n\r\n")
            if head_end < 0:
                return
            length = _content_length(self.buf[:head_end])
            if len(self.buf) < head_end + 4 + length:
                return
            body = self.buf[head_end + 4:head_end + 4 + length]
            self.buf = self.buf[head_end + 4 + length:]
            self.t.write(_streamed() if b'"stream": true' in body[:64] or b'"stream":true' in body[:64]
                         else b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                         + str(len(REPLY)).encode() + b"\r\n\r\n" + REPLY)


def _streamed() -> bytes:
    parts = [b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"]
    for c in [CHUNK] * STREAM_CHUNKS + [b"data: [DONE]\n\n"]:
        parts.append(b"%x\r\n%s\r\n" % (len(c), c))
    parts.append(b"0\r\n\r\n")
    return b"".join(parts)


def _content_length(head: bytes) -> int:
    for line in head.split(b"\r\n"):
        if line[:15].lower() == b"content-length:":
            return int(line[15:])
    return 0


# ------------------------------------------------------------------ the proxies under test

def serve_aiohttp(port: int, upstream: str) -> None:
    from aiohttp import ClientSession, TCPConnector, web

    async def proxy(request: web.Request):
        body = await request.read()
        async with request.app["session"].post(upstream + request.path, data=body,
                                               headers={"Content-Type": "application/json"}) as up:
            if up.headers.get("Content-Type", "").startswith("text/event-stream"):
                out = web.StreamResponse(status=up.status, headers={"Content-Type": "text/event-stream"})
                await out.prepare(request)
                async for chunk in up.content.iter_any():
                    await out.write(chunk)
                await out.write_eof()
                return out
            return web.Response(body=await up.read(), status=up.status,
                                content_type="application/json")

    async def start(app):
        app["session"] = ClientSession(connector=TCPConnector(limit=0))

    async def stop(app):
        await app["session"].close()

    app = web.Application(client_max_size=64 << 20)
    app.router.add_post("/v1/completions", proxy)
    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


def serve_fastapi(port: int, upstream: str, fast: bool) -> None:
    import httpx
    import uvicorn
    from fastapi import FastAPI, Request
    from fastapi.responses import Response, StreamingResponse

    app = FastAPI()
    client = httpx.AsyncClient(base_url=upstream, limits=httpx.Limits(max_connections=None,
                                                                      max_keepalive_connections=256))

    @app.post("/v1/completions")
    async def proxy(request: Request):
        body = await request.body()
        req = client.build_request("POST", request.url.path, content=body,
                                   headers={"Content-Type": "application/json"})
        up = await client.send(req, stream=True)
        if up.headers.get("content-type", "").startswith("text/event-stream"):
            async def relay():
                try:
                    async for chunk in up.aiter_raw():
                        yield chunk
                finally:
                    await up.aclose()
            return StreamingResponse(relay(), status_code=up.status_code, media_type="text/event-stream")
        data = await up.aread()
        await up.aclose()
        return Response(content=data, status_code=up.status_code, media_type="application/json")

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="error", access_log=False,
                loop="uvloop" if fast else "asyncio", http="httptools" if fast else "h11")


def serve_starlette_aiohttp(port: int, upstream: str) -> None:
    """uvicorn's server (uvloop, httptools) with aiohttp's client: each side's faster half."""
    import uvicorn
    from aiohttp import ClientSession, TCPConnector
    from starlette.applications import Starlette
    from starlette.responses import Response, StreamingResponse
    from starlette.routing import Route

    session = []

    async def proxy(request):
        if not session:
            session.append(ClientSession(connector=TCPConnector(limit=0)))
        body = await request.body()
        up = await session[0].post(upstream + request.url.path, data=body,
                                   headers={"Content-Type": "application/json"})
        if up.headers.get("Content-Type", "").startswith("text/event-stream"):
            async def relay():
                try:
                    async for chunk in up.content.iter_any():
                        yield chunk
                finally:
                    up.release()
            return StreamingResponse(relay(), status_code=up.status, media_type="text/event-stream")
        data = await up.read()
        up.release()
        return Response(content=data, status_code=up.status, media_type="application/json")

    app = Starlette(routes=[Route("/v1/completions", proxy, methods=["POST"])])
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="error", access_log=False,
                loop="uvloop", http="httptools")


def serve(stack: str, port: int, upstream: str) -> None:
    os.sched_setaffinity(0, {0})          # the proxy gets one core; the rest run elsewhere
    if stack.startswith("aiohttp"):
        if stack.endswith("uvloop"):
            import uvloop
            uvloop.install()
        serve_aiohttp(port, upstream)
    elif stack.startswith("starlette"):
        serve_starlette_aiohttp(port, upstream)
    else:
        serve_fastapi(port, upstream, fast="uvloop" in stack)


# ------------------------------------------------------------------ the load generator (raw)

async def _read_response(reader: asyncio.StreamReader) -> float:
    """Read one response; the time its first body byte arrived (perf_counter)."""
    head = await reader.readuntil(b"\r\n\r\n")
    first = time.perf_counter()
    lower = head.lower()
    if b"transfer-encoding: chunked" in lower:
        while True:
            size = int((await reader.readuntil(b"\r\n"))[:-2], 16)
            await reader.readexactly(size + 2)
            if size == 0:
                return first
    await reader.readexactly(_content_length(head))
    return first


def _request(port: int, path: str, body: bytes) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


async def sequential(port: int, path: str, bodies: list[bytes]) -> list[float]:
    """Each body's round trip, one after another on one connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    out = []
    for req in [_request(port, path, body) for body in bodies]:
        t0 = time.perf_counter()
        writer.write(req)
        await _read_response(reader)
        out.append(time.perf_counter() - t0)
    writer.close()
    return out


async def latencies(port: int, body: bytes, n: int) -> list[float]:
    return await sequential(port, "/v1/completions", [body] * n)


async def throughput(port: int, path: str, bodies: list[bytes], conns: int, seconds: float) -> float:
    """Requests per second over ``conns`` connections for ``seconds``, cycling the bodies."""
    reqs, done, end = [_request(port, path, b) for b in bodies], [0], time.perf_counter() + seconds

    async def one(k: int):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        i = k
        while time.perf_counter() < end:
            writer.write(reqs[i % len(reqs)])
            await _read_response(reader)
            done[0] += 1
            i += conns
        writer.close()
    t0 = time.perf_counter()
    await asyncio.gather(*(one(k) for k in range(conns)))
    return done[0] / (time.perf_counter() - t0)


def prompt_body(tokens: int, stream: bool) -> bytes:
    # ~5 bytes of JSON per token of English text
    words = " ".join(f"w{i % 997}" for i in range(tokens))
    return json.dumps({"stream": stream, "model": "m", "prompt": words, "max_tokens": 128}).encode()


async def measure_round(port: int, up_port: int, n: int, seconds: float) -> dict:
    """One round against one proxy: added latencies (medians of ``n`` sequential requests,
    through it minus straight to the upstream, measured back to back) and throughput."""
    big, big_s, small = prompt_body(8192, False), prompt_body(8192, True), prompt_body(16, False)
    direct = await latencies(up_port, big, n)
    via = await latencies(port, big, n)
    direct_s = await latencies(up_port, big_s, n)
    via_s = await latencies(port, big_s, n)
    return {"added_p50_ms": (pct(via, 50) - pct(direct, 50)) * 1e3,
            "added_p90_ms": (pct(via, 90) - pct(direct, 90)) * 1e3,
            "added_stream_p50_ms": (pct(via_s, 50) - pct(direct_s, 50)) * 1e3,
            "rps_one_core": await throughput(port, "/v1/completions", [small], 64, seconds)}


async def _upstream(port: int):
    server = await asyncio.get_running_loop().create_server(Upstream, "127.0.0.1", port)
    return server


def _wait_port(port: int, proc: subprocess.Popen, timeout_s: float = 60) -> None:
    import socket
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"proxy exited with {proc.returncode}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listens on {port}")


async def run(args) -> list[dict]:
    """Every stack's proxy runs at once (each pinned to core 0, idle but for its turn); the
    rounds visit them in turn, so a change in the host's load touches every stack alike,
    and each figure is the median of its rounds."""
    others = set(range(os.cpu_count() or 1)) - {0}
    if others:
        os.sched_setaffinity(0, others)
    up_port = free_port()
    server = await _upstream(up_port)
    procs, ports = [], {}
    try:
        for stack in STACKS:
            ports[stack] = free_port()
            procs.append(subprocess.Popen([sys.executable, __file__, "--serve", stack, "--port",
                                           str(ports[stack]), "--upstream", f"http://127.0.0.1:{up_port}"]))
            await asyncio.get_running_loop().run_in_executor(None, _wait_port, ports[stack], procs[-1])
        for stack in STACKS:                                   # warm every path
            await latencies(ports[stack], prompt_body(8192, False), 30)
        rounds: dict = {stack: [] for stack in STACKS}
        for r in range(args.rounds):
            for stack in STACKS:
                rounds[stack].append(await measure_round(ports[stack], up_port, args.n, args.seconds))
            print(f"round {r + 1}/{args.rounds} done", flush=True)
        rows = []
        for stack in STACKS:
            keys = rounds[stack][0].keys()
            rows.append({"stack": stack, **{k: statistics.median(x[k] for x in rounds[stack]) for k in keys}})
        return rows
    finally:
        for p in procs:
            p.terminate()
            p.wait(10)
        server.close()


COLS = [("stack", ""), ("added_p50_ms", ".3f"), ("added_p90_ms", ".3f"), ("added_stream_p50_ms", ".3f"),
        ("rps_one_core", ".0f")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--serve", choices=STACKS, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--upstream", help=argparse.SUPPRESS)
    ap.add_argument("--seconds", type=float, default=2.0, help="throughput run per stack and round")
    ap.add_argument("-n", type=int, default=200, help="sequential requests per latency figure and round")
    ap.add_argument("--rounds", type=int, default=7, help="rounds over all stacks (medians are reported)")
    ap.add_argument("--quick", action="store_true", help="fewer requests (a smoke run)")
    args = ap.parse_args()
    if args.serve:
        serve(args.serve, args.port, args.upstream)
        return 0
    if args.quick:
        args.n, args.seconds, args.rounds = 40, 0.5, 1
    rows = asyncio.run(run(args))
    print()
    print(table(rows, COLS))
    if not args.quick:
        print("results:", write_json("bench_proxy.json", {
            "rows": rows, "n": args.n, "seconds": args.seconds, "rounds": args.rounds,
            "load_avg_1m_at_end": os.getloadavg()[0]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
