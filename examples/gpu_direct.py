"""Two processes hand a KV prefix to each other through the store, GPU pool to GPU pool.

    python examples/gpu_direct.py                       # starts a store, runs writer then reader
    python examples/gpu_direct.py --master tcp://127.0.0.1:7370   # use a running store

The writer fills a device KV pool (Llama-3-8B-shaped on a GPU: 32 layers, 8 heads of 128,
bf16, page 64) with a "prefix" and saves its pages with ``KVDirect.save``: Triton pack into a
staging buffer, then ``batch_put_from``. The reader, a separate process with an empty pool,
probes and loads the same page hashes into other page slots (``KVDirect.load``: ``batch_get_into``
then unpack) and checks every byte. Without a GPU both run on CPU tensors in the Triton
interpreter with a small pool; the code path is the same.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import socket
import subprocess
import sys
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
# (layers, heads, head_dim, page size, pages in the prefix, pool pages)
SHAPE = (32, 8, 128, 64, 32, 64) if GPU else (4, 2, 64, 16, 8, 16)
LAYOUT = "page_first"


def make_pool(seed: int | None):
    """Per-layer K and V tensors of (slots, H, D); random when seeded, else zeros."""
    layers, heads, dim, ps, _, pool_pages = SHAPE
    g = torch.Generator().manual_seed(seed or 0)

    def layer():
        shape = (pool_pages * ps, heads, dim)
        t = torch.randn(shape, generator=g) if seed is not None else torch.zeros(shape)
        return t.to(torch.bfloat16).to(DEVICE)
    return [[layer() for _ in range(layers)] for _ in range(2)]


def prefix_hashes(n: int) -> list[str]:
    """Stand-ins for SGLang's chained page hashes (with SGLang, pass its own)."""
    out, prev = [], b""
    for i in range(n):
        prev = hashlib.sha256(prev + f"token-page-{i}".encode()).digest()
        out.append(prev.hex())
    return out


def direct_for(master: str, pool):
    from hicache_mc.client import StoreClient
    from hicache_mc.direct import KVDirect, kv_namespace
    layers, _, _, ps, _, _ = SHAPE
    ns = kv_namespace("example/llama-3-8b", torch.bfloat16, LAYOUT, ps, layers)
    client = StoreClient(master=master, timeout_s=60)
    return client, KVDirect(client, pool, ns, staging_pages=8)


def writer(master: str) -> None:
    n = SHAPE[4]
    pool = make_pool(seed=42)
    client, direct = direct_for(master, pool)
    t0 = time.perf_counter()
    ok = direct.save(prefix_hashes(n), list(range(n)))           # prefix in pages 0..n-1
    dt = time.perf_counter() - t0
    mib = n * 2 * direct.part_bytes / 2**20
    print(f"writer: saved {sum(ok)}/{n} pages ({mib:.1f} MiB) in {dt * 1e3:.0f} ms "
          f"on {DEVICE}")
    client.close()
    sys.exit(0 if all(ok) else 1)


def reader(master: str) -> None:
    n, pool_pages = SHAPE[4], SHAPE[5]
    pool = make_pool(seed=None)
    client, direct = direct_for(master, pool)
    targets = list(range(pool_pages - 1, pool_pages - 1 - n, -1))   # other slots, reversed
    t0 = time.perf_counter()
    loaded = direct.load(prefix_hashes(n), targets)
    dt = time.perf_counter() - t0
    want = make_pool(seed=42)                                   # what the writer had
    ps = SHAPE[3]
    same = all(torch.equal(w[src * ps:(src + 1) * ps], g[dst * ps:(dst + 1) * ps])
               for wp, gp in zip(want, pool) for w, g in zip(wp, gp)
               for src, dst in zip(range(loaded), targets))
    print(f"reader: loaded {loaded}/{n} pages in {dt * 1e3:.0f} ms; bytes identical: {same}")
    client.close()
    sys.exit(0 if loaded == n and same else 1)


def run_store():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "hicache_mc.cli", "serve", "--port", str(port),
                             "--dram", "4GiB" if GPU else "256MiB",
                             "--metrics-port", "0", "--publish-port", "0"])
    master = f"tcp://127.0.0.1:{port}"
    if subprocess.call([sys.executable, "-m", "hicache_mc.cli", "wait", "--master", master,
                        "--timeout", "300", "--pid", str(proc.pid)]) == 0:
        return proc, master
    proc.kill()
    raise SystemExit("the store did not start")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--master", help="a running store (default: start one)")
    ap.add_argument("--role", choices=["writer", "reader"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role:
        return (writer if args.role == "writer" else reader)(args.master)
    proc, master = (None, args.master) if args.master else run_store()
    try:
        for role in ("writer", "reader"):     # two processes: nothing shared but the store
            rc = subprocess.call([sys.executable, __file__, "--role", role, "--master", master])
            if rc:
                raise SystemExit(f"{role} failed (exit {rc})")
    finally:
        if proc:
            proc.terminate()
            proc.wait(30)


if __name__ == "__main__":
    main()
