"""A stand-in worker's scheduler: continuous batching timed by the simulator's PerfModel.

One loop, as SGLang's scheduler runs it: while requests wait, one prefill forward takes them
in arrival order up to the chunked-prefill budget (a longer prompt is prefilled in chunks),
its time ``perf.prefill_batch_s`` plus the time to bring the matched host and L3 pages into
the GPU (pages x page bytes / that path's bandwidth); otherwise one decode step of the
running batch, ``perf.decode_step_s(batch, kv tokens)``. Every duration is multiplied by
``time_scale`` and slept for real, so the stand-in's TTFT and TBT are the model's, scaled.

A request's prompt pages go into the GPU tier when its prefill ends (SGLang inserts them into
its radix cache then), and the events of that step are published through SGLang's own
``ZmqEventPublisher``, one ``KVEventBatch`` per step.
"""
from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

from sglang.srt.disaggregation.kv_events import KVEventBatch, ZmqEventPublisher
from sglang.srt.managers.load_snapshot import LoadSnapshot

from hicache_mc.conductor.perf import CHUNKED_PREFILL_TOKENS, MAX_RUNNING_REQUESTS, PerfModel

from .cache import Match, PageCache, page_hashes


@dataclass
class Job:
    """One request inside the stand-in."""
    rid: str
    tokens: list[int]
    max_new: int
    arrival: float = field(default_factory=time.monotonic)
    pages: list[str] = field(default_factory=list)
    match: Match = Match(0, 0, 0)
    prefilled: int = 0               # prompt tokens computed or loaded so far
    generated: int = 0
    first_token_at: float = 0.0
    out: asyncio.Queue = field(default_factory=asyncio.Queue)   # ints: tokens; None: the end
    prefill_only: bool = False       # a PD prefill worker's request: one token, then done
    wait_for: Optional[asyncio.Future] = None   # a PD decode request: the prefill's KV

    @property
    def cached_tokens(self) -> int:
        return (self.match.gpu + self.match.host + self.match.l3) * self.page_size

    page_size: int = 1


@dataclass(frozen=True)
class Speeds:
    """Bytes/s of the paths that bring cached pages into the GPU."""
    host_bw: float = 20e9            # PCIe host -> device
    l3_bw: float = 10e9              # the store -> host -> device


class Engine:
    """Runs until ``stop()``; ``submit`` a Job and read its ``out`` queue."""

    def __init__(self, cache: PageCache, publisher: ZmqEventPublisher, perf: PerfModel,
                 time_scale: float = 1.0, speeds: Speeds = Speeds(),
                 max_running: int = MAX_RUNNING_REQUESTS, chunk: int = CHUNKED_PREFILL_TOKENS):
        self.cache, self.publisher, self.perf = cache, publisher, perf
        self.time_scale, self.speeds = time_scale, speeds
        self.max_running, self.chunk = max_running, chunk
        self.waiting: deque[Job] = deque()
        self.running: list[Job] = []
        self.wake = asyncio.Event()
        self.events_paused = False
        self._held: list = []
        self._stopped = False

    # ------------------------------------------------------------------ the HTTP side

    def submit(self, job: Job) -> None:
        job.page_size = self.cache.page_size
        job.pages = page_hashes(job.tokens, self.cache.page_size)
        self.waiting.append(job)
        self.wake.set()

    def abort(self, job: Job) -> None:
        if job in self.waiting:
            self.waiting.remove(job)
        if job in self.running:
            self.running.remove(job)

    def publish(self, events: list) -> None:
        """One batch, now; or held while a test has paused the stream."""
        if not events:
            return
        if self.events_paused:
            self._held.extend(events)
            return
        self.publisher.publish(KVEventBatch(ts=time.time(), events=events))

    def resume_events(self) -> None:
        self.events_paused = False
        held, self._held = self._held, []
        self.publish(held)

    def load(self) -> LoadSnapshot:
        """This worker's load in SGLang's own /v1/loads struct."""
        waiting_new = sum(len(j.tokens) - j.prefilled for j in self.waiting)
        used = self.cache.used_tokens() + sum(len(j.tokens) + j.generated for j in self.running)
        total = self.cache.gpu_pages * self.cache.page_size
        return LoadSnapshot(timestamp=time.time(), dp_rank=0,
                            num_running_reqs=len(self.running), num_waiting_reqs=len(self.waiting),
                            num_waiting_uncached_tokens=waiting_new, num_used_tokens=used,
                            num_total_tokens=total, max_total_num_tokens=total,
                            max_running_requests=self.max_running,
                            token_usage=min(1.0, used / total) if total else 0.0)

    # ------------------------------------------------------------------ the loop

    async def run(self) -> None:
        while not self._stopped:
            if not self.waiting and not self.running:
                self.wake.clear()
                await self.wake.wait()
                continue
            if self._ready_waiting() and len(self.running) < self.max_running:
                await self._prefill()
            elif self.running:
                await self._decode()
            else:                           # only PD decodes whose KV has not arrived
                self.wake.clear()
                await asyncio.wait([asyncio.ensure_future(self.wake.wait())], timeout=0.005)

    def stop(self) -> None:
        self._stopped = True
        self.wake.set()

    def _ready_waiting(self) -> bool:
        return any(j.wait_for is None or j.wait_for.done() for j in self.waiting)

    async def _sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds * self.time_scale)

    async def _prefill(self) -> None:
        budget, parts, batch, fetch_s = self.chunk, [], [], 0.0
        for job in list(self.waiting):
            if budget <= 0 or len(self.running) + len(batch) >= self.max_running:
                break
            if job.wait_for is not None and not job.wait_for.done():
                continue
            if job.prefilled == 0:
                fetch_s += await self._start(job)
                if job not in self.waiting:
                    continue                    # aborted while its L3 lookup ran
            take = min(budget, len(job.tokens) - job.prefilled)
            parts.append((take, job.prefilled))
            job.prefilled += take
            budget -= take
            batch.append(job)
        await self._sleep(self.perf.prefill_batch_s(parts) + fetch_s)
        events: list = []
        for job in batch:
            if job.prefilled < len(job.tokens) or job not in self.waiting:
                continue                    # the next chunk in a later forward, or aborted
            self.waiting.remove(job)
            events += self.cache.insert(job.pages, job.tokens)
            self._emit(job, events)
        self.publish(events)

    async def _start(self, job: Job) -> float:
        """Match the prompt against the tiers; the time to bring the matched pages in."""
        if job.wait_for is not None:        # PD decode: the KV came from the prefill worker
            job.prefilled = len(job.tokens)
            return 0.0
        job.match = await self.cache.match(job.pages)
        self.cache.touch(job.pages[:job.match.gpu])
        page_bytes = self.perf.page_bytes(self.cache.page_size)
        job.prefilled = min(job.cached_tokens, max(0, len(job.tokens) - 1))
        return (job.match.host * page_bytes / self.speeds.host_bw
                + job.match.l3 * page_bytes / self.speeds.l3_bw)

    def _emit(self, job: Job, events: list) -> None:
        """The first token of a prefilled request."""
        job.first_token_at = time.monotonic()
        job.generated = 1
        job.out.put_nowait(self._token(job, 0))
        if job.prefill_only or job.generated >= job.max_new:
            job.out.put_nowait(None)
        else:
            self.running.append(job)

    async def _decode(self) -> None:
        batch = list(self.running)
        kv = sum(len(j.tokens) + j.generated for j in batch)
        await self._sleep(self.perf.decode_step_s(len(batch), kv))
        for job in batch:
            if job not in self.running:
                continue                    # aborted meanwhile
            job.out.put_nowait(self._token(job, job.generated))
            job.generated += 1
            if job.generated >= job.max_new:
                self.running.remove(job)
                job.out.put_nowait(None)

    @staticmethod
    def _token(job: Job, i: int) -> int:
        """A deterministic output token: the same prompt always gets the same completion."""
        return (sum(job.tokens[-8:]) * 31 + i * 7 + 5) % 1500 + 300
