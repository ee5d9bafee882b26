"""Two processes encode the same image; the second takes the first one's output from the store.

    python examples/embedding_sharing.py                         # starts a store, runs both
    python examples/embedding_sharing.py --master tcp://127.0.0.1:7370   # use a running store

Each process plays an encoder instance: it hashes the image bytes, asks the store for the
embedding (``EmbeddingCache.get``), and only on a miss runs the "vision encoder" (a small
deterministic torch model: patchify, a few wide MLP blocks) and ``put``s its output. The first
process misses and encodes; the second, a fresh process that shares nothing with it but the
store, hits, skips the encoder, checks the bytes against its own recomputation, and prints the
time saved. The namespace is (model, encoder version, dtype): another encoder never gets these.
"""
from __future__ import annotations

import argparse
import hashlib
import socket
import subprocess
import sys
import time

import torch

MODEL, ENCODER_VERSION, DTYPE = "example/tiny-vlm", "vit-demo-1", torch.bfloat16
IMAGE_SIDE, PATCH, WIDTH, DEPTH = 448, 14, 1024, 4      # 1024 patch tokens of 1024


def image_bytes() -> bytes:
    """The "image" both processes receive (a request's raw bytes; no decoder needed here)."""
    g = torch.Generator().manual_seed(2024)
    return torch.randint(0, 256, (IMAGE_SIDE * IMAGE_SIDE * 3,), dtype=torch.uint8,
                         generator=g).numpy().tobytes()


def encode(data: bytes) -> torch.Tensor:
    """A deterministic stand-in for a ViT: [tokens, WIDTH] embeddings in DTYPE."""
    torch.manual_seed(0)                                  # the same weights in every process
    pixels = torch.frombuffer(bytearray(data), dtype=torch.uint8).float().div(255)
    patches = pixels.view(3, IMAGE_SIDE // PATCH, PATCH, IMAGE_SIDE // PATCH, PATCH)
    x = patches.permute(1, 3, 0, 2, 4).reshape(-1, 3 * PATCH * PATCH)
    x = torch.nn.Linear(x.shape[1], WIDTH)(x)
    for _ in range(DEPTH):
        block = torch.nn.Sequential(torch.nn.LayerNorm(WIDTH), torch.nn.Linear(WIDTH, 4 * WIDTH),
                                    torch.nn.GELU(), torch.nn.Linear(4 * WIDTH, WIDTH))
        x = x + block(x)
    return x.to(DTYPE)


def instance(master: str, name: str) -> None:
    from hicache_mc import EmbeddingCache
    data = image_bytes()
    content_hash = hashlib.sha256(data).hexdigest()
    with EmbeddingCache(master, model=MODEL, encoder_version=ENCODER_VERSION, dtype=DTYPE,
                        timeout_s=10) as cache, torch.no_grad():
        t0 = time.perf_counter()
        emb = cache.get(content_hash, dtype=DTYPE)
        t_get = time.perf_counter() - t0
        if emb is None:
            t0 = time.perf_counter()
            emb = encode(data)
            t_enc = time.perf_counter() - t0
            stored = cache.put(content_hash, emb)
            print(f"{name}: miss ({t_get * 1e3:.1f} ms); encoded {tuple(emb.shape)} "
                  f"{str(DTYPE)[6:]} in {t_enc * 1e3:.0f} ms; stored: {stored}")
            return
        t0 = time.perf_counter()       # again, now that this process has its connections
        cache.get(content_hash, dtype=DTYPE)
        t_again = time.perf_counter() - t0
        t0 = time.perf_counter()
        want = encode(data)                               # only to show the bytes are the same
        t_enc = time.perf_counter() - t0
        same = torch.equal(emb.view(torch.uint8), want.view(torch.uint8))
        print(f"{name}: hit, {tuple(emb.shape)} {str(DTYPE)[6:]} from the store in "
              f"{t_get * 1e3:.1f} ms (first call: connects, maps the node's memory; again: "
              f"{t_again * 1e3:.1f} ms) instead of {t_enc * 1e3:.0f} ms of encoder: saved "
              f"{(t_enc - t_get) * 1e3:.0f} ms; bytes identical: {same}")
        if not same:
            sys.exit(1)


def run_store():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "hicache_mc.cli", "serve", "--port", str(port),
                             "--dram", "256MiB",
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
    ap.add_argument("--name", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.name:
        return instance(args.master, args.name)
    proc, master = (None, args.master) if args.master else run_store()
    try:
        for name in ("instance A", "instance B"):   # two processes: nothing shared but the store
            rc = subprocess.call([sys.executable, __file__, "--master", master, "--name", name])
            if rc:
                raise SystemExit(f"{name} failed (exit {rc})")
    finally:
        if proc:
            proc.terminate()
            proc.wait(30)


if __name__ == "__main__":
    main()
