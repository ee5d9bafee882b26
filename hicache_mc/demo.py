"""``hicache-mc demo``: an embedded store and a realistic stream of KV pages through it.

It plays two SGLang instances sharing one store. Instance A serves requests that share a
system prompt and each add their own turns, and writes every page it computed (K and V
objects per page, Qwen2.5-1.5B-shaped: 28 layers, 2 KV heads, head dim 128, bf16, page 64 =
896 KiB per object). Instance B then receives the same conversations: it probes with
``batch_exists``, loads the hits with ``batch_get_into`` and checks every byte.
"""
from __future__ import annotations

import hashlib
import logging
import math
import sys
import tempfile
import threading
import time

import numpy as np

from .client import StoreClient
from .config import MasterConfig, NodeConfig, load_config, parse_size
from .keys import KVNamespace, batch_page_keys
from .master.service import MasterService
from .node.service import StorageNode

LAYERS, HEADS, HEAD_DIM, PAGE, ITEMSIZE = 28, 2, 128, 64, 2
OBJECT_BYTES = LAYERS * PAGE * HEADS * HEAD_DIM * ITEMSIZE


class EmbeddedStore:
    """Master + one node on loopback, in this process (threads), on a free port."""

    def __init__(self, dram: str):
        self.master = MasterService(load_config(MasterConfig, env={}, port=0, metrics_port=-1,
                                                       publish_port=0))
        self.node = StorageNode(load_config(NodeConfig, env={}, master=self.master.address, dram=dram,
                                            metrics_port=-1,
                                            data_dir=tempfile.mkdtemp(prefix="hicache-mc-demo-")))
        self.threads = [threading.Thread(target=s.serve_forever, daemon=True)
                        for s in (self.master, self.node)]

    def __enter__(self) -> "EmbeddedStore":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        for s in (self.node, self.master):
            s.stop()
        for t in self.threads:
            t.join(5)


def page_hashes(tokens: list[int]) -> list[str]:
    """Chained per-page SHA-256 over token ids, as SGLang computes its page keys."""
    out, prev = [], b""
    for i in range(0, len(tokens) - len(tokens) % PAGE, PAGE):
        h = hashlib.sha256(prev + np.asarray(tokens[i:i + PAGE], dtype="<u4").tobytes())
        out.append(h.hexdigest())
        prev = h.digest()
    return out


def fill(key: str, buf: np.ndarray) -> None:
    """Page bytes derived from the key, so a wrong page would be detected."""
    seed = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")
    buf[:] = np.random.default_rng(seed).integers(0, 256, buf.size, dtype=np.uint8)


def conversations(requests: int, pages: int) -> list[list[int]]:
    rng = np.random.default_rng(0)
    system = rng.integers(0, 150_000, PAGE * (pages // 2)).tolist()   # shared prefix: half the pages
    return [system + rng.integers(0, 150_000, PAGE * (pages - pages // 2)).tolist()
            for _ in range(requests)]


def dram_needed(requests: int, pages: int) -> int:
    """DRAM that holds every object of the stream below the node's eviction threshold."""
    objects = 2 * (pages // 2 + requests * (pages - pages // 2))    # K and V of distinct pages
    return math.ceil(objects * OBJECT_BYTES / NodeConfig.high_watermark)


def run_demo(dram: str = "2GiB", requests: int = 16, pages: int = 32) -> int:
    need = dram_needed(requests, pages)
    if parse_size(dram, "dram") < need:
        print(f"hicache-mc demo: {requests} requests x {pages} pages need {-(-need >> 20)} MiB of "
              f"DRAM, more than --dram {dram}: give it --dram {-(-need >> 20)}MiB or more, or "
              "fewer --requests / --pages", file=sys.stderr)
        return 1
    logging.getLogger("hicache_mc").setLevel(logging.WARNING)
    ns = KVNamespace("Qwen/Qwen2.5-1.5B-Instruct", "torch.bfloat16", "page_first", PAGE,
                     0, LAYERS - 1).digest()
    convs = conversations(requests, pages)
    staging = np.empty((2 * pages, OBJECT_BYTES), dtype=np.uint8)
    with EmbeddedStore(dram) as store, StoreClient(store.master.address) as a, \
            StoreClient(store.master.address) as b:
        print(f"hicache-mc demo: embedded store (master {store.master.address}, node "
              f"{store.node.address}, {dram} DRAM); pages of {OBJECT_BYTES >> 10} KiB K + V, "
              f"{requests} requests x {pages} pages, half of each a shared system prompt")
        put_t = put_bytes = written = skipped = 0
        for tokens in convs:                                   # instance A: prefill + backup
            keys = batch_page_keys(ns, page_hashes(tokens), ("k", "v"))
            hit = a.batch_exists(keys) // 2 * 2               # whole pages already stored
            todo = keys[hit:]
            for i, k in enumerate(todo):
                fill(k, staging[i])
            t0 = time.perf_counter()
            ok = a.batch_put_from(todo, [staging[i].ctypes.data for i in range(len(todo))],
                                  [OBJECT_BYTES] * len(todo))
            put_t += time.perf_counter() - t0
            put_bytes += OBJECT_BYTES * sum(ok)
            written += sum(ok) // 2
            skipped += hit // 2
            if not all(ok):
                print(f"  warning: {len(ok) - sum(ok)} objects not stored")
        print(f"instance A: wrote {written} pages ({put_bytes / 2**20:.0f} MiB) at "
              f"{put_bytes / put_t / 1e9:.2f} GB/s; {skipped} shared-prefix pages were already stored")

        get_t = got = bad = 0
        for tokens in convs:                                   # instance B: prefetch
            keys = batch_page_keys(ns, page_hashes(tokens), ("k", "v"))
            hit = b.batch_exists(keys) // 2 * 2
            t0 = time.perf_counter()
            ok = b.batch_get_into(keys[:hit], [staging[i].ctypes.data for i in range(hit)],
                                  [OBJECT_BYTES] * hit)
            get_t += time.perf_counter() - t0
            check = np.empty(OBJECT_BYTES, dtype=np.uint8)
            for i, k in enumerate(keys[:hit]):
                fill(k, check)
                bad += (not ok[i]) or not np.array_equal(staging[i], check)
            got += sum(ok)
        gbps = got * OBJECT_BYTES / get_t / 1e9 if get_t else 0.0
        print(f"instance B: loaded {got // 2} of {requests * pages} pages from the store at "
              f"{gbps:.2f} GB/s, every byte checked: {bad} wrong")
        st = b.stats()["cluster"]
        print(f"store: {st['keys']} keys, {st['used'] >> 20} MiB used of {st['capacity'] >> 20} MiB; "
              f"{st['hits']} keys found, {st['misses']} not found by lookups, {st['evicted']} evicted")
    missing = 2 * requests * pages - got
    print("demo finished:", "OK" if bad == missing == 0 else
          f"FAILED: {missing} objects not loaded, {bad} wrong (the lines above say where)")
    return 0 if bad == missing == 0 else 1
