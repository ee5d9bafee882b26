"""SGLang router's ``cache_aware`` policy as an ``api.Router``, from its documented rules
(sgl-project/sglang ``sgl-model-gateway/src/policies/cache_aware.rs``, ``sgl-router`` before
it):

1. Load is the router's own count of requests in flight per worker. The fleet is
   *imbalanced* when ``max - min > balance_abs_threshold`` **and**
   ``max > balance_rel_threshold x min``; then the request goes to the least loaded worker
   (the first of them in worker order).
2. Otherwise the approximate tree (``approx_tree.py``; built from this router's own routing
   history, never from KV events, no tiers, no L3) is matched: if the matched share of the
   request's text exceeds ``cache_threshold``, the request goes to the worker holding the
   match; else to the worker whose tree is smallest ("most available cache").
3. Either way the request's text is inserted for the chosen worker. Every
   ``eviction_interval_s`` each worker's tree is trimmed to ``max_tree_size`` characters,
   least recently used leaves first.

Here a request's "text" is its chain of page hashes: the match share is the matched pages'
tokens (the last page may be partial) over the prompt's tokens, and the tree size limit in
characters becomes pages at ``chars_per_token`` (about 4 for English with Llama-3's
tokenizer) x ``page_tokens``.

Defaults: the issue's (0.5, 32, 1.5). SGLang's own are not one set: the Rust library's
``CacheAwareConfig::default`` is 0.5 / 32 / 1.1 / 30 s / 10,000, the command line's is
0.3 / 64 / 1.5 / 120 s / 2^26 characters. The interval and tree size here are the command
line's (a deployment's), which at 512-token pages is 32,768 pages per worker.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from hicache_mc.conductor import api

from .approx_tree import ApproxTree
from .baselines import InFlightRouter


@dataclass(frozen=True)
class CacheAwareConfig:
    cache_threshold: float = 0.5
    balance_abs_threshold: int = 32
    balance_rel_threshold: float = 1.5
    eviction_interval_s: float = 120.0
    max_tree_size: int = 2 ** 26          # characters
    chars_per_token: int = 4


class SglangCacheAware(InFlightRouter):
    def __init__(self, config: CacheAwareConfig = CacheAwareConfig()):
        super().__init__()
        self.config = config
        self.tree = ApproxTree()
        self.page_tokens = 0
        self.next_eviction_s = config.eviction_interval_s

    def add_worker(self, spec: api.WorkerSpec) -> None:
        super().add_worker(spec)
        self.tree.add_tenant(spec.name)
        self.page_tokens = spec.page_tokens

    def remove_worker(self, name: str) -> None:
        super().remove_worker(name)
        self.tree.remove_tenant(name)

    def imbalanced(self) -> bool:
        loads = self.inflight.values()
        hi, lo = max(loads), min(loads)
        c = self.config
        return hi - lo > c.balance_abs_threshold and hi > c.balance_rel_threshold * lo

    def route(self, req: api.Request, now_s: float) -> Union[api.Decision, api.Rejection]:
        if not self.workers:
            return self.no_worker()
        c = self.config
        if now_s >= self.next_eviction_s:
            max_pages = c.max_tree_size // (c.chars_per_token * max(1, self.page_tokens))
            self.tree.evict(max_pages)
            self.next_eviction_s = now_s + c.eviction_interval_s
        chain = req.page_hashes
        if self.imbalanced():
            worker = min(self.workers, key=self.inflight.__getitem__)
            why = "imbalanced: least load"
        else:
            match = self.tree.match(chain)
            rate = min(match.pages * self.page_tokens, req.prompt_tokens) / max(
                1, req.prompt_tokens)
            if rate > c.cache_threshold and match.tenant in self.inflight:
                worker, why = match.tenant, f"match {rate:.2f}"
            else:
                worker = self.tree.smallest_tenant(self.workers)
                why = f"match {rate:.2f} <= {c.cache_threshold}: smallest tree"
        self.tree.insert(chain, worker, now_s)
        return self.send(req, worker, why)
