"""hicache-mc beside Mooncake Store on the same work, in one run, data crossing processes in both.

    python benchmarks/bench_vs_mooncake.py [--sizes 64KiB,1MiB,4MiB] [--batches 32,128] [--iters 5]

Mooncake Store: ``mooncake_master`` on 127.0.0.1, a holder process (``MooncakeDistributedStore``
owning the global segment, protocol tcp, P2PHANDSHAKE) and this process as a pure client.
hicache-mc: ``hicache-mc serve`` in its own process, its node with a Transfer Engine over TCP
(``te_protocol=tcp``), and ``StoreClient`` in this process with each transport: ``shm``, ``tcp``
and ``mooncake`` (the TE one-sided path, forced, although the node is on this host).

For each object size and batch: ``batch_put_from`` of fresh keys, then ``batch_get_into`` of
them into other buffers (checked), then the keys are removed; the systems take turns inside each
iteration, in a fresh order each time, so drift and the background work one system leaves
after a call hit the others alike; one warm-up iteration is not counted. Source and destination
buffers are the same for every system and registered with both (Mooncake's zero-copy API needs
it; hicache-mc's TE path uses it). Then a stored chain of ``--exists-pages`` SGLang pages
(SHA-256 page hashes, ``--exists-parts`` objects a page: ``k,v`` for MHA, ``kv`` for MLA) is
probed: ``batch_is_exist`` of its keys against ``batch_exists`` of them (hicache-mc also with its
residency view, ``view=on``: answered in the client once the view is in sync), and
``batch_exists_pages`` of its page hashes through the view (what the SGLang backend calls: no
keys built). ``--exists-only`` runs only that. Prints a table (GB/s, objects/s, p50/p99 per batch, hicache-mc / Mooncake ratios)
and writes ``results/bench_vs_mooncake.json`` and ``.png``.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import random
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from contextlib import contextmanager

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import RESULTS, free_port, median, pct, store_process, table, write_json  # noqa: E402

from hicache_mc.client import StoreClient  # noqa: E402
from hicache_mc.config import parse_size  # noqa: E402

TRANSPORTS = ("shm", "tcp", "mooncake")

HOLDER = textwrap.dedent("""
    import sys
    from mooncake.store import MooncakeDistributedStore
    store = MooncakeDistributedStore()
    rc = store.setup("127.0.0.1", "P2PHANDSHAKE", int(sys.argv[2]), 0, "tcp", "", sys.argv[1])
    print("READY" if rc == 0 else f"FAILED {rc}", flush=True)
    sys.stdin.read()                  # hold the segment until the benchmark closes our stdin
    store.close()
""")


def _wait_port(port: int, timeout_s: float = 30.0) -> None:
    end = time.time() + timeout_s
    while time.time() < end:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port}")


@contextmanager
def mooncake_store(segment: int):
    """mooncake_master + a holder process with ``segment`` bytes; yields a pure client."""
    from mooncake.store import MooncakeDistributedStore
    port = free_port()
    binary = os.path.join(os.path.dirname(sys.executable), "mooncake_master")
    log = tempfile.NamedTemporaryFile(prefix="bench_vs_mooncake-", suffix=".log", delete=False)
    master = subprocess.Popen([binary, "--rpc_address=127.0.0.1", f"--rpc_port={port}",
                               "--metrics_host=127.0.0.1", f"--metrics_port={free_port()}",
                               "--enable_http_metadata_server=false"], stdout=log, stderr=log)
    holder = None
    try:
        _wait_port(port)
        addr = f"127.0.0.1:{port}"
        holder = subprocess.Popen([sys.executable, "-c", HOLDER, addr, str(segment)], text=True,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log)
        line = holder.stdout.readline().strip()
        if line != "READY":
            raise RuntimeError(f"Mooncake holder did not start: {line!r} (log: {log.name})")
        client = MooncakeDistributedStore()
        rc = client.setup("127.0.0.1", "P2PHANDSHAKE", 0, 64 << 20, "tcp", "", addr)
        if rc != 0:
            raise RuntimeError(f"Mooncake client setup: rc={rc}")
        try:
            yield client
        finally:
            client.close()
        os.unlink(log.name)            # kept only when something failed
    finally:
        if holder is not None:
            holder.stdin.close()
            holder.wait(30)
        master.terminate()
        master.wait(30)
        log.close()


class MooncakeSide:
    """Mooncake Store's zero-copy batch calls."""
    name = "mooncake-store"

    def __init__(self, store):
        self.store = store

    def register(self, arrays) -> None:
        for a in arrays:
            assert self.store.register_buffer(a.ctypes.data, a.nbytes) == 0

    def put(self, keys, ptrs, sizes) -> int:
        return sum(rc == 0 for rc in self.store.batch_put_from(keys, ptrs, sizes))

    def get(self, keys, ptrs, sizes) -> int:
        return sum(rc == s for rc, s in zip(self.store.batch_get_into(keys, ptrs, sizes), sizes))

    def remove(self, keys) -> None:
        self.store.batch_remove(keys, True)     # force: a get leaves a 10 s read lease

    def exists(self, keys) -> int:
        return sum(r == 1 for r in self.store.batch_is_exist(keys))


class HicacheSide:
    """StoreClient with one transport."""

    def __init__(self, master: str, transport: str, view: str = "off"):
        self.name = f"hicache-mc {transport}" + (" + view" if view == "on" else "")
        self.client = StoreClient(master, transport=transport, view=view)

    def register(self, arrays) -> None:
        for a in arrays:
            self.client.register_buffer(a.ctypes.data, a.nbytes)

    def put(self, keys, ptrs, sizes) -> int:
        return sum(self.client.batch_put_from(keys, ptrs, sizes))

    def get(self, keys, ptrs, sizes) -> int:
        return sum(self.client.batch_get_into(keys, ptrs, sizes))

    def remove(self, keys) -> None:
        prefix = os.path.commonprefix(keys)
        self.client.clear(prefix[:prefix.rfind("/") + 1])

    def exists(self, keys) -> int:
        return self.client.batch_exists(keys)


class HicachePagesSide(HicacheSide):
    """The SGLang backend's probe: a chain of page hashes, answered by the residency view."""

    def __init__(self, master: str, parts: tuple[str, ...]):
        super().__init__(master, "shm", view="on")
        self.name += " (page hashes)"
        self.parts = parts

    def exists(self, keys) -> int:
        ns, hashes = self.chain
        return self.client.batch_exists_pages(ns, hashes, self.parts) * len(self.parts)


def run_case(sides, size: int, batch: int, iters: int, src, dst) -> list[dict]:
    """Put and get ``batch`` objects of ``size`` bytes, ``iters`` times per side, in turns."""
    ps, pd, sizes = [a.ctypes.data for a in src], [a.ctypes.data for a in dst], [size] * batch
    times = {s.name: ([], []) for s in sides}
    for it in range(iters + 1):                 # iteration 0 warms connections and pages up
        for side in shuffled(sides, it):
            keys = [f"vs/{side.name.replace(' ', '-')}/{size}/{batch}/{it}/{i}" for i in range(batch)]
            t0 = time.perf_counter()
            put_ok = side.put(keys, ps, sizes)
            t1 = time.perf_counter()
            get_ok = side.get(keys, pd, sizes)
            t2 = time.perf_counter()
            if put_ok != batch or get_ok != batch:
                raise RuntimeError(f"{side.name}: {put_ok}/{batch} puts, {get_ok}/{batch} gets")
            if not (np.array_equal(src[0], dst[0]) and np.array_equal(src[-1], dst[-1])):
                raise RuntimeError(f"{side.name}: bytes differ")
            for a in dst[:1] + dst[-1:]:
                a[:8] = 0                       # the next side must write them again
            side.remove(keys)
            if it:
                times[side.name][0].append(t1 - t0)
                times[side.name][1].append(t2 - t1)
    rows = []
    for side in sides:
        put_t, get_t = times[side.name]
        nbytes = size * batch
        rows.append({"system": side.name, "object": _human(size), "batch": batch,
                     "put_gbps": nbytes / median(put_t) / 1e9, "get_gbps": nbytes / median(get_t) / 1e9,
                     "put_ops": batch / median(put_t), "get_ops": batch / median(get_t),
                     "put_p50_ms": median(put_t) * 1e3, "put_p99_ms": pct(put_t, 99) * 1e3,
                     "get_p50_ms": median(get_t) * 1e3, "get_p99_ms": pct(get_t, 99) * 1e3})
    base = rows[0]
    for r in rows:
        r["put_x_mooncake"] = r["put_gbps"] / base["put_gbps"]
        r["get_x_mooncake"] = r["get_gbps"] / base["get_gbps"]
    return rows


def shuffled(sides: list, turn: int) -> list:
    """The sides in a fresh order each turn (seeded: the same in every run), so whatever one
    system leaves running after a call (its own background work) falls on the others alike."""
    order = list(sides)
    random.Random(turn).shuffle(order)
    return order


def exists_case(sides, pages: int, parts: tuple[str, ...], reps: int) -> list[dict]:
    """A chain of ``pages`` pages of ``parts`` stored keys per side, probed ``reps`` times, the
    sides taking turns."""
    buf = np.zeros(4096, dtype=np.uint8)
    keys, lat = {}, {s.name: [] for s in sides}
    n = pages * len(parts)
    for i, side in enumerate(sides):
        side.register([buf])
        ns = f"vs-exists-{i}"
        hashes = [hashlib.sha256(f"{i}/{p}".encode()).hexdigest() for p in range(pages)]
        keys[side.name] = [f"{ns}/{h}/{part}" for h in hashes for part in parts]
        side.chain = (ns, hashes)
        assert side.put(keys[side.name], [buf.ctypes.data] * n, [4096] * n) == n
    for side in sides:      # a view answers once in sync with the keys' namespace
        view = getattr(getattr(side, "client", None), "view", None)
        if view is not None:
            ns = keys[side.name][0].split("/", 1)[0]
            side.client.follow(ns)
            end = time.monotonic() + 10
            while not (view.spaces.get(ns) and view.spaces[ns].synced):
                if time.monotonic() > end:
                    raise RuntimeError(f"{side.name}: the view never came in sync")
                time.sleep(0.01)
    for rep in range(reps):
        for side in shuffled(sides, rep):
            t0 = time.perf_counter()
            found = side.exists(keys[side.name])
            lat[side.name].append(time.perf_counter() - t0)
            assert found == n, f"{side.name}: {found}/{n} keys found"
    out = []
    for side in sides:
        side.remove(keys[side.name])
        t = lat[side.name]
        out.append({"system": side.name, "pages": pages, "keys": n, "p50_ms": median(t) * 1e3,
                    "p99_ms": pct(t, 99) * 1e3, "calls_per_s": 1 / median(t)})
    for r in out:
        r["speedup_vs_mooncake"] = out[0]["p50_ms"] / r["p50_ms"]
    return out


def _human(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def chart(rows: list[dict], exists: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    systems = list(dict.fromkeys(r["system"] for r in rows))
    cases = list(dict.fromkeys((r["object"], r["batch"]) for r in rows))
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8), gridspec_kw={"width_ratios": [3, 3, 1.4]})
    width = 0.8 / len(systems)
    for ax, op in zip(axes, ("put", "get")):
        for j, system in enumerate(systems):
            vals = [next(r[f"{op}_gbps"] for r in rows if r["system"] == system and (r["object"], r["batch"]) == c)
                    for c in cases]
            ax.bar([i + j * width for i in range(len(cases))], vals, width, label=system)
        ax.set_xticks([i + width * (len(systems) - 1) / 2 for i in range(len(cases))])
        ax.set_xticklabels([f"{o}\nx{b}" for o, b in cases])
        ax.set_ylabel("GB/s (median batch)")
        ax.set_title(f"batch_{op}_{'from' if op == 'put' else 'into'}")
    axes[0].legend(fontsize=8)
    axes[2].bar(range(len(exists)), [e["p50_ms"] for e in exists],
                color=[f"C{systems.index(e['system'])}" if e["system"] in systems else "grey" for e in exists])
    axes[2].set_xticks(range(len(exists)))
    axes[2].set_xticklabels([e["system"].replace("hicache-mc ", "hmc\n") for e in exists], fontsize=8)
    axes[2].set_ylabel("ms (p50)")
    axes[2].set_title(f"exists, {exists[0]['pages']} pages ({exists[0]['keys']} keys)")
    fig.suptitle("hicache-mc vs Mooncake Store, one host, loopback TCP, data crossing processes")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="64KiB,1MiB,4MiB")
    ap.add_argument("--batches", default="32,128")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--segment", default="2GiB", help="DRAM of the hicache-mc node and of the Mooncake holder")
    ap.add_argument("--exists-reps", type=int, default=2000)
    ap.add_argument("--exists-pages", type=int, default=128)
    ap.add_argument("--exists-parts", default="k,v", help="objects per page: k,v (MHA) or kv (MLA)")
    ap.add_argument("--exists-only", action="store_true", help="only batch_is_exist / batch_exists")
    args = ap.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    segment = parse_size(args.segment)
    os.makedirs(RESULTS, exist_ok=True)
    rows, t_start = [], time.time()
    with mooncake_store(segment) as mc, \
            store_process(args.segment, {"HICACHE_MC_TE_PROTOCOL": "tcp"}) as master:
        sides = [MooncakeSide(mc)] + [HicacheSide(master, t) for t in TRANSPORTS]
        for size in ([] if args.exists_only else sizes):
            rng = np.random.default_rng(size)
            n = max(batches)
            src = [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(n)]
            dst = [np.zeros(size, dtype=np.uint8) for _ in range(n)]
            # one region each, as SGLang's host pool is one: register whole arrays
            for side in sides:
                side.register(src + dst)
            for batch in batches:
                rows += run_case(sides, size, batch, args.iters, src[:batch], dst[:batch])
            for side in sides[1:]:
                for a in src + dst:
                    side.client.unregister_buffer(a.ctypes.data)
            for a in src + dst:
                mc.unregister_buffer(a.ctypes.data)
            del src, dst
        parts = tuple(args.exists_parts.split(","))
        sides += [HicacheSide(master, "shm", view="on"), HicachePagesSide(master, parts)]
        exists = exists_case(sides, args.exists_pages, parts, args.exists_reps)
        for side in sides[1:]:
            side.client.close()
    cols = [("object", ""), ("batch", "d"), ("system", ""), ("put_gbps", ".2f"), ("put_x_mooncake", ".2f"),
            ("get_gbps", ".2f"), ("get_x_mooncake", ".2f"), ("put_ops", ".0f"), ("get_ops", ".0f"),
            ("put_p50_ms", ".1f"), ("put_p99_ms", ".1f"), ("get_p50_ms", ".1f"), ("get_p99_ms", ".1f")]
    if rows:
        print(f"{args.iters} iterations after one warm-up, medians; ratios = hicache-mc / Mooncake Store")
        print(table(rows, cols))
        print()
    print(table(exists, [("system", ""), ("pages", "d"), ("keys", "d"), ("p50_ms", ".3f"), ("p99_ms", ".3f"),
                         ("calls_per_s", ".0f"), ("speedup_vs_mooncake", ".2f")]))
    name = "bench_vs_mooncake_exists" if args.exists_only else "bench_vs_mooncake"
    png = os.path.join(RESULTS, name + ".png")
    if not args.exists_only:
        chart(rows, exists, png)
    path = write_json(name + ".json", {"args": vars(args), "rows": rows, "exists": exists,
                                       "seconds": time.time() - t_start})
    print(f"wrote {path}{'' if args.exists_only else ' and ' + png} ({time.time() - t_start:.0f} s)")


if __name__ == "__main__":
    main()
