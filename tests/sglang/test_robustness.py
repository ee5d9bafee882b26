"""Two instances, SGLang's concurrent threads, and a store that goes away and comes back."""
from __future__ import annotations

import logging
import os
import random
import subprocess
import sys
import threading
import time

import torch

from pools import (fill_random, make_backend, mha_host, page_bytes, page_hashes, slots,
                   wait_view_out_of_sync)
from procs import Cluster, free_port

PEER = os.path.join(os.path.dirname(__file__), "peer.py")


def test_two_instances_in_two_processes_share_pages(shared_store):
    pages = 4
    # The peer writes salt 101 / seed 21 and, once we have written, reads our salt 202 / seed 22.
    pool = mha_host("page_first")
    backend = make_backend(pool, shared_store.master)
    src = slots(pool, pages)
    fill_random(pool, src, seed=22)
    assert backend.batch_set_v1(page_hashes(pages, pool.page_size, 202), src) == [True] * pages
    out = subprocess.run([sys.executable, PEER, shared_store.master, "page_first",
                          "101", "21", "202", "22", str(pages)],
                         capture_output=True, text=True, timeout=240)
    assert out.stdout.strip().splitlines()[-1:] == [f"stored {pages} read {pages} equal 1"], out.stderr[-3000:]
    # ... and what the peer wrote, we read.
    keys, dst, ref = page_hashes(pages, pool.page_size, 101), slots(pool, pages), slots(pool, pages)
    assert backend.batch_get_v1(keys, dst) == [True] * pages
    fill_random(pool, ref, seed=21)
    for want, got in zip(page_bytes(pool, ref), page_bytes(pool, dst)):
        assert torch.equal(want, got)
    backend.close()


def _concurrent_run(backend, pool, seconds: float) -> dict:
    """SGLang's three storage threads on one backend: backup, prefetch probe, prefetch I/O."""
    n, batch, per = 24, 4, pool.page_size
    keys = page_hashes(n, per)
    src, dst = slots(pool, n), slots(pool, 8)
    fill_random(pool, src, seed=31)
    want = page_bytes(pool, src)
    published = [0]          # pages stored so far (a prefix of keys)
    errors: list = []
    counts = {"set": 0, "exists": 0, "get_pages": 0}
    stop = time.monotonic() + seconds

    def guard(fn):
        def run():
            try:
                fn()
            except BaseException as exc:    # the test fails on any escape
                errors.append(exc)
        return run

    @guard
    def backup():
        b = 0
        while time.monotonic() < stop:
            lo = (b % (n // batch)) * batch  # after one pass, rewrites: stored pages count as done
            assert backend.batch_set_v1(keys[lo:lo + batch], src[lo * per:(lo + batch) * per]) == [True] * batch
            published[0] = max(published[0], lo + batch)
            counts["set"] += 1
            b += 1

    @guard
    def probe():
        while time.monotonic() < stop:
            k = published[0]
            assert backend.batch_exists(keys) >= k
            counts["exists"] += 1

    @guard
    def prefetch():
        rng = random.Random(3)
        while time.monotonic() < stop:
            k = published[0]
            if k == 0:
                continue
            lo = rng.randrange(k)
            m = min(8, k - lo)
            fill_random(pool, dst[:m * per], seed=rng.randrange(1 << 30))   # poison
            ok = backend.batch_get_v1(keys[lo:lo + m], dst[:m * per])
            assert ok == [True] * m
            for w, g in zip(want[lo:lo + m], page_bytes(pool, dst[:m * per])):
                assert torch.equal(w, g)
            counts["get_pages"] += m

    threads = [threading.Thread(target=f) for f in (backup, probe, prefetch)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 30)
    assert not errors, errors[0]
    return counts


def test_three_threads_at_once_read_back_every_page_right(shared_store):
    for layout in ("page_first", "layer_first"):    # zero-copy, and staged with per-thread buffers
        pool = mha_host(layout, tokens=256)
        backend = make_backend(pool, shared_store.master)
        counts = _concurrent_run(backend, pool, seconds=1.5)
        assert counts["set"] > 6 and counts["exists"] > 10 and counts["get_pages"] > 10, counts
        backend.close()


def test_store_down_gives_quick_misses_and_store_back_gives_hits(store, caplog):
    caplog.set_level(logging.INFO, logger="hicache_mc.sglang")
    pool = mha_host("page_first")
    backend = make_backend(pool, store.master, timeout_s=1.0, circuit_open_s=0.3)
    keys = page_hashes(3, pool.page_size)
    src, dst = slots(pool, 3), slots(pool, 3)
    fill_random(pool, src, seed=41)
    assert backend.batch_set_v1(keys, src) == [True] * 3

    store.stop()
    wait_view_out_of_sync(backend)
    for _ in range(2):    # the first calls time out, later ones meet the open circuit
        t0 = time.monotonic()
        assert backend.batch_exists(keys) == 0
        assert backend.batch_get_v1(keys, dst) == [False] * 3
        assert backend.batch_set_v1(keys, src) == [False] * 3
        assert backend.batch_get(keys, [pool.get_dummy_flat_data_page() for _ in keys]) == [None] * 3
        assert time.monotonic() - t0 < 4 * 1.0 + 1.0      # each call within its 1 s deadline

    failures = [r for r in caplog.records if "batch_set_v1 failed" in r.getMessage()]
    assert len(failures) == 1                             # one line per failure episode

    store.start()          # same port; an empty store: write again, then read, same backend
    deadline = time.monotonic() + 20
    while backend.batch_set_v1(keys, src) != [True] * 3:
        assert time.monotonic() < deadline, "backend did not recover after the store came back"
        time.sleep(0.2)
    assert backend.batch_exists(keys) == 3
    assert backend.batch_get_v1(keys, dst) == [True] * 3
    for w, g in zip(page_bytes(pool, src), page_bytes(pool, dst)):
        assert torch.equal(w, g)
    assert any("batch_set_v1 recovered" in r.getMessage() for r in caplog.records)
    backend.close()


def test_a_master_that_does_not_answer_is_a_loud_warning_at_start_not_a_failure(shared_store, caplog):
    caplog.set_level(logging.INFO, logger="hicache_mc.sglang")
    pool = mha_host("page_first")
    gone = f"127.0.0.1:{free_port()}"                     # nothing listens there
    backend = make_backend(pool, gone)
    loud = [r for r in caplog.records if "NO L3 CACHE" in r.getMessage()]
    assert len(loud) == 1 and loud[0].levelno == logging.WARNING
    assert f"the master at tcp://{gone}: connection refused" in loud[0].getMessage()
    keys = page_hashes(2, pool.page_size)
    assert backend.batch_exists(keys) == 0 and backend.batch_set_v1(keys, slots(pool, 2)) == [False] * 2
    backend.close()
    caplog.clear()
    make_backend(pool, shared_store.master).close()       # a store that answers: nothing loud
    assert not [r for r in caplog.records if "NO L3 CACHE" in r.getMessage()]


def test_a_backend_without_the_token_names_it_at_start(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="hicache_mc.sglang")
    c = Cluster(tmp_path, token="backend-token-" + "5a" * 16)
    c.start_serve("32MiB")
    try:
        for token, cause in (("", "it requires a token and this process has none"),
                             ("another-" + "77" * 16, "it refused this process's token")):
            caplog.clear()
            make_backend(mha_host("page_first"), c.master, token=token).close()
            loud = [r.getMessage() for r in caplog.records if "NO L3 CACHE" in r.getMessage()]
            assert len(loud) == 1 and f"the master at {c.master}: {cause}" in loud[0], loud
    finally:
        c.stop()
