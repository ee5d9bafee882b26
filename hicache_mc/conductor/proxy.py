"""One request relayed to one worker, its answer passed to the client unchanged.

``relay`` sends the client's body as it came and answers with the worker's status, content
type and body bytes; an SSE answer (``stream: true``) is relayed chunk by chunk as it arrives,
so the client reads exactly the bytes the worker wrote. What it returns says how it went:

- ``NOT_STARTED``: nothing reached the client (the worker refused the connection, timed out
  before answering, or answered 5xx); the caller may send the request elsewhere;
- ``FAILED``: the worker broke off after the client had the first bytes: an SSE client gets
  a last ``data: {"error": ...}`` event naming the worker, then the end of the stream;
- ``DONE``: the worker's whole answer reached the client (any status below 500);
- ``CLIENT_GONE``: the client went away; the worker's request is closed with it.

The last ``TAIL`` bytes of the answer (the whole body of a non-streaming one) are kept for
the usage and ``meta_info`` the caller reads (usage.py).
"""
from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass
from typing import Callable, Optional

import aiohttp
import orjson
from aiohttp import web

TAIL = 64 << 10                 # the final SSE events (usage, meta_info) fit well within this
MAX_ANSWER = 256 << 20          # a non-streaming answer larger than this is a worker fault
HOP = {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "te",
       "trailer", "upgrade", "proxy-authorization", "proxy-authenticate", "accept-encoding"}


class TooLarge(ValueError):
    """A body over the size its reader allows."""


async def read_capped(content: aiohttp.StreamReader, cap: int) -> bytes:
    """A whole body, refused past ``cap`` bytes (``StreamReader.read(n)`` returns what has
    arrived, up to ``n``: one network read, not the body)."""
    buf = bytearray()
    async for chunk in content.iter_any():
        buf += chunk
        if len(buf) > cap:
            raise TooLarge(f"over {cap} bytes")
    return bytes(buf)


class Outcome(enum.Enum):
    DONE = "done"
    NOT_STARTED = "not_started"
    FAILED = "failed"
    CLIENT_GONE = "client_gone"


@dataclass
class Relayed:
    outcome: Outcome
    status: int = 0
    error: str = ""
    sent_s: float = 0.0              # when the request went to the worker (monotonic)
    first_s: Optional[float] = None  # when the first body bytes came back
    tail: bytes = b""                # the whole body (non-streaming) or its last TAIL bytes
    streamed: bool = False
    response: Optional[web.StreamResponse] = None
    worker: str = ""


def forward_headers(request: web.Request) -> dict:
    """The client's headers a worker should see (hop-by-hop ones and the conductor's own out)."""
    return {k: v for k, v in request.headers.items()
            if k.lower() not in HOP and not k.lower().startswith("x-conductor-")}


async def relay(session: aiohttp.ClientSession, request: web.Request, worker: str, url: str,
                body: bytes, headers: dict, extra: dict, timeout: aiohttp.ClientTimeout,
                on_first: Optional[Callable[[float], None]] = None,
                r: Optional[Relayed] = None) -> Relayed:
    """Send ``body`` to ``url`` (worker ``worker``'s) and answer ``request`` with what comes
    back (see the module docstring). ``r``, when given, is filled in as the relay goes: a
    caller running this as a task can see whether the client got anything yet
    (``r.response``)."""
    if r is None:
        r = Relayed(Outcome.NOT_STARTED)
    r.sent_s, r.worker = time.monotonic(), worker
    try:
        up = await session.post(url, data=body, headers=headers, timeout=timeout)
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
        r.error = f"{type(exc).__name__}: {exc}".rstrip(": ")
        return r
    try:
        r.status = up.status
        if up.status >= 500:
            r.error = f"answered {up.status}"
            return r
        if up.headers.get("Content-Type", "").startswith("text/event-stream") and up.status == 200:
            return await _stream(request, up, extra, r, on_first)
        return await _whole(request, up, extra, r)
    finally:
        up.release()


async def _whole(request: web.Request, up: aiohttp.ClientResponse, extra: dict, r: Relayed) -> Relayed:
    try:
        body = await read_capped(up.content, MAX_ANSWER)
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
        r.error = f"its answer broke off: {type(exc).__name__}: {exc}"
        return r                               # nothing sent to the client yet
    except TooLarge:
        r.error = f"its answer is over {MAX_ANSWER} bytes"
        return r
    r.first_s, r.tail = time.monotonic(), body
    resp = web.Response(body=body, status=up.status, headers=extra,
                        content_type=up.content_type or "application/json")
    if up.charset:
        resp.charset = up.charset
    r.response, r.outcome = resp, Outcome.DONE
    return r


async def _stream(request: web.Request, up: aiohttp.ClientResponse, extra: dict, r: Relayed,
                  on_first: Optional[Callable[[float], None]]) -> Relayed:
    r.streamed = True
    resp = web.StreamResponse(status=up.status, headers={
        **extra, "Content-Type": up.headers.get("Content-Type", "text/event-stream"),
        "Cache-Control": "no-cache"})
    tail = bytearray()
    try:
        await resp.prepare(request)
    except (ConnectionError, OSError):
        r.outcome = Outcome.CLIENT_GONE
        return r
    r.response = resp
    try:
        async for chunk in up.content.iter_any():
            if r.first_s is None:
                r.first_s = time.monotonic()
                if on_first is not None:
                    on_first(r.first_s)
            tail += chunk
            if len(tail) > 2 * TAIL:
                del tail[:-TAIL]
            try:
                await resp.write(chunk)
            except (ConnectionError, OSError):
                r.outcome, r.tail = Outcome.CLIENT_GONE, bytes(tail)
                return r
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
        r.error = f"worker {r.worker}: its stream broke off ({type(exc).__name__} {exc})"
        r.outcome, r.tail = Outcome.FAILED, bytes(tail)
        await _end_with_error(resp, r.error)
        return r
    r.tail, r.outcome = bytes(tail), Outcome.DONE
    try:
        await resp.write_eof()
    except (ConnectionError, OSError):
        r.outcome = Outcome.CLIENT_GONE
    return r


async def _end_with_error(resp: web.StreamResponse, message: str) -> None:
    """The last event of a stream whose worker failed, in OpenAI's error shape."""
    doc = {"error": {"message": message, "type": "worker_failed", "param": None, "code": 502}}
    try:
        await resp.write(b"data: " + orjson.dumps(doc) + b"\n\n")
        await resp.write_eof()
    except (ConnectionError, OSError):
        return
