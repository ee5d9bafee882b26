"""One simulated SGLang instance: continuous batching over a GPU (L1) and a host (L2) pool,
pulling from the shared L3, timed by ``hicache_mc.conductor.perf``.

What it does, after SGLang's scheduler with HiCache (defaults on an 80 GB GPU):

- **Arrival.** A request joins the waiting queue (FCFS). Its prefix in L1 then L2 is local;
  the L3's leading run past that is prefetched into L2 at once (the storage prefetch), and the
  request is not scheduled before its prefetch is in (``wait_complete``).
- **Prefill** has priority over decode: whenever requests wait, the next forward is a prefill
  batch of up to ``chunk_tokens`` new tokens (chunked prefill: one request may be split over
  several forwards), admitted while the GPU pool has room for their prompt plus a decode
  reserve. At admission the prefix is matched again: L1, then L2 pages loaded into L1 at
  ``host_bw`` layer by layer under the compute, as SGLang's HiCache does (each layer waits
  for its own pages: ``max(compute, load)`` plus one layer's load; ``overlap_load`` off: the
  load, then the compute). When a request's last chunk is done, its first token is out
  (TTFT), its pages enter L1 and L2 (write-through) and are backed up to the L3, and it joins
  the decode batch.
- **Pages.** Only a prompt's full pages are cached, and a match stops a token short of the
  prompt (SGLang recomputes at least the last token), so a prompt of ``n`` tokens can reuse
  at most ``(n - 1) // page_tokens`` pages.
- **Decode** runs while no prefill can start: one step per token for the whole batch
  (``perf.decode_step_s``). Steps are simulated in runs up to the next request to finish; a
  request that becomes schedulable cuts the run at the next step boundary.
- **Pools.** L1 holds pages by LRU in the room the running requests' generated tokens leave;
  L2 by LRU (write-through, so it holds what L1 holds unless it is smaller). Every page a
  pool gains or drops is a KV event (``BlocksStored`` / ``BlocksRemoved``, GPU or HOST).
  Pages of running requests are not pinned (SGLang locks them): with the admission reserve,
  the LRU reaches them only when the pool is nearly full.

Timing noise (``perturb_sigma``: a lognormal factor per request's prefill and per decode run)
models prediction error. The instance never calls out: the simulator reads ``outbox``,
``started``, ``finished`` after each call and schedules the times it returns.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from hicache_mc.conductor import api
from hicache_mc.conductor.perf import CHUNKED_PREFILL_TOKENS, MAX_RUNNING_REQUESTS, PerfModel

from .cache import BlockLRU, Change
from .l3 import SharedL3

IDLE, PREFILL, DECODE = 0, 1, 2


@dataclass(frozen=True)
class InstanceConfig:
    l1_pages: int                     # GPU KV pool, pages
    l2_pages: int                     # host pool, pages (SGLang's default: 2 x the GPU's)
    host_bw: float                    # L2 -> L1, bytes/s
    l3_bw: float                      # the L3 <-> L2 path, bytes/s
    page_tokens: int = 512
    chunk_tokens: int = CHUNKED_PREFILL_TOKENS
    max_running: int = MAX_RUNNING_REQUESTS
    decode_reserve: int = 614         # tokens held back per running request: SGLang's
                                      # new-token ratio floor-ish (0.3) x 2048 max new tokens
    overlap_load: bool = True         # L2 -> L1 layer by layer under the compute, as SGLang


class Job:
    """A request on its instance: what it asked for, how far it got, what it was served from."""
    __slots__ = ("rid", "chain", "usable", "prompt", "output", "arrival", "noise", "eligible",
                 "pf_from", "pf_n", "admitted", "done", "load_pages", "gpu", "host", "l3",
                 "compute_s", "first_token", "generated", "finish", "worker")

    def __init__(self, rid: int, chain: tuple, prompt: int, output: int, arrival: float,
                 noise: float = 1.0, page_tokens: int = 512):
        # ``chain``: the prompt's full pages (a partial page is never cached); a prefix match
        # stops a token short of the prompt, so the last full page is usable only if a token
        # follows it
        self.rid, self.prompt, self.output = rid, prompt, output
        self.chain = chain[:prompt // page_tokens]
        self.usable = (prompt - 1) // page_tokens
        self.arrival, self.noise, self.eligible = arrival, noise, arrival
        self.pf_from = self.pf_n = self.done = self.load_pages = 0
        self.admitted = False                            # to a prefill batch: runs to the end
        self.gpu = self.host = self.l3 = 0               # prompt tokens served per tier
        self.compute_s = 0.0
        self.first_token = self.finish = -1.0
        self.generated = 0
        self.worker = -1


class SimInstance:
    def __init__(self, index: int, name: str, cfg: InstanceConfig, perf: PerfModel,
                 l3: SharedL3, names, rng, sigma: float = 0.0):
        self.index, self.name, self.cfg, self.perf, self.l3 = index, name, cfg, perf, l3
        self.names, self.rng, self.sigma = names, rng, sigma
        self.page_bytes = perf.page_bytes(cfg.page_tokens)
        self.l1_tokens = cfg.l1_pages * cfg.page_tokens
        self.l1, self.l2 = BlockLRU(cfg.l1_pages), BlockLRU(cfg.l2_pages)
        self.waiting: list[Job] = []
        self.running: list[Job] = []
        self.op, self.op_end, self.version = IDLE, 0.0, 0
        self.batch: list = []                            # (job, new tokens, compute s)
        self.seg_t0 = self.seg_step = 0.0
        self.seg_steps = 0
        self.kv_tokens = 0             # running requests: prompt + generated
        self.generated_tokens = 0      # running requests: generated (shrinks the L1 cache)
        self.admitted_tokens = 0       # prompts admitted to prefill, not yet running
        self.waiting_tokens = 0        # SGLang's pending tokens: whole prompts of queued
                                       # requests + what is left of those being prefilled
        self.queued = 0                # requests not yet admitted to a prefill
        self.outbox: list = []         # api events since the last drain
        self.started: list[Job] = []
        self.finished: list[Job] = []

    # -- what the simulator calls ------------------------------------------------------------

    def arrive(self, job: Job, now: float) -> Optional[float]:
        """Queue ``job``; start its L3 prefetch. Returns when the prefetch is in, if any."""
        chain = job.chain
        local = self.l1.leading(chain)
        local += self.l2.leading(chain, local)
        job.worker = self.index
        self.waiting.append(job)
        self.waiting_tokens += job.prompt
        self.queued += 1
        n = min(self.l3.leading(chain, local, now), job.usable - local)
        if n <= 0:
            return None
        job.pf_from, job.pf_n = local, n
        job.eligible = self.l3.read(chain[local:local + n], now, self.cfg.l3_bw)
        return job.eligible

    def prefetched(self, job: Job, now: float) -> None:
        """``job``'s prefetch is in: its pages enter L2."""
        self._publish(api.Tier.HOST, self.l2.touch(job.chain[job.pf_from:job.pf_from + job.pf_n]))

    def abandon(self, job: Job) -> bool:
        """``job``'s client gave up: if it is still queued it leaves at no compute cost, as
        SGLang drops a request whose connection closed; once admitted it runs to the end."""
        if job.admitted or job.worker != self.index:
            return False
        self.waiting.remove(job)
        self.queued -= 1
        self.waiting_tokens -= job.prompt
        return True

    def poke(self, now: float) -> Optional[float]:
        """A request became schedulable: start work if idle, or end the decode run at the next
        step boundary. Returns the new wake-up time, or None if it did not change."""
        if self.op == IDLE:
            return self._start(now)
        if self.op == DECODE:
            steps = max(0, math.ceil((now - self.seg_t0) / self.seg_step - 1e-9))
            if steps < self.seg_steps:
                self.seg_steps = steps
                return self._set_end(self.seg_t0 + steps * self.seg_step)
        return None

    def wake(self, now: float) -> Optional[float]:
        """The current forward (or decode run) is over: account for it, start the next."""
        if self.op == PREFILL:
            self._end_prefill(now)
        elif self.op == DECODE:
            self._end_decode(now)
        return self._start(now)

    def load(self, now: float) -> api.LoadReport:
        used = self.kv_tokens + self.admitted_tokens + len(self.l1) * self.cfg.page_tokens
        return api.LoadReport(self.name, now, self.queued, self.waiting_tokens,
                              len(self.running), self.kv_tokens,
                              min(1.0, used / self.l1_tokens))

    # -- prefill ----------------------------------------------------------------------------

    def _start(self, now: float) -> Optional[float]:
        if self.waiting and self._begin_prefill(now):
            return self.op_end
        if self.running:
            return self._begin_decode(now)
        self.op = IDLE
        return None

    def _begin_prefill(self, now: float) -> bool:
        cfg, perf = self.cfg, self.perf
        budget, slots = cfg.chunk_tokens, cfg.max_running - len(self.running)
        room = (self.l1_tokens - self.kv_tokens - self.admitted_tokens
                - cfg.decode_reserve * len(self.running))
        batch, load_pages, compute = [], 0, 0.0
        for job in self.waiting:
            if budget <= 0 or len(batch) >= slots:
                break
            if not job.admitted:
                if job.eligible > now:
                    continue                        # its prefetch is still on the way
                need = job.prompt + cfg.decode_reserve
                if need > room and (batch or self.running or self.admitted_tokens):
                    break                           # FCFS: wait for memory, as SGLang does
                room -= need
                job.admitted = True
                self.admitted_tokens += job.prompt
                self.queued -= 1
                self._match(job)
                self.waiting_tokens -= job.done     # served from the cache, not prefilled
                load_pages += job.load_pages
            new = min(job.prompt - job.done, budget)
            budget -= new
            c = perf.prefill_compute_s(new, job.done) * job.noise
            compute += c
            batch.append((job, new, c))
        if not batch:
            return False
        compute += perf.prefill_overhead_s
        load = load_pages * self.page_bytes / cfg.host_bw
        if cfg.overlap_load:        # each layer waits for its own pages: a pipeline
            compute = max(compute, load) + load / perf.model.layers
        else:
            compute += load
        self.batch = batch
        self.op = PREFILL
        self._set_end(now + compute)
        return True

    def _match(self, job: Job) -> None:
        """Admission: the prefix now in L1, then L2 (loaded into L1 for this prefill). The
        loaded pages enter L1, as GPU events, with the computed ones when the prefill ends."""
        chain, pt = job.chain, self.cfg.page_tokens
        k1 = min(self.l1.leading(chain), job.usable)
        k2 = min(self.l2.leading(chain, k1), job.usable - k1)
        cached = (k1 + k2) * pt
        from_l3 = max(0, min(job.pf_from + job.pf_n, k1 + k2) - max(job.pf_from, k1))
        job.gpu = min(k1 * pt, cached)
        job.l3 = min(from_l3 * pt, cached - job.gpu)
        job.host = cached - job.gpu - job.l3
        job.done, job.load_pages = cached, k2       # into L1 with the rest at the end

    def _end_prefill(self, now: float) -> None:
        finished_prefill = []
        for job, new, c in self.batch:
            self.waiting_tokens -= new
            job.done += new
            job.compute_s += c
            if job.done >= job.prompt:
                finished_prefill.append(job)
        self.batch = []
        if not finished_prefill:
            return
        for job in finished_prefill:
            self.waiting.remove(job)        # near the head: FCFS
            self.admitted_tokens -= job.prompt
            job.first_token = now
            self.started.append(job)
            self._publish(api.Tier.GPU, self.l1.touch(job.chain))
            self._publish(api.Tier.HOST, self.l2.touch(job.chain))
            self.l3.write(job.chain, now, self.cfg.l3_bw)
            if job.output <= 1:
                job.generated, job.finish = 1, now
                self.finished.append(job)
            else:
                job.generated = 1
                self.running.append(job)
                self.kv_tokens += job.prompt + 1
                self.generated_tokens += 1

    # -- decode -----------------------------------------------------------------------------

    def _begin_decode(self, now: float) -> float:
        run = self.running
        steps = min(j.output - j.generated for j in run)
        b = len(run)
        step = self.perf.decode_step_s(b, self.kv_tokens + b * steps // 2)
        if self.sigma:
            step *= self.rng.lognormvariate(0.0, self.sigma)
        self.op, self.seg_t0, self.seg_step, self.seg_steps = DECODE, now, step, steps
        return self._set_end(now + steps * step)

    def _end_decode(self, now: float) -> None:
        steps, run = self.seg_steps, self.running
        if steps:
            for j in run:
                j.generated += steps
            self.kv_tokens += steps * len(run)
            self.generated_tokens += steps * len(run)
            keep = [j for j in run if j.generated < j.output]
            if len(keep) != len(run):
                for j in run:
                    if j.generated >= j.output:
                        j.finish = now
                        self.kv_tokens -= j.prompt + j.generated
                        self.generated_tokens -= j.generated
                        self.finished.append(j)
                self.running = keep
        pt = self.cfg.page_tokens
        room = self.cfg.l1_pages - (self.generated_tokens + pt - 1) // pt
        if room != self.l1.capacity:
            self._publish(api.Tier.GPU, self.l1.resize(room))

    # -- plumbing ---------------------------------------------------------------------------

    def _set_end(self, t: float) -> float:
        self.op_end = t
        self.version += 1
        return t

    def _publish(self, tier: api.Tier, change: Change) -> None:
        if change.stored:
            self.outbox.append(api.BlocksStored(self.name, tier,
                                                self.names.block_hashes(change.stored)))
        if change.removed:
            self.outbox.append(api.BlocksRemoved(self.name, tier,
                                                 self.names.block_hashes(change.removed)))
