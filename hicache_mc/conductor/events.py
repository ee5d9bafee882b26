"""Following one worker's KV events: SUB, sequence check, gap fill from the replay endpoint,
and the stream's health.

Lifecycle (one ``EventStream`` per worker, a task on the conductor's loop):

1. **Catch up.** Before anything else the stream asks the replay endpoint for every batch it
   still buffers (from 0): a restarted conductor rebuilds the worker's cache from it (SGLang
   keeps the last ``buffer_steps`` batches, 10,000 by default; what fell out of it is not
   known, so the router under-predicts those hits, never invents them).
2. **Follow.** Each PUB message carries a sequence number. The next one is applied; one past
   a gap makes the stream ask the replay endpoint for the missing ones first (SUB queues what
   arrives meanwhile); one already applied is skipped; a ``0`` after more is a restarted
   publisher (its cache is new: ``Cleared``). A gap the replay endpoint cannot fill (it no
   longer holds the start, or does not answer) is ``Cleared`` too: removals may be lost, and a
   stale "cached" is worse than an unknown.
3. **Health.** SGLang publishes nothing while nothing changes, so silence proves nothing. A
   stream is *stalled* when the conductor expected events and none came: a request the worker
   served had prompt pages the index did not know there (``expect``), whose stores SGLang
   publishes in the step that computes them, or the SUB connection dropped. Then the stream
   asks the replay endpoint whether it missed something (applied if so: the stream is live)
   and otherwise reports ``StreamHealth(live=False)``: the router routes that worker on load
   alone until a batch arrives again.

Nothing here blocks the loop: the SUB socket is read on a thread of its own into a bounded
queue (``_Reader``), the replay socket is a ``zmq.asyncio`` socket read under a timeout.
Frames are capped (``kv_wire.MAX_FRAME``) and a malformed one is counted and skipped; the
publisher is a worker the operator named, but its port still gets no trust.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Optional

import zmq
import zmq.asyncio

from . import kv_wire
from .api import Cleared, Event, StreamHealth

log = logging.getLogger(__name__)

STALL_S = 1.0          # events of a step are published as it ends: 1 s is ample slack
QUEUE_FRAMES = 10_000  # batches held for a busy loop (SGLang's replay buffer holds as many) ...
QUEUE_BYTES = 256 << 20   # ... and at most this many bytes of them
REPLAY_TIMEOUT_S = 2.0
REPLAY_MAX_BATCHES = 100_000       # SGLang's buffer holds 10,000 by default


@dataclass
class StreamCounters:
    batches: int = 0
    gaps: int = 0                # gaps filled from the replay endpoint
    lost: int = 0                # gaps that could not be filled (Cleared)
    stalls: int = 0
    malformed: int = 0
    dropped: int = 0             # frames dropped while the loop was behind (gaps, then filled)
    skipped_events: int = 0      # events of other media (DISK, EXTERNAL)
    restarts: int = 0            # the publisher started its numbers over


class EventStream:
    """One worker's KV events into ``sink`` (a list of api events per call, in order)."""

    def __init__(self, ctx: zmq.asyncio.Context, worker: str, endpoint: str,
                 replay_endpoint: Optional[str], sink: Callable[[list[Event]], None],
                 topic: str = "", stall_s: float = STALL_S):
        self.ctx, self.worker, self.endpoint, self.replay_endpoint = ctx, worker, endpoint, replay_endpoint
        self.sink, self.topic, self.stall_s = sink, topic.encode(), stall_s
        self.last = -1                   # the last sequence number applied
        self.live = True
        self.connected = False
        self.heard = time.monotonic()    # when the last batch arrived
        self.expected: Optional[float] = None    # the first unmet expectation's deadline
        self.counters = StreamCounters()
        self._stop = asyncio.Event()
        self._wake = asyncio.Event()

    # ------------------------------------------------------------------ from the server

    def expect(self, since: float) -> None:
        """A request sent at ``since`` just showed that the worker computed pages the router
        did not know it held: their events must arrive within ``stall_s``, unless a batch
        came in since it was sent (the stream is alive: it may even have been that one)."""
        if self.heard > since:
            return
        if self.expected is None:
            self.expected = time.monotonic() + self.stall_s
            self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    # ------------------------------------------------------------------ the task

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        reader = _Reader(self.endpoint, self.topic, lambda: loop.call_soon_threadsafe(self._wake.set))
        reader.start()
        try:
            await self._fill(0, catch_up=True)
            while not self._stop.is_set():
                await self._turn(reader)
        finally:
            reader.stop()
            await loop.run_in_executor(None, reader.join, 2.0)
            self.counters.dropped = reader.dropped

    async def _turn(self, reader: "_Reader") -> None:
        timeout = 0.25 if self.expected is None else max(0.0, self.expected - time.monotonic())
        if not reader.frames and not reader.monitor:
            self._wake.clear()
            await woken(self._wake, timeout)
        while reader.monitor:
            await self._on_monitor(reader.monitor.popleft())
        for _ in range(256):                # a burst, then let the loop breathe
            if not reader.frames:
                break
            size, frames = reader.frames.popleft()
            reader.queued -= size
            await self.receive(frames)
        if self.expected is not None and time.monotonic() >= self.expected:
            await self._probe()

    async def _on_monitor(self, event: int) -> None:
        if event == zmq.EVENT_CONNECTED:
            self.connected = True
            if await self._fill(self.last + 1):      # what was published while we were away
                self._health(True, "")
        elif event == zmq.EVENT_DISCONNECTED:
            self.connected = False
            self._health(False, "its event connection dropped")

    async def receive(self, frames: list) -> None:
        """One PUB message ``[topic, seq, payload]``, in the order it arrived."""
        frame = kv_wire.parse(frames)
        if frame is None or frame.batch is None:
            self.counters.malformed += 1
            if frame is not None and frame.seq == self.last + 1:
                self.last = frame.seq
            return
        if frame.seq == 0 and self.last > 0:
            self.counters.restarts += 1
            log.warning("kv-events %s: its publisher started over; its cache is new", self.worker)
            self.sink([Cleared(self.worker)])
            self.last = -1
        if frame.seq <= self.last:
            return                              # replayed already
        if frame.seq > self.last + 1:
            await self._fill(self.last + 1, until=frame.seq)
            if frame.seq <= self.last:
                return
        self._apply(frame.seq, frame.batch)

    def _apply(self, seq: int, batch: kv_wire.Batch) -> None:
        events, skipped = kv_wire.to_api(self.worker, batch)
        self.counters.batches += 1
        self.counters.skipped_events += skipped
        self.last = seq
        self.heard = time.monotonic()
        self.expected = None
        if events:
            self.sink(events)
        self._health(True, "")

    def _health(self, live: bool, why: str) -> None:
        if live == self.live:
            return
        self.live = live
        if not live:
            self.counters.stalls += 1
            log.warning("kv-events %s: stalled (%s); routing it on load alone", self.worker, why)
        else:
            log.info("kv-events %s: live again", self.worker)
        self.sink([StreamHealth(self.worker, live)])

    async def _probe(self) -> None:
        """An expectation ran out: did we miss batches, or did the stream stall?"""
        self.expected = None
        before = self.last
        await self._fill(self.last + 1)
        if self.last == before:
            self._health(False, f"no events {self.stall_s:.1f} s after new pages were computed")

    # ------------------------------------------------------------------ replay

    async def _fill(self, start: int, until: Optional[int] = None, catch_up: bool = False) -> bool:
        """Apply the buffered batches from ``start`` on (up to ``until``, exclusive); whether
        the replay endpoint answered."""
        frames = await self._replay(start)
        if frames is None:
            if not catch_up and until is not None:
                self._lost(f"no replay for {start}..{until - 1}")
            return False
        got = [f for f in frames if f.seq >= start and (until is None or f.seq < until)]
        if got and got[0].seq > start and not catch_up:
            self._lost(f"replay starts at {got[0].seq}, not {start}")
        elif until is not None and (not got or got[-1].seq < until - 1):
            self._lost(f"replay ends before {until - 1}")
        elif got and not catch_up:
            self.counters.gaps += 1
        for f in got:
            if f.batch is None:
                self.counters.malformed += 1
                self.last = f.seq
            elif f.seq > self.last:
                self._apply(f.seq, f.batch)
        if until is not None and self.last < until - 1:
            self.last = until - 1      # what cannot be had is given up (Cleared above)
        return True

    def _lost(self, why: str) -> None:
        self.counters.lost += 1
        log.warning("kv-events %s: %s; its cache is forgotten", self.worker, why)
        self.sink([Cleared(self.worker)])

    async def _replay(self, start: int) -> Optional[list[kv_wire.Frame]]:
        """The publisher's buffered batches from ``start``; None when it does not answer."""
        if not self.replay_endpoint:
            return None
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, kv_wire.MAX_FRAME)
        sock.connect(self.replay_endpoint)
        out: list[kv_wire.Frame] = []
        try:
            await sock.send_multipart([b"", max(0, start).to_bytes(8, "big")])
            deadline = time.monotonic() + REPLAY_TIMEOUT_S
            while len(out) < REPLAY_MAX_BATCHES:
                left = deadline - time.monotonic()
                if left <= 0 or not await sock.poll(int(left * 1000)):
                    log.warning("kv-events %s: the replay endpoint did not finish in %.0f s",
                                self.worker, REPLAY_TIMEOUT_S)
                    return None
                frames = await sock.recv_multipart()
                if len(frames) != 4 or len(frames[2]) != 8:
                    self.counters.malformed += 1
                    continue
                if int.from_bytes(frames[2], "big", signed=True) == kv_wire.END_SEQ:
                    return out
                frame = kv_wire.parse(frames[1:])
                if frame is not None:
                    out.append(frame)
            return out
        finally:
            sock.close(0)


async def woken(event: asyncio.Event, timeout_s: float) -> bool:
    """Whether ``event`` was set within ``timeout_s``."""
    try:
        await asyncio.wait_for(event.wait(), timeout_s)
    except asyncio.TimeoutError:
        return False
    return True


class _Reader(threading.Thread):
    """The SUB socket and its connection monitor, read on a thread of their own, into bounded
    queues the stream drains on the loop. ZeroMQ's input then never stops on a full pipe
    while the loop is busy: libzmq 4.3.5 aborts the process when a connection whose input had
    stopped is replaced (``Assertion failed: _input_stopped``, zeromq/libzmq#3937), seen here
    under a replayed trace. A frame that finds its queue full is dropped and counted: the
    stream sees the gap in the numbers and fills it from the replay endpoint."""

    def __init__(self, endpoint: str, topic: bytes, wake: Callable[[], None]):
        super().__init__(name="kv-events-reader", daemon=True)
        self.endpoint, self.topic, self.wake = endpoint, topic, wake
        self.frames: deque = deque()          # (bytes, frames), appended here, taken on the loop
        self.monitor: deque = deque()
        self.dropped = 0
        self.queued = 0                       # bytes in ``frames`` (approximate across threads)
        self._stop_flag = threading.Event()

    def stop(self) -> None:
        self._stop_flag.set()

    def run(self) -> None:
        from zmq.utils.monitor import parse_monitor_message
        ctx = zmq.Context.instance()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.MAXMSGSIZE, kv_wire.MAX_FRAME)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        sub.connect(self.endpoint)
        poller = zmq.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        try:
            while not self._stop_flag.is_set():
                ready = dict(poller.poll(100))
                woke = False
                if monitor in ready:
                    self.monitor.append(parse_monitor_message(monitor.recv_multipart())["event"])
                    woke = True
                while sub in ready:
                    try:
                        frames = sub.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    size = sum(len(f) for f in frames)
                    if len(self.frames) >= QUEUE_FRAMES or self.queued + size > QUEUE_BYTES:
                        self.dropped += 1
                    else:
                        self.queued += size
                        self.frames.append((size, frames))
                    woke = True
                if woke:
                    self.wake()
        finally:
            sub.disable_monitor()
            monitor.close(0)
            sub.close(0)
