"""How soon another client sees a put.

A node answers a commit once it has sent ``Committed`` to the master, without waiting for the
master's acknowledgement; the writer's own next lookups are fenced by the commit's sequence
number (always visible to it). This measures the rest: client A puts one object, client B asks
the master for it right after A's put returned. Reported: how many of B's lookups missed, and
how long B then waited until the key showed, idle and with ``--hogs`` busy processes competing
for the CPUs. A's own lookups are counted too: they must never miss. With ``view`` on, both
clients probe through their residency views (client/view.py), which ask the master for the
keys they lack: B's lookups must then never miss either. ``view_lagged``: how often B's view
lacked the key right after the put returned (B's ``contains_cached``); ``view_lag_*``: how much
longer it took to show there, counted from after B's lookup (its round trip to the master not
included). A's lookups test read-your-writes through the view.
B re-checks every 0.1 ms (sleeping between checks).

    .venv/bin/python benchmarks/bench_visibility.py [--puts 500] [--hogs 2]
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import pct, store_process, table, write_json  # noqa: E402

from hicache_mc.client import StoreClient  # noqa: E402


def _burn(stop) -> None:
    while not stop.is_set():
        sum(range(10000))


def _synced(c: StoreClient, ns: str) -> None:
    c.follow(ns)
    end = time.monotonic() + 10
    while not (c.view.spaces.get(ns) and c.view.spaces[ns].synced):
        if time.monotonic() > end:
            raise RuntimeError("the residency view never came in sync")
        time.sleep(0.01)


def run(master: str, puts: int, hogs: int, view: str = "off") -> dict:
    stop = mp.Event()
    procs = [mp.Process(target=_burn, args=(stop,), daemon=True) for _ in range(hogs)]
    for p in procs:
        p.start()
    try:
        with StoreClient(master, view=view) as a, StoreClient(master, view=view) as b:
            a.put("vis/warm", b"x")
            b.exists("vis/warm")
            if view == "on":
                _synced(a, "vis")
                _synced(b, "vis")
            own_misses, misses, waits, lagged, lags = 0, 0, [], 0, []
            for i in range(puts):
                key = f"vis/{hogs}/{i}"
                assert a.put(key, b"y" * 4096)
                in_view = view != "on" or b.contains_cached([key]) == [True]
                if not b.exists(key):
                    misses += 1
                    t0 = time.perf_counter()
                    while not b.exists(key):
                        # a view is brought up to date by a thread of this process: a loop
                        # that never sleeps would hold the GIL for the 5 ms switch interval
                        time.sleep(0.0001)
                        if time.perf_counter() - t0 > 2:
                            raise RuntimeError(f"{key} not visible to another client after 2 s")
                    waits.append(time.perf_counter() - t0)
                if not in_view:         # b's exists asked the master; its view, how long?
                    lagged += 1
                    t0 = time.perf_counter()
                    while b.contains_cached([key]) != [True]:
                        time.sleep(0.0001)
                        if time.perf_counter() - t0 > 2:
                            raise RuntimeError(f"{key} not in another client's view after 2 s")
                    lags.append(time.perf_counter() - t0)
                if not a.exists(key):
                    own_misses += 1
            a.clear("vis/")
    finally:
        stop.set()
        for p in procs:
            p.join(5)
    return {"view": view, "hogs": hogs, "puts": puts, "other_client_missed": misses,
            "other_client_missed_pct": 100.0 * misses / puts,
            "wait_p50_ms": pct(waits, 50) * 1e3 if waits else 0.0,
            "wait_p99_ms": pct(waits, 99) * 1e3 if waits else 0.0,
            "wait_max_ms": max(waits) * 1e3 if waits else 0.0,
            "view_lagged": lagged, "view_lag_p50_ms": pct(lags, 50) * 1e3 if lags else 0.0,
            "view_lag_p99_ms": pct(lags, 99) * 1e3 if lags else 0.0,
            "view_lag_max_ms": max(lags) * 1e3 if lags else 0.0,
            "writer_missed": own_misses}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--puts", type=int, default=500)
    ap.add_argument("--hogs", type=int, default=2, help="busy processes in the loaded run")
    args = ap.parse_args()
    t0 = time.time()
    with store_process("512MiB") as master:
        rows = [run(master, args.puts, hogs, view) for view in ("off", "on")
                for hogs in (0, args.hogs)]
    print(table(rows, [("view", ""), ("hogs", "d"), ("puts", "d"), ("other_client_missed", "d"),
                       ("other_client_missed_pct", ".1f"), ("wait_p50_ms", ".3f"),
                       ("wait_p99_ms", ".3f"), ("wait_max_ms", ".3f"), ("view_lagged", "d"),
                       ("view_lag_p50_ms", ".3f"), ("view_lag_p99_ms", ".3f"),
                       ("view_lag_max_ms", ".3f"), ("writer_missed", "d")]))
    path = write_json("bench_visibility.json", {"args": vars(args), "rows": rows,
                                                "seconds": round(time.time() - t0, 1)})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
