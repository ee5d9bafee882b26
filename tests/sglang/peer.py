"""A second SGLang "instance" in its own process: stores pages, then reads the other's pages.

Usage: python peer.py MASTER LAYOUT WRITE_SALT WRITE_SEED READ_SALT READ_SEED PAGES
Prints one line: "stored <n> read <n> equal <0|1>".
"""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
from sglang_env import apply_torchvision_stub  # noqa: E402

apply_torchvision_stub()

import torch  # noqa: E402
from pools import fill_random, make_backend, mha_host, page_bytes, page_hashes, slots  # noqa: E402


def main(master, layout, write_salt, write_seed, read_salt, read_seed, pages):
    pool = mha_host(layout)
    backend = make_backend(pool, master)
    src, dst, ref = slots(pool, pages), slots(pool, pages), slots(pool, pages)
    fill_random(pool, src, seed=write_seed)
    stored = sum(backend.batch_set_v1(page_hashes(pages, pool.page_size, write_salt), src))
    fill_random(pool, ref, seed=read_seed)     # what the other instance stored
    read = sum(backend.batch_get_v1(page_hashes(pages, pool.page_size, read_salt), dst))
    equal = all(torch.equal(a, b) for a, b in zip(page_bytes(pool, ref), page_bytes(pool, dst)))
    backend.close()
    print(f"stored {stored} read {read} equal {int(equal and read == pages)}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], *map(int, sys.argv[3:]))
