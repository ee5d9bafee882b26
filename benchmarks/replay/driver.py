"""Replay a trace across N instance processes, round-robin (a cache-unaware load balancer).

Two pacings:

- ordered (``speedup=None``): request i+1 is handed out only once request i is done, puts
  included. Requests still run on N processes against one store, but the outcome is the
  trace's own order of events, so hit rates are exact and repeatable (the test relies on it).
- concurrent (``speedup=S``): request i is handed out at ``timestamp / S`` (``S=0``: at once),
  and instances work through their queues in parallel; a request may miss blocks that
  another instance is still computing, as in a real cluster.
"""
from __future__ import annotations

import multiprocessing as mp
import queue
import time
import uuid
from typing import Callable, Optional, Sequence

from .instance import InstanceConfig, Outcome, run_instance
from .trace import Request

READY_TIMEOUT_S = 120.0
REQUEST_TIMEOUT_S = 120.0


class ReplayError(RuntimeError):
    pass


def replay(reqs: Sequence[Request], spec: dict, instances: int, local_blocks: int,
           block_bytes: int, speedup: Optional[float] = None,
           before: Optional[Callable[[int], None]] = None, namespace: str = "",
           **instance) -> list[Outcome]:
    """Outcomes of every request (in trace order), replayed against the L3 of ``spec``.
    Ordered replays call ``before(i)`` before handing request i out (a fault injected there
    meets every later request). Keys are ``<namespace>/<block id>`` (a fresh namespace by
    default); ``instance``: further ``InstanceConfig`` fields."""
    ctx = mp.get_context("spawn")
    cfg = InstanceConfig(local_blocks, block_bytes, max(len(r.hash_ids) for r in reqs),
                         namespace or f"replay/{uuid.uuid4().hex[:8]}", **instance)
    inqs = [ctx.Queue() for _ in range(instances)]
    outq = ctx.Queue()
    procs = [ctx.Process(target=run_instance, args=(i, spec, cfg, inqs[i], outq), daemon=True,
                         name=f"instance-{i}") for i in range(instances)]
    for p in procs:
        p.start()
    outcomes: dict[int, Outcome] = {}
    try:
        for _ in range(instances):
            _take(outq, procs, READY_TIMEOUT_S, "ready")
        if speedup is None:
            for r in reqs:
                if before is not None:
                    before(r.index)
                inqs[r.index % instances].put((r.index, r.hash_ids))
                o = _take(outq, procs, REQUEST_TIMEOUT_S, "done")
                outcomes[o.index] = o
        else:
            _concurrent(reqs, inqs, outq, procs, speedup, outcomes)
    finally:
        for q in inqs:
            q.put(None)
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    return [outcomes[r.index] for r in reqs]


def _concurrent(reqs, inqs, outq, procs, speedup, outcomes) -> None:
    start = time.monotonic()
    n = len(inqs)
    for r in reqs:
        if speedup:
            wait = start + r.timestamp_ms / 1000.0 / speedup - time.monotonic()
            while wait > 0:     # collect results while waiting for the next arrival
                _drain(outq, outcomes, min(wait, 0.05))
                wait = start + r.timestamp_ms / 1000.0 / speedup - time.monotonic()
        inqs[r.index % n].put((r.index, r.hash_ids))
        _drain(outq, outcomes, 0)
    while len(outcomes) < len(reqs):
        o = _take(outq, procs, REQUEST_TIMEOUT_S, "done")
        outcomes[o.index] = o


def _drain(outq, outcomes, timeout: float) -> None:
    """Collect whatever results arrive within ``timeout`` seconds (0: those already there)."""
    msg = _poll(outq, timeout)
    while msg is not None:
        o = _check(msg, "done")
        outcomes[o.index] = o
        msg = _poll(outq, 0)


def _take(outq, procs, timeout: float, want: str):
    """The next message's payload; raises when an instance failed or nothing came in time."""
    end = time.monotonic() + timeout
    while True:
        msg = _poll(outq, min(1.0, max(end - time.monotonic(), 0.0)))
        if msg is not None:
            return _check(msg, want)
        dead = [p.name for p in procs if not p.is_alive()]
        if dead or time.monotonic() >= end:
            raise ReplayError(f"no {want!r} from the instances in {timeout:.0f}s"
                              + (f"; ended: {', '.join(dead)}" if dead else ""))


def _poll(outq, timeout: float):
    try:
        return outq.get(timeout=timeout) if timeout > 0 else outq.get_nowait()
    except queue.Empty:
        return None


def _check(msg, want: str):
    kind, idx, payload = msg
    if kind == "error":
        raise ReplayError(f"instance {idx} failed:\n{payload}")
    if kind != want:
        raise ReplayError(f"instance {idx}: expected {want!r}, got {kind!r}")
    return payload
