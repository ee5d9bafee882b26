"""PD mode: a request prefilled on one worker and decoded on another, paired the way SGLang's
PD router pairs them.

The router chose both (``Decision.worker`` for the prefill, by predicted TTFT;
``Decision.decode_worker`` by predicted TBT and load). Both get the same body with
``bootstrap_host`` (the prefill worker's host), ``bootstrap_port`` (its disaggregation
bootstrap port) and a random ``bootstrap_room`` added: the decode worker reaches the prefill
worker there and pulls the request's KV. The client gets the decode worker's answer; the
prefill worker's is read and dropped.

A prefill worker that fails the request before the decode worker's answer reached the client
has the decode request closed, and the request is routed again without it; after that, the
decode worker's answer reports the failed transfer itself.
"""
from __future__ import annotations

import asyncio
import random
from typing import Callable, Optional

import aiohttp
import orjson
from aiohttp import web

from . import proxy
from .api import Decision
from .intake import Kind
from .proxy import Outcome, Relayed


def with_bootstrap(body: bytes, host: str, port: Optional[int], room: int) -> bytes:
    doc = orjson.loads(body)
    doc["bootstrap_host"], doc["bootstrap_port"], doc["bootstrap_room"] = host, port, room
    return orjson.dumps(doc)


class PDRelay:
    def __init__(self, server):
        self.s = server

    async def relay(self, request: web.Request, kind: Kind, body: bytes, headers: dict,
                    extra: dict, d: Decision, on_first: Callable[[float], None]) -> Relayed:
        s = self.s
        pw, dw = s.fleet.get(d.worker), s.fleet.get(d.decode_worker)
        if pw is None or dw is None:
            return Relayed(Outcome.NOT_STARTED, error="left the fleet",
                           worker=d.worker if pw is None else d.decode_worker)
        both = with_bootstrap(body, pw.config.host, pw.config.bootstrap_port, random.getrandbits(63))
        prefill = asyncio.ensure_future(self._prefill(pw.config.url + kind.value, both, headers))
        r = Relayed(Outcome.NOT_STARTED)
        decode = asyncio.ensure_future(proxy.relay(
            s.session, request, dw.name, dw.config.url + kind.value, both, headers, extra,
            s.timeout, on_first, r))
        done, _ = await asyncio.wait({prefill, decode}, return_when=asyncio.FIRST_COMPLETED)
        if prefill in done and prefill.result() and r.response is None and not decode.done():
            decode.cancel()
            await asyncio.gather(decode, return_exceptions=True)
            return Relayed(Outcome.NOT_STARTED, error=prefill.result(), worker=pw.name)
        result = await decode
        if result.outcome is Outcome.NOT_STARTED and not prefill.done():
            prefill.cancel()                # the decode worker failed: nothing pulls the KV
            await asyncio.gather(prefill, return_exceptions=True)
            return result
        failed = await prefill
        if result.outcome is Outcome.NOT_STARTED and failed:
            result.worker, result.error = pw.name, failed
        return result

    async def _prefill(self, url: str, body: bytes, headers: dict) -> str:
        """Send the prefill request and drain its answer; "" when it went well, else why."""
        try:
            async with self.s.session.post(url, data=body, headers=headers,
                                           timeout=self.s.timeout) as resp:
                await proxy.read_capped(resp.content, proxy.MAX_ANSWER)
                return f"prefill answered {resp.status}" if resp.status >= 500 else ""
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, proxy.TooLarge) as exc:
            return f"prefill: {type(exc).__name__} {exc}".strip()
