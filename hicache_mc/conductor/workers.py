"""The fleet the conductor routes to: each worker's address, role, health, load poller and
KV-event stream, added and removed at runtime.

A worker is given by its URL (flags, the config file, or the admin API); what SGLang can tell
about itself it is asked (``GET /server_info``: page size, KV pool size, PD role and bootstrap
port, and the ``kv_events`` descriptor, whose endpoints are dialled at the worker URL's host).
A ``WorkerConfig`` field that is set wins over what the worker says.

**Rotation.** A worker is routed to only while healthy: it joins the router after its first
good load poll, and leaves it at once when a poll or a proxied request cannot connect or gets
a 5xx (polls every 0.2 s: out within 1 s of failing), or when polls time out 3 times in a
row (load_poller.py). It comes back after
``RISE`` good polls in a row, with a fresh index rebuilt from its replay endpoint (the
router forgets a worker that leaves). Its event stream runs while it is in the rotation and
starts with a catch-up from the replay endpoint each time it joins.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Callable, Optional
from urllib.parse import urlsplit

import aiohttp
import orjson
import zmq.asyncio

from .api import Event, LoadReport, Role, WorkerSpec
from .events import EventStream
from .load_poller import LoadPoller
from .proxy import read_capped

log = logging.getLogger(__name__)

RISE = 2               # good polls in a row that bring a failed worker back


@dataclass(frozen=True)
class WorkerConfig:
    """A worker as the operator names it; empty fields are asked of the worker."""
    url: str
    name: str = ""                      # default: the URL's host:port
    role: Optional[Role] = None         # default: the worker's disaggregation mode
    events: str = ""                    # its KV-event PUB endpoint (default: /server_info)
    replay: str = ""                    # its replay endpoint (default: /server_info)
    bootstrap_port: Optional[int] = None   # PD prefill: default /server_info's
    page_size: int = 0                  # tokens per page (default /server_info's)
    kv_tokens: int = 0                  # its GPU KV pool in tokens (default /server_info's)

    def __post_init__(self):
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"worker url {self.url!r}: expected http(s)://HOST:PORT")
        object.__setattr__(self, "url", self.url.rstrip("/"))
        if not self.name:
            object.__setattr__(self, "name", parts.netloc)

    @property
    def host(self) -> str:
        return urlsplit(self.url).hostname or ""


@dataclass
class Worker:
    config: WorkerConfig
    spec: WorkerSpec
    healthy: bool = False
    reason: str = "not polled yet"
    good: int = 0                       # good polls in a row
    load: Optional[LoadReport] = None
    stream: Optional[EventStream] = None
    tasks: list = field(default_factory=list)
    since: float = field(default_factory=time.monotonic)

    @property
    def name(self) -> str:
        return self.config.name

    def describe(self) -> dict:
        s = self.stream
        return {"name": self.name, "url": self.config.url, "role": self.spec.role.value,
                "healthy": self.healthy, "reason": self.reason,
                "bootstrap_port": self.config.bootstrap_port,
                "events": self.config.events or None, "events_live": bool(s and s.live),
                "load": None if self.load is None else asdict(self.load)}


class Hooks:
    """What the fleet tells the router (the server wires these to it)."""

    def __init__(self, joined: Callable[[WorkerSpec], None], left: Callable[[str], None],
                 events: Callable[[list[Event]], None], load: Callable[[LoadReport], None]):
        self.joined, self.left, self.events, self.load = joined, left, events, load


class Fleet:
    """Every worker by name; all of it runs on the conductor's event loop."""

    def __init__(self, session: aiohttp.ClientSession, ctx: zmq.asyncio.Context, hooks: Hooks,
                 template: WorkerSpec, poll_s: float, stall_s: float):
        """``template``: what every worker's spec starts from; its ``page_bytes`` is per token
        here (a page's once the page size is known), a ``page_tokens`` of 0 is taken from the
        first worker that names its own."""
        self.session, self.ctx, self.hooks = session, ctx, hooks
        self.template, self.poll_s, self.stall_s = template, poll_s, stall_s
        self.workers: dict[str, Worker] = {}

    # ------------------------------------------------------------------ membership

    async def add(self, config: WorkerConfig) -> Worker:
        if config.name in self.workers:
            raise ValueError(f"worker {config.name!r} is already in the fleet")
        config = await self._discover(config)
        role = config.role or Role.BOTH
        if not self.template.page_tokens and config.page_size:
            self.template = replace(self.template, page_tokens=config.page_size)
            log.info("pages of %d tokens (worker %s's)", config.page_size, config.name)
        elif config.page_size and config.page_size != self.template.page_tokens:
            log.error("worker %s has %d-token pages, the conductor hashes %d-token pages: its "
                      "cache will not be matched", config.name, config.page_size,
                      self.template.page_tokens)
        page = self.template.page_tokens or 1
        spec = replace(self.template, name=config.name, role=role,
                       page_bytes=self.template.page_bytes * page,
                       l1_pages=config.kv_tokens // page if config.kv_tokens else 0)
        w = Worker(config, spec)
        self.workers[config.name] = w
        poller = LoadPoller(self.session, w.name, config.url, lambda r, w=w: self._on_load(w, r),
                            lambda ok, why, w=w: self._on_health(w, ok, why), self.poll_s)
        w.tasks.append(asyncio.ensure_future(poller.run()))
        w.tasks.append(poller)
        log.info("worker %s (%s, %s) added; events %s", w.name, config.url, role.value,
                 config.events or "none")
        return w

    async def remove(self, name: str) -> bool:
        w = self.workers.pop(name, None)
        if w is None:
            return False
        if w.healthy:
            self.hooks.left(name)
        await self._stop(w)
        log.info("worker %s removed", name)
        return True

    async def close(self) -> None:
        for name in list(self.workers):
            w = self.workers.pop(name)
            await self._stop(w)

    async def _stop(self, w: Worker) -> None:
        if w.stream is not None:
            w.stream.stop()
        for t in w.tasks:
            if isinstance(t, LoadPoller):
                t.stop()
        futures = [t for t in w.tasks if isinstance(t, asyncio.Future)]
        for t in futures:
            t.cancel()
        await asyncio.gather(*futures, return_exceptions=True)
        w.tasks.clear()

    def _start_stream(self, w: Worker) -> None:
        if not w.config.events:
            return
        if w.stream is not None:
            w.stream.stop()
        w.tasks = [t for t in w.tasks if not (isinstance(t, asyncio.Future) and t.done())]
        stream = EventStream(self.ctx, w.name, w.config.events, w.config.replay or None,
                             lambda evs: self._on_events(w, stream, evs), stall_s=self.stall_s)
        w.stream = stream
        w.tasks.append(asyncio.ensure_future(stream.run()))

    async def _discover(self, config: WorkerConfig) -> WorkerConfig:
        """Fill the config's empty fields from the worker's ``/server_info`` (best effort)."""
        try:
            async with self.session.get(config.url + "/server_info",
                                        timeout=aiohttp.ClientTimeout(total=5)) as resp:
                if resp.status != 200:
                    return config
                info = orjson.loads(await read_capped(resp.content, 4 << 20))
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as exc:
            log.info("worker %s: no /server_info (%s); using its configuration only", config.name, exc)
            return config
        return apply_server_info(config, info)

    # ------------------------------------------------------------------ signals

    def _on_load(self, w: Worker, r: LoadReport) -> None:
        w.load = r
        if w.healthy:
            self.hooks.load(r)

    def _on_events(self, w: Worker, stream: EventStream, events: list[Event]) -> None:
        if w.healthy and stream is w.stream:      # a stream replaced or stopped says nothing
            self.hooks.events(events)

    def _on_health(self, w: Worker, ok: Optional[bool], why: str) -> None:
        if ok is None:
            return                          # a late poll: no verdict
        if ok:
            w.good += 1
            if not w.healthy and w.good >= (1 if w.reason == "not polled yet" else RISE):
                self._join(w)
        else:
            w.good = 0
            self.failed(w.name, why)

    def failed(self, name: str, why: str) -> None:
        """``name`` cannot be used now (a poll or a request failed): out of the rotation."""
        w = self.workers.get(name)
        if w is None:
            return
        w.good = 0
        if w.healthy:
            w.healthy, w.reason, w.since = False, why, time.monotonic()
            log.warning("worker %s leaves the rotation: %s", name, why)
            self.hooks.left(name)
            if w.stream is not None:
                w.stream.stop()
                w.stream = None
        elif w.reason == "not polled yet":
            w.reason = why

    def _join(self, w: Worker) -> None:
        returning = w.reason != "not polled yet"
        w.healthy, w.reason, w.since = True, "", time.monotonic()
        self.hooks.joined(w.spec)
        if w.load is not None:
            self.hooks.load(w.load)
        self._start_stream(w)               # a fresh index: it catches up from the replay
        log.info("worker %s %s the rotation", w.name, "is back in" if returning else "joins")

    # ------------------------------------------------------------------ lookups

    def get(self, name: str) -> Optional[Worker]:
        return self.workers.get(name)

    def healthy(self) -> list[Worker]:
        return [w for w in self.workers.values() if w.healthy]

    @property
    def page_size(self) -> int:
        return self.template.page_tokens

    def stream(self, name: str) -> Optional[EventStream]:
        w = self.workers.get(name)
        return None if w is None else w.stream


def apply_server_info(config: WorkerConfig, info: dict) -> WorkerConfig:
    """The config with its empty fields filled from an SGLang ``/server_info`` answer."""
    changes: dict = {}
    if config.role is None:
        mode = str(info.get("disaggregation_mode") or "null")
        changes["role"] = {"prefill": Role.PREFILL, "decode": Role.DECODE}.get(mode, Role.BOTH)
    if config.bootstrap_port is None and info.get("disaggregation_bootstrap_port"):
        changes["bootstrap_port"] = int(info["disaggregation_bootstrap_port"])
    if not config.page_size and info.get("page_size"):
        changes["page_size"] = int(info["page_size"])
    if not config.kv_tokens and info.get("max_total_num_tokens"):
        changes["kv_tokens"] = int(info["max_total_num_tokens"])
    kv = info.get("kv_events")
    if isinstance(kv, dict) and not config.events and kv.get("endpoint_port_base"):
        host = config.host
        host = f"[{host}]" if ":" in host else host
        changes["events"] = f"tcp://{host}:{int(kv['endpoint_port_base'])}"
        if kv.get("replay_endpoint_port_base") and not config.replay:
            changes["replay"] = f"tcp://{host}:{int(kv['replay_endpoint_port_base'])}"
    return replace(config, **changes) if changes else config
