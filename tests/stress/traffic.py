"""SGLang-shaped load for the stress suite: one client process with several threads.

Run as ``python traffic.py CONFIG.json RESULT.json`` (the suite starts several at once). Each
thread repeats what SGLang's HiCache does for one request until the time is up:

1. ``batch_exists`` on the request's page keys (at most 128): the prefetch probe;
2. ``batch_get_into`` of the leading run it found (128-page batches), into a poisoned buffer;
   every page that comes back True is compared with the bytes its key implies;
3. ``batch_put_from`` of the rest (the backup after the prefill computed them).

Requests share prefixes the way prompts do: a request is ``group`` (a shared system prompt of
``prefix_pages`` pages) plus ``variant`` (one of ``variants`` continuations), cut at a random
length, and its keys are a hash chain like SGLang's, so a longer request extends a shorter one.
The set of keys is bounded (``universe_pages``) so a run never needs eviction: an object that
was acknowledged must still be there at the end, whatever the faults.

Page content is derived from the key (64-bit words ``xxh3(key) ^ i * golden``), so a page read
back under the wrong key, shifted, torn or stale is a wrong page, not a silent hit.

The result file holds counters, latencies (µs) per call kind, the time of the first
acknowledgement of each key, per-second buckets, and every exception with its traceback. A
thread still running ``join_slack_s`` after the end is recorded as a hang.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import sys
import threading
import time
import traceback
from collections import defaultdict

import numpy as np
import xxhash

GOLD = np.uint64(0x9E3779B97F4A7C15)
POISON = 0xA5


def universe(groups: int, variants: int, prefix_pages: int, suffix_pages: int, tag: str) -> dict:
    """(group, variant) -> the full list of page keys, a SHA-256 chain as SGLang makes them."""
    out = {}
    for g in range(groups):
        head, prev = [], b""
        for i in range(prefix_pages):
            prev = hashlib.sha256(prev + f"{tag}|g{g}|{i}".encode()).digest()
            head.append(prev)
        for v in range(variants):
            keys, p = list(head), prev
            for i in range(suffix_pages):
                p = hashlib.sha256(p + f"{tag}|g{g}|v{v}|{i}".encode()).digest()
                keys.append(p)
            out[(g, v)] = [f"{tag}/{k.hex()}/kv" for k in keys]
    return out


def universe_size(cfg: dict) -> int:
    return cfg["groups"] * (cfg["prefix_pages"] + cfg["variants"] * cfg["suffix_pages"])


class Pages:
    """Expected page content, and a check of what came back."""

    def __init__(self, page_size: int):
        assert page_size % 8 == 0
        self.page_size = page_size
        self.base = np.arange(page_size // 8, dtype=np.uint64) * GOLD

    @staticmethod
    def seeds(keys) -> np.ndarray:
        return np.array([xxhash.xxh3_64_intdigest(k.encode()) for k in keys], dtype=np.uint64)

    def fill(self, buf: np.ndarray, keys) -> None:
        """Write the content of ``keys`` into the first len(keys) pages of ``buf``."""
        rows = buf[: len(keys) * self.page_size].view(np.uint64).reshape(len(keys), -1)
        np.bitwise_xor(self.base[None, :], self.seeds(keys)[:, None], out=rows)

    def wrong(self, buf: np.ndarray, keys, ok) -> list[int]:
        """Indices of pages marked ok whose bytes are not what their key implies."""
        idx = [i for i, good in enumerate(ok) if good]
        if not idx:
            return []
        rows = buf[: len(keys) * self.page_size].view(np.uint64).reshape(len(keys), -1)[idx]
        expect = self.base[None, :] ^ self.seeds([keys[i] for i in idx])[:, None]
        bad = ~np.all(rows == expect, axis=1)
        return [idx[j] for j in np.flatnonzero(bad)]


class Stats:
    """One thread's record; merged into the process result at the end."""

    def __init__(self, t0: float):
        self.t0 = t0
        self.n = defaultdict(int)
        self.lat = defaultdict(list)             # op -> [µs]
        self.acked: dict[str, float] = {}        # key -> wall time of its first True put
        self.buckets = defaultdict(lambda: defaultdict(int))   # second -> counter -> value
        self.exceptions: list[str] = []
        self.wrong: list[str] = []

    def call(self, op: str, fn, *args):
        start = time.monotonic()
        try:
            return fn(*args)
        finally:
            us = int((time.monotonic() - start) * 1e6)
            self.lat[op].append(us)
            self.n[op + "_calls"] += 1
            self.buckets[int(start - self.t0)][op + "_calls"] += 1

    def count(self, name: str, value: int = 1) -> None:
        self.n[name] += value
        self.buckets[int(time.monotonic() - self.t0)][name] += value


def one_request(client, rng: random.Random, table: dict, cfg: dict, pages: Pages,
                get_buf: np.ndarray, put_buf: np.ndarray, st: Stats) -> None:
    g = min(int(rng.paretovariate(1.2)) - 1, cfg["groups"] - 1)     # a few hot system prompts
    v = rng.randrange(cfg["variants"])
    full = table[(g, v)]
    length = rng.randint(max(1, cfg["prefix_pages"] // 2), len(full))
    keys = full[:length][: cfg["batch"]]
    ps = pages.page_size

    found = st.call("exists", client.batch_exists, keys)
    st.count("exists_keys", len(keys))
    st.count("exists_hits", found)
    if found:
        got_keys = keys[:found]
        get_buf[: found * ps] = POISON
        base = get_buf.ctypes.data
        ok = st.call("get", client.batch_get_into, got_keys, [base + i * ps for i in range(found)],
                     [ps] * found)
        hits = sum(ok)
        st.count("get_pages", found)
        st.count("get_hits", hits)
        for i in pages.wrong(get_buf, got_keys, ok):
            st.wrong.append(got_keys[i])
            st.count("wrong_pages")
        if hits < found:
            st.count("get_short")          # exists said yes, get missed: a fault or an eviction
    todo = keys[found:]
    if todo:
        pages.fill(put_buf, todo)
        base = put_buf.ctypes.data
        ok = st.call("put", client.batch_put_from, todo, [base + i * ps for i in range(len(todo))],
                     [ps] * len(todo))
        st.count("put_pages", len(todo))
        st.count("put_ok", sum(ok))
        if not all(ok):
            st.count("put_failed_calls")
        now = time.time()
        for k, good in zip(todo, ok):
            if good and k not in st.acked:
                st.acked[k] = now
    st.count("requests")


def worker_thread(client, cfg: dict, table: dict, seed: int, end: float, st: Stats) -> None:
    rng = random.Random(seed)
    pages = Pages(cfg["page_size"])
    get_buf = np.empty(cfg["batch"] * cfg["page_size"], dtype=np.uint8)
    put_buf = np.empty(cfg["batch"] * cfg["page_size"], dtype=np.uint8)
    while time.monotonic() < end:
        try:
            one_request(client, rng, table, cfg, pages, get_buf, put_buf, st)
        except Exception:  # the client must never raise on store failures: record, go on
            st.exceptions.append(traceback.format_exc())
            st.count("exceptions")
            if len(st.exceptions) > 20:
                return


def stale_segment_maps() -> int:
    """Deleted node segment files this process still maps (a restarted node's old segment)."""
    with open("/proc/self/maps") as f:
        return len({line.split()[-2] for line in f
                    if "hicache-mc-" in line and line.rstrip().endswith("(deleted)")})


def run(cfg: dict) -> dict:
    from hicache_mc.client import StoreClient

    table = universe(cfg["groups"], cfg["variants"], cfg["prefix_pages"], cfg["suffix_pages"], cfg["tag"])
    client = StoreClient(cfg["master"], transport=cfg["transport"], timeout_s=cfg["timeout_s"],
                         circuit_failures=cfg["circuit_failures"], circuit_open_s=cfg["circuit_open_s"])
    time.sleep(max(0.0, cfg["start_at"] - time.time()))   # all clients begin together
    t0_wall, t0 = time.time(), time.monotonic()
    end = t0 + cfg["seconds"]
    stats = [Stats(t0) for _ in range(cfg["threads"])]
    threads = [threading.Thread(target=worker_thread, name=f"load-{i}", daemon=True,
                                args=(client, cfg, table, cfg["seed"] * 1000 + i, end, stats[i]))
               for i in range(cfg["threads"])]
    for t in threads:
        t.start()
    hung = []
    for t in threads:
        t.join(max(0.0, end + cfg["join_slack_s"] - time.monotonic()))
        if t.is_alive():
            frame = sys._current_frames().get(t.ident)
            hung.append(t.name + "\n" + "".join(traceback.format_stack(frame)) if frame else t.name)
    elapsed = time.monotonic() - t0
    client_stats = dict(client.counters, checksum_failures=client.checks.failures,
                        circuit_opens=client.circuit.opens, stale_segment_maps=stale_segment_maps())
    if not hung:
        client.close()
    return merge(stats, cfg, t0_wall, elapsed, hung, client_stats)


def merge(stats: list[Stats], cfg: dict, t0_wall: float, elapsed: float, hung: list, client_stats: dict) -> dict:
    n, lat, acked, buckets = defaultdict(int), defaultdict(list), {}, defaultdict(lambda: defaultdict(int))
    exceptions, wrong = [], []
    for st in stats:
        for k, v in st.n.items():
            n[k] += v
        for k, v in st.lat.items():
            lat[k].extend(v)
        for k, t in st.acked.items():
            acked[k] = min(t, acked.get(k, t))
        for sec, row in st.buckets.items():
            for k, v in row.items():
                buckets[sec][k] += v
        exceptions += st.exceptions
        wrong += st.wrong
    return {"worker": cfg["worker"], "transport": cfg["transport"], "threads": cfg["threads"],
            "t0": t0_wall, "elapsed_s": elapsed, "counts": dict(n),
            "latency_us": {k: v for k, v in lat.items()}, "acked": acked,
            "buckets": {str(s): dict(r) for s, r in sorted(buckets.items())},
            "exceptions": exceptions, "wrong_keys": wrong[:50], "hung": hung, "client": client_stats}


def main(argv: list[str]) -> int:
    cfg_path, out_path = argv[1], argv[2]
    # the client's warnings (timeouts, checksum misses) with times, to line up with the faults
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    with open(cfg_path) as f:
        cfg = json.load(f)
    result = run(cfg)
    tmp = out_path + ".part"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, out_path)
    # a hung thread cannot be joined; leave without waiting for it (the result says so)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
