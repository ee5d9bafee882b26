"""GPU-direct path (hicache_mc.direct) through a real store process.

Without CUDA the device pool is CPU tensors and the kernels run in the Triton interpreter; the
code path is the same except for the host staging copy, which only a GPU run exercises.
"""
from __future__ import annotations

import hashlib
import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")     # before hicache_mc.kernels is imported

from hicache_mc.client import StoreClient  # noqa: E402
from hicache_mc.direct import KVDirect, kv_namespace  # noqa: E402
from hicache_mc.kernels import pack_pages_ref  # noqa: E402

DEVICE = "cuda" if os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
PS = 16


def _pool(parts, layers, heads, dim, dtype, pages, seed=None, device=DEVICE):
    """Per-layer (slots, H, D) tensors like SGLang's device pool; random bytes or 0xFF."""
    g = torch.Generator().manual_seed(seed or 0)
    isz = torch.empty((), dtype=dtype).element_size()
    shape = (pages * PS + 1, heads, dim * isz)

    def one():
        raw = (torch.randint(0, 256, shape, dtype=torch.uint8, generator=g) if seed is not None
               else torch.full(shape, 0xFF, dtype=torch.uint8))
        return raw.view(dtype).to(device)
    return [[one() for _ in range(layers)] for _ in range(parts)]


def _hashes(n, salt):
    return [hashlib.sha256(f"{salt}/{i}".encode()).hexdigest() for i in range(n)]


def _pages(pool, pages):
    """Bytes of the given pages of every layer, for comparison."""
    rows = torch.cat([torch.arange(p * PS, (p + 1) * PS) for p in pages]).to(pool[0][0].device)
    return [t.view(torch.uint8)[rows].cpu() for part in pool for t in part]


@pytest.fixture
def client(store):
    c = StoreClient(master=store.master)
    yield c
    c.close()


CASES = [("mha", "page_first", torch.bfloat16), ("mha", "page_head", torch.float16),
         ("mha", "page_first_direct", torch.float8_e4m3fn), ("mha", "layer_first", torch.bfloat16),
         ("mla", "page_first", torch.bfloat16), ("mla", "page_first_direct", torch.uint8)]


@pytest.mark.parametrize("kind,layout,dtype", CASES, ids=[f"{k}-{l}" for k, l, _ in CASES])
def test_save_then_load_restores_pages(client, kind, layout, dtype):
    parts, layers, heads, dim = (1, 5, 1, 72) if kind == "mla" else (2, 5, 3, 80)
    ns = kv_namespace("test/direct", dtype, layout, PS, layers, is_mla=kind == "mla")
    src = _pool(parts, layers, heads, dim, dtype, 6, seed=1)
    saver = KVDirect(client, src, ns, staging_pages=2)          # 3 pages: two store rounds
    hashes = _hashes(3, layout)
    assert saver.save(hashes, [3, 1, 4]) == [True, True, True]
    assert client.batch_exists(saver.keys(hashes)) == 3 * parts

    dst = _pool(parts, layers, heads, dim, dtype, 6)             # poisoned
    loader = KVDirect(client, dst, ns, staging_pages=2)
    assert loader.load(hashes, [0, 5, 2]) == 3
    for want, got in zip(_pages(src, [3, 1, 4]), _pages(dst, [0, 5, 2])):
        assert torch.equal(want, got)
    for t in _pages(dst, [1, 3, 4]):                             # other pages untouched
        assert (t == 0xFF).all()
    saver.close()
    loader.close()


def test_load_stops_at_the_first_missing_page(client):
    ns = kv_namespace("test/direct", torch.bfloat16, "page_first", PS, 2)
    src = _pool(2, 2, 2, 64, torch.bfloat16, 4, seed=2)
    direct = KVDirect(client, src, ns)
    hashes = _hashes(3, "gap")
    assert direct.save([hashes[0], hashes[2]], [0, 2]) == [True, True]
    dst = _pool(2, 2, 2, 64, torch.bfloat16, 4)
    assert KVDirect(client, dst, ns).load(hashes, [1, 2, 3]) == 1
    assert all(torch.equal(a, b) for a, b in zip(_pages(src, [0]), _pages(dst, [1])))
    assert all((t == 0xFF).all() for t in _pages(dst, [2, 3]))


def test_namespace_must_match_the_pool(client):
    pool = _pool(2, 2, 2, 64, torch.bfloat16, 2, seed=3)
    with pytest.raises(ValueError, match="kv_dtype"):
        KVDirect(client, pool, kv_namespace("m", torch.float16, "page_first", PS, 2))
    with pytest.raises(ValueError, match="is_mla"):
        KVDirect(client, pool, kv_namespace("m", torch.bfloat16, "page_first", PS, 2, is_mla=True))
    with pytest.raises(ValueError, match="has 2 layers"):
        KVDirect(client, pool, kv_namespace("m", torch.bfloat16, "page_first", PS, 3))
    with pytest.raises(ValueError, match="device_staging"):
        KVDirect(client, pool, kv_namespace("m", torch.bfloat16, "page_first", PS, 2),
                 device_staging=True)
    direct = KVDirect(client, pool, kv_namespace("m", torch.bfloat16, "page_first", PS, 2))
    with pytest.raises(ValueError, match="2 page hashes for 1 page ids"):
        direct.save(_hashes(2, "x"), [0])


# ----------------------------------------------------------------- against the SGLang adapter

def _sglang_pools():
    """tests/sglang/pools.py behind the torchvision stub; skip when sglang is missing."""
    pytest.importorskip("sglang")
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sglang")
    if here not in sys.path:
        sys.path.insert(0, here)
    from sglang_env import apply_torchvision_stub
    apply_torchvision_stub()
    import pools
    return pools


SG_CASES = [("mha", "page_first"), ("mha", "page_head"), ("mha", "layer_first"),
            ("mla", "page_first_direct")]


@pytest.mark.skipif(DEVICE != "cpu", reason="SGLang host pools are built on CPU here")
@pytest.mark.parametrize("kind,layout", SG_CASES, ids=[f"{k}-{l}" for k, l in SG_CASES])
def test_pages_cross_between_direct_and_sglang_backend(store, client, kind, layout):
    pools = _sglang_pools()
    mla = kind == "mla"
    layers, heads, dim = (3, 1, 48) if mla else (3, 2, 32)     # pools.py: rank 32 + rope 16
    host = (pools.mla_host if mla else pools.mha_host)(layout, torch.bfloat16, PS, layers=layers,
                                                       tokens=4 * PS)
    backend = pools.make_backend(host, store.master, mla=mla)
    ns = kv_namespace("test/llama", torch.bfloat16, layout, PS, layers, is_mla=mla)
    assert backend.spaces == (ns.digest(),)

    dev = _pool(1 if mla else 2, layers, heads, dim, torch.bfloat16, 4, seed=5)
    direct = KVDirect(client, dev, ns)
    host_slots = pools.slots(host, 2)

    saved = pools.page_hashes(2, PS)                            # direct -> SGLang host pool
    assert direct.save(saved, [2, 0]) == [True, True]
    pools.wait_exists(backend, saved, 2)                        # another client's put
    assert backend.batch_get_v1(saved, host_slots) == [True, True]
    want = pack_pages_ref(dev, [2, 0], PS, layout)
    for j, got in enumerate(pools.page_bytes(host, host_slots)):
        assert torch.equal(got, want[j].reshape(-1).view(torch.uint8))

    stored = pools.page_hashes(2, PS)                           # SGLang host pool -> direct
    pools.fill_random(host, host_slots, seed=9)
    assert backend.batch_set_v1(stored, host_slots) == [True, True]
    assert direct.load(stored, [3, 1]) == 2
    got = pack_pages_ref(dev, [3, 1], PS, layout)
    for j, page in enumerate(pools.page_bytes(host, host_slots)):
        assert torch.equal(page, got[j].reshape(-1).view(torch.uint8))
    backend.close()
