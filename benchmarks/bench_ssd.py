"""SSD tier throughput beside plain sequential file I/O of the same bytes, in one run.

    python benchmarks/bench_ssd.py [--dir DIR] [--sizes 1MiB,4MiB,8MiB] [--total 512MiB]

For each object size: write ``total`` bytes as objects through the tier's writer thread (one
batch, one fsync, the way demotion writes), then read them all back through ``read_into``
(pread + xxh3 check, what a node does on an SSD hit). The baseline writes the same bytes to one
plain file in object-sized chunks (+ fsync) and reads it back sequentially. Reads are measured
warm (in the page cache) and cold (the files' pages dropped with posix_fadvise DONTNEED after
fsync, which works without root).
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import table, write_json  # noqa: E402

from hicache_mc.config import parse_size  # noqa: E402
from hicache_mc.node.ssd import Job, SsdTier  # noqa: E402
from hicache_mc.transport.base import checksum  # noqa: E402


def drop_cache(paths):
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def plain(folder, data, size):
    path = os.path.join(folder, "plain.bin")
    t0 = time.perf_counter()
    mv = memoryview(data)
    with open(path, "wb", buffering=0) as f:
        for i in range(0, len(data), size):
            f.write(mv[i:i + size])
        os.fsync(f.fileno())
    write = time.perf_counter() - t0
    out = memoryview(bytearray(size))

    def read():
        t = time.perf_counter()
        with open(path, "rb", buffering=0) as f:
            while f.readinto(out):
                pass
        return time.perf_counter() - t
    warm = read()
    drop_cache([path])
    cold = read()
    os.unlink(path)
    return write, warm, cold


def tier(folder, data, size):
    d = os.path.join(folder, "tier")
    ssd = SsdTier(d, capacity=len(data) * 2, segment_bytes=256 << 20, high_watermark=0.95,
                  low_watermark=0.85)
    try:
        mv = memoryview(data)
        items = [(f"obj/{i}", mv[i:i + size], checksum(mv[i:i + size])) for i in range(0, len(data), size)]
        t0 = time.perf_counter()
        ssd.submit(Job("append", items, fsync=True))
        job = ssd.next_done(timeout=None)
        write = time.perf_counter() - t0
        assert job.error is None, job.error
        recs = dict(job.result)
        for k, r in recs.items():
            ssd.add(k, r)
        out = memoryview(bytearray(size))

        def read():
            t = time.perf_counter()
            for k, _, _ in items:
                assert ssd.read_into(recs[k], out)
            return time.perf_counter() - t
        warm = read()
        drop_cache(sorted({ssd.path(r.seg) for r in recs.values()}))
        cold = read()
        return write, warm, cold
    finally:
        ssd.close()
        shutil.rmtree(d, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", help="folder on the disk to measure (default: a temp folder)")
    ap.add_argument("--sizes", default="1MiB,4MiB,8MiB")
    ap.add_argument("--total", default="512MiB")
    args = ap.parse_args()
    total = parse_size(args.total)
    folder = tempfile.mkdtemp(prefix="hicache-mc-ssd-bench-", dir=args.dir)
    data = np.random.default_rng(0).integers(0, 256, total, dtype=np.uint8).tobytes()
    rows = []
    try:
        for size in [parse_size(s) for s in args.sizes.split(",")]:
            pw, pwarm, pcold = plain(folder, data, size)
            tw, twarm, tcold = tier(folder, data, size)
            g = lambda t: total / t / 1e9  # noqa: E731
            rows.append({"object": f"{size >> 20} MiB", "plain_write": g(pw), "tier_write": g(tw),
                         "write_x": pw / tw, "plain_read_warm": g(pwarm), "tier_read_warm": g(twarm),
                         "warm_x": pwarm / twarm, "plain_read_cold": g(pcold), "tier_read_cold": g(tcold),
                         "cold_x": pcold / tcold})
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print(f"{total >> 20} MiB per run in {folder} (GB/s; x = tier / plain)")
    print(table(rows, [("object", ""), ("plain_write", ".2f"), ("tier_write", ".2f"), ("write_x", ".2f"),
                       ("plain_read_warm", ".2f"), ("tier_read_warm", ".2f"), ("warm_x", ".2f"),
                       ("plain_read_cold", ".2f"), ("tier_read_cold", ".2f"), ("cold_x", ".2f")]))
    print("wrote", write_json("bench_ssd.json", {"args": vars(args), "rows": rows}))


if __name__ == "__main__":
    main()
