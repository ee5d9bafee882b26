"""Storage node: bytes of metadata per object, and what a tenant's clear costs.

Three measurements, in one run:

1. In-process (tracemalloc): the Python memory a node's storage core holds per object, for
   objects in DRAM and for objects on SSD only (the index a restarted node reads back), keys
   shaped as the SGLang backend makes them (``<16 hex>@tenant/<64 hex>/k``, 89 characters).
   This is the figure ``node/store.py`` charges each object (``OBJECT_BYTES``).
2. A real ``hicache-mc node`` process (with a master) that takes ``--objects`` 1-byte puts
   through ``StoreClient``: its anonymous RSS growth per object (``RssAnon``: the heap, not
   the shared-memory segment).
3. A clear by a tenant that holds 2 objects, on a node holding ``--objects`` of another
   tenant's: the store's clear (the tenant's own keys) against a scan of every key on the
   node (what a clear cost before the per-tenant index), same store, same run.

    .venv/bin/python benchmarks/bench_node_memory.py [--objects 200000]
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time
import tracemalloc

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from common import table, write_json  # noqa: E402
from hicache_mc.node.dram import DramTier  # noqa: E402
from hicache_mc.node.ssd import Job, SsdTier  # noqa: E402
from hicache_mc.node.store import OBJECT_BYTES, TieredStore  # noqa: E402

MiB = 1 << 20


def key(i: int, tenant: str = "teamA") -> str:
    """The ``i``-th page's key of one model's namespace (as ``hicache_mc/keys.py`` makes it)."""
    return f"3f2a9c0d5e7b1a46@{tenant}/{i:064x}/k"


def fill(store: TieredStore, n: int, tenant: str = "teamA", batch: int = 4096) -> None:
    """``n`` 1-byte objects committed as a writer would (reserve, commit)."""
    for lo in range(0, n, batch):
        keys = [key(i, tenant) for i in range(lo, min(n, lo + batch))]
        got = store.reserve_many(keys, [1] * len(keys), 0.0, 60.0, MiB)
        assert all(r.offset >= 0 for r in got), "DRAM too small for the objects"
        store.commit_many(keys, [0] * len(keys))


def dram_bytes_per_object(folder: str, n: int) -> float:
    dram = DramTier(os.path.join(folder, "seg-dram"), n * 1024 + 64 * MiB, "bench001", 1.0, 0.99, 0.98)
    store = TieredStore(dram, None, "none", 1.0)
    try:
        gc.collect()
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        fill(store, n)
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
        return grown / n
    finally:
        store.close()


def ssd_bytes_per_object(folder: str, n: int) -> float:
    """An SSD tier of ``n`` records, read back as a restarted node reads it."""
    d = os.path.join(folder, "ssd")
    ssd = SsdTier(d, 1 << 40, 256 * MiB, 0.99, 0.98)
    ssd.submit(Job("append", [(key(i), b"x", 0) for i in range(n)], fsync=False))
    assert ssd.next_done(timeout=None).error is None
    ssd.close()
    dram = DramTier(os.path.join(folder, "seg-ssd"), 64 * MiB, "bench002", 1.0, 0.99, 0.98)
    try:
        gc.collect()
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        store = TieredStore(dram, SsdTier(d, 1 << 40, 256 * MiB, 0.99, 0.98), "async", 1.0)
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
        assert store.stats()["ssd_objects"] == n
        store.close()
        return grown / n
    except BaseException:
        dram.close()
        raise


def clear_costs(folder: str, n: int, repeat: int = 5) -> dict:
    """Seconds of a clear by a tenant holding 2 objects among ``n`` of another tenant's: the
    store's, and a scan of every key (the old clear), best of ``repeat``."""
    dram = DramTier(os.path.join(folder, "seg-clear"), n * 1024 + 64 * MiB, "bench003", 1.0, 0.99, 0.98)
    store = TieredStore(dram, None, "none", 1.0)
    try:
        fill(store, n, "teamA")
        own, scan = [], []
        for r in range(repeat):
            fill(store, 2, f"teamB{r}")
            t0 = time.perf_counter()
            assert len(store.clear("", 1.0, tenant=f"teamB{r}")) == 2
            own.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            found = [k for k in dram.keys() if k.startswith("") and k.split("/", 1)[0].endswith("@teamB")]
            scan.append(time.perf_counter() - t0)
            assert not found
        return {"own_s": min(own), "scan_s": min(scan)}
    finally:
        store.close()


def node_process_bytes_per_object(n: int) -> float:
    """RssAnon growth of a real node process per 1-byte object put through StoreClient."""
    from hicache_mc.client import StoreClient
    from procs import Cluster

    def rss_anon(pid: int) -> int:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))

    with tempfile.TemporaryDirectory() as tmp:
        import pathlib
        c = Cluster(pathlib.Path(tmp))
        try:
            c.start_master()
            node = c.add_node(dram=f"{(n * 1024 + 256 * MiB) >> 20}MiB")
            c.wait_nodes(1)
            one = np.ones(1, np.uint8)
            with StoreClient(c.master, transport="shm", view="off") as client:
                assert client.put(key(10 ** 9), one)       # connections and first-use state
                gc.collect()
                time.sleep(1.0)
                before = rss_anon(node.p.pid)
                for lo in range(0, n, 4096):
                    keys = [key(i) for i in range(lo, min(n, lo + 4096))]
                    ok = client.batch_put_from(keys, [one.ctypes.data] * len(keys), [1] * len(keys))
                    assert all(ok), "a put failed"
                c.wait_objects(n + 1, timeout_s=120)
                return (rss_anon(node.p.pid) - before) / n
        finally:
            c.stop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--objects", type=int, default=200_000)
    args = ap.parse_args()
    n = args.objects
    with tempfile.TemporaryDirectory(dir="/dev/shm") as shm, tempfile.TemporaryDirectory() as disk:
        dram_b = dram_bytes_per_object(shm, n)
        ssd_b = ssd_bytes_per_object(disk, n)
        clear = clear_costs(shm, n)
    proc_b = node_process_bytes_per_object(n)
    rows = [{"what": "object in DRAM (tracemalloc)", "bytes": dram_b},
            {"what": "object on SSD only (tracemalloc)", "bytes": ssd_b},
            {"what": "node process, RssAnon per object", "bytes": proc_b},
            {"what": "charged per object (OBJECT_BYTES)", "bytes": OBJECT_BYTES}]
    print(f"{n} objects, keys of {len(key(0))} characters")
    print(table(rows, [("what", "s"), ("bytes", ".0f")]))
    print(f"clear by a tenant holding 2 objects among {n}: {clear['own_s'] * 1e3:.3f} ms; a scan of "
          f"every key {clear['scan_s'] * 1e3:.1f} ms ({clear['scan_s'] / clear['own_s']:.0f}x)")
    print("wrote", write_json("bench_node_memory.json", {
        "args": vars(args), "key_chars": len(key(0)), "dram_bytes_per_object": dram_b,
        "ssd_bytes_per_object": ssd_b, "node_rss_anon_bytes_per_object": proc_b,
        "object_bytes_charged": OBJECT_BYTES, "clear_own_s": clear["own_s"],
        "clear_scan_s": clear["scan_s"]}))


if __name__ == "__main__":
    main()
