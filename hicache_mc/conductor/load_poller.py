"""Each worker's load, polled from SGLang's ``/v1/loads``, and its health with it.

``GET /v1/loads?include=core`` answers one entry per DP rank (sglang/srt/entrypoints/v1_loads.py,
``LoadSnapshot``); the worker's report sums them: waiting requests and their uncached prompt
tokens, running requests, KV tokens in use, and the largest rank's KV usage. A poll that
cannot connect or gets a 5xx fails the worker's health at once (workers.py); polls that time
out do after ``TIMEOUTS`` in a row. A worker without the endpoint (404: an SGLang older than
the load API) is polled on ``/health`` instead and reports no load.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable, Optional

import aiohttp
import orjson

from .api import LoadReport
from .events import woken
from .proxy import TooLarge, read_capped

log = logging.getLogger(__name__)

POLL_S = 0.2           # a refused or failing worker leaves the rotation at its next poll (< 1 s)
TIMEOUT_S = 1.0        # a poll that takes longer has timed out ...
TIMEOUTS = 3           # ... and this many in a row fail the worker: a busy worker (or host) may
#                        answer a poll late without being gone
MAX_BODY = 1 << 20     # a load report larger than this is refused


def report(worker: str, doc: dict, sent_s: float, got_s: float) -> LoadReport:
    """A worker's load from its ``/v1/loads`` answer (every DP rank summed). Its time is the
    snapshot's own (SGLang stamps each rank's ``timestamp``, wall clock) on the conductor's
    monotonic clock, within the poll's round trip ``[sent_s, got_s]``: the router counts
    what it sent after that moment as unseen by the report."""
    loads = doc.get("loads") or []
    if not isinstance(loads, list):
        raise ValueError("loads is not a list")
    stamps = [float(x["timestamp"]) for x in loads if isinstance(x, dict)
              and isinstance(x.get("timestamp"), (int, float))]
    at_s = got_s - (time.time() - min(stamps)) if stamps else sent_s
    at_s = min(got_s, max(sent_s, at_s))

    def total(key: str) -> int:
        return int(sum(int(x.get(key) or 0) for x in loads if isinstance(x, dict)))
    usage = max((float(x.get("token_usage") or 0.0) for x in loads if isinstance(x, dict)),
                default=0.0)
    return LoadReport(worker=worker, at_s=at_s, waiting_reqs=total("num_waiting_reqs"),
                      waiting_tokens=total("num_waiting_uncached_tokens"),
                      running_reqs=total("num_running_reqs"), running_tokens=total("num_used_tokens"),
                      kv_usage=usage)


class LoadPoller:
    """Polls one worker until ``stop()``: reports go to ``on_report``, health to ``on_health``
    (``True``; ``False`` with the reason; ``None``: a poll that timed out, no verdict yet)."""

    def __init__(self, session: aiohttp.ClientSession, worker: str, url: str,
                 on_report: Callable[[LoadReport], None],
                 on_health: Callable[[Optional[bool], str], None], interval_s: float = POLL_S):
        self.session, self.worker, self.url = session, worker, url.rstrip("/")
        self.on_report, self.on_health, self.interval_s = on_report, on_health, interval_s
        self.has_loads = True
        self.polls = self.failures = self.timeouts = 0
        self._stop = asyncio.Event()

    def stop(self) -> None:
        self._stop.set()

    async def run(self) -> None:
        while not self._stop.is_set():
            start = time.monotonic()
            why = await self.poll_once()
            if why is None:
                self.timeouts = 0
                self.on_health(True, "")
            elif why.startswith("timeout") and self.timeouts < TIMEOUTS:
                self.on_health(None, why)
            else:
                self.on_health(False, why)
            left = self.interval_s - (time.monotonic() - start)
            if left > 0 and await woken(self._stop, left):
                return

    async def poll_once(self) -> Optional[str]:
        """One poll; None when the worker answered well, else what went wrong."""
        self.polls += 1
        sent = time.monotonic()
        path = "/v1/loads?include=core" if self.has_loads else "/health"
        try:
            async with self.session.get(self.url + path,
                                        timeout=aiohttp.ClientTimeout(total=TIMEOUT_S)) as resp:
                if resp.status == 404 and self.has_loads:
                    log.info("worker %s has no /v1/loads: polling /health, no load reports", self.worker)
                    self.has_loads = False
                    return await self.poll_once()
                if resp.status >= 500:
                    return f"{path} answered {resp.status}"
                if resp.status != 200:
                    return f"{path} answered {resp.status}"
                if not self.has_loads:
                    return None
                try:
                    body = await read_capped(resp.content, MAX_BODY)
                except TooLarge:
                    return f"{path} answered over {MAX_BODY} bytes"
                self.on_report(report(self.worker, _json(body), sent, time.monotonic()))
                return None
        except asyncio.TimeoutError:
            self.failures += 1
            self.timeouts += 1
            return f"timeout: {path} took over {TIMEOUT_S} s ({self.timeouts} in a row)"
        except (aiohttp.ClientError, OSError) as exc:
            self.failures += 1
            return f"{path}: {type(exc).__name__} {exc}".strip()
        except ValueError as exc:
            self.failures += 1
            return f"{path}: a load report it could not read ({exc})"


def _json(body: bytes) -> dict:
    doc = orjson.loads(body)
    if not isinstance(doc, dict):
        raise ValueError("not an object")
    return doc
