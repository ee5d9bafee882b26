"""EmbeddingCache against a real store: round trips, dtype/shape checks, namespaces, processes."""
from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from procs import Cluster, free_port

import hicache_mc
from hicache_mc.client import StoreClient
from hicache_mc.embeddings import HEADER, Descriptor, EmbeddingCache, EmbeddingMismatch
from hicache_mc.keys import KVNamespace

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
SHAPES = [(1,), (7, 33), (3, 5, 17), (257, 64), (2, 1, 3, 1, 2, 1, 2, 3)]


@pytest.fixture(scope="module")
def master(tmp_path_factory):
    cluster = Cluster(tmp_path_factory.mktemp("emb-store")).start_serve("256MiB")
    yield cluster.master
    cluster.stop()


_n = iter(range(10**6))


def fresh(master, **kw) -> EmbeddingCache:
    """A cache in a namespace of its own (tests share one store)."""
    kw.setdefault("model", f"test/vision-{next(_n)}")
    return EmbeddingCache(master, timeout_s=5.0, **kw)


def embedding(shape, dtype, seed: int) -> torch.Tensor:
    """Random bits, NaN and inf patterns included: compared as bytes, never as numbers."""
    g = torch.Generator().manual_seed(seed)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g).view(dtype).view(shape)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def test_round_trips_every_dtype_and_shape(master):
    with fresh(master) as cache:
        for i, (dtype, shape) in enumerate((d, s) for d in DTYPES for s in SHAPES):
            t = embedding(shape, dtype, seed=i)
            assert cache.put(f"img{i}", t)
            got = cache.get(f"img{i}")
            assert got is not None and same_bytes(got, t), (dtype, shape)
            # raw: pointers and sizes, straight into the caller's buffer
            out = torch.full(shape, 0, dtype=dtype)
            assert cache.batch_get_into([f"img{i}"], [out.data_ptr()], [out.nbytes],
                                        dtype=dtype, shapes=[shape]) == [True]
            assert same_bytes(out, t)


def test_non_contiguous_tensor_is_stored_as_its_values(master):
    with fresh(master) as cache:
        t = embedding((16, 8), torch.float32, seed=1).t()
        assert not t.is_contiguous()
        assert cache.put("h", t)
        assert same_bytes(cache.get("h"), t.contiguous())


def test_raw_put_then_tensor_get(master):
    with fresh(master) as cache:
        src = [embedding((5, 12), torch.bfloat16, seed=s) for s in (1, 2)]
        ok = cache.batch_put_from(["a", "b"], [t.data_ptr() for t in src], [t.nbytes for t in src],
                                  dtype="bfloat16", shapes=[(5, 12), (5, 12)])
        assert ok == [True, True]
        assert all(same_bytes(cache.get(h), t) for h, t in zip("ab", src))
        # no shapes: a 1-D tensor of the size's elements
        flat = embedding((30,), torch.float16, seed=3)
        assert cache.batch_put_from(["c"], [flat.data_ptr()], [flat.nbytes], dtype=torch.float16) == [True]
        assert same_bytes(cache.get("c"), flat)


def test_wrong_dtype_or_shape_is_an_error_or_a_miss_never_a_reinterpretation(master):
    with fresh(master) as cache:
        t = embedding((4, 8), torch.bfloat16, seed=7)
        assert cache.put("h", t)
        # get with expectations: a clear error naming both
        with pytest.raises(EmbeddingMismatch, match=r"bfloat16 \[4, 8\].*float16"):
            cache.get("h", dtype=torch.float16)
        with pytest.raises(EmbeddingMismatch, match=r"\[8, 4\]"):
            cache.get("h", shape=(8, 4))
        assert same_bytes(cache.get("h", dtype="torch.bfloat16", shape=[4, 8]), t)
        # raw: same byte count, other dtype or shape -> a miss, the buffer untouched
        for dtype, shape in [(torch.float16, (4, 8)), (torch.bfloat16, (8, 4)),
                             (torch.bfloat16, (32,)), (torch.int16, (4, 8))]:
            out = torch.full((64,), 0xAB, dtype=torch.uint8)
            assert cache.batch_get_into(["h"], [out.data_ptr()], [64], dtype=dtype,
                                        shapes=[shape]) == [False], (dtype, shape)
            assert bool((out == 0xAB).all())
        # a size that disagrees with dtype and shape is the caller's bug
        with pytest.raises(ValueError, match="is 64 bytes"):
            cache.batch_get_into(["h"], [out.data_ptr()], [32], dtype=torch.bfloat16, shapes=[(4, 8)])


def test_malformed_header_is_a_miss(master):
    with fresh(master) as cache:
        t = embedding((4, 8), torch.float32, seed=3)
        assert cache.put("good", t)
        raw = StoreClient(master)
        try:
            bad = bytearray(Descriptor(torch.float32, (4, 8)).pack())
            bad[:8] = b"NOTMAGIC"
            assert raw.put(cache.meta_key("badmagic"), bytes(bad))
            assert raw.put(cache.meta_key("short"), b"x" * 17)
            lie = bytearray(Descriptor(torch.float32, (4, 8)).pack())
            lie[-24:-16] = (999).to_bytes(8, "little")     # payload size that shape contradicts
            assert raw.put(cache.meta_key("lie"), bytes(lie))
        finally:
            raw.close()
        assert cache.get("badmagic") is None
        assert cache.get("short") is None
        assert cache.get("lie") is None
        assert same_bytes(cache.get("good"), t)


def test_header_format_round_trips():
    for dtype in DTYPES + [torch.float8_e4m3fn, torch.int64]:
        d = Descriptor.of(dtype, (3, 1, 4))
        raw = d.pack()
        assert len(raw) == HEADER.size == 128
        assert Descriptor.unpack(raw) == d
    with pytest.raises(ValueError, match="at most 8"):
        Descriptor.of(torch.float16, (1,) * 9)
    with pytest.raises(ValueError, match="at least one element"):
        Descriptor.of(torch.float16, (0, 4))


def test_per_hash_answers_past_misses(master):
    """The store answers leading runs; embeddings are independent, so each hash gets its answer."""
    with fresh(master) as cache:
        ts = {h: embedding((3, 4), torch.float16, seed=i) for i, h in enumerate("abcdef")}
        for h in "bdf":
            assert cache.put(h, ts[h])
        assert cache.batch_exists(list("abcdef")) == [False, True, False, True, False, True]
        outs = [torch.zeros(3, 4, dtype=torch.float16) for _ in range(6)]
        ok = cache.batch_get_into(list("abcdef"), [o.data_ptr() for o in outs], [24] * 6,
                                  dtype=torch.float16, shapes=[(3, 4)] * 6)
        assert ok == [False, True, False, True, False, True]
        for h, o, good in zip("abcdef", outs, ok):
            assert same_bytes(o, ts[h]) if good else bool((o == 0).all())


def test_namespaces_do_not_share(master):
    t = embedding((6, 10), torch.bfloat16, seed=11)
    a = fresh(master, model="org/vlm-a", encoder_version="v1", dtype=torch.bfloat16)
    others = [fresh(master, model="org/vlm-b", encoder_version="v1", dtype=torch.bfloat16),
              fresh(master, model="org/vlm-a", encoder_version="v2", dtype=torch.bfloat16),
              fresh(master, model="org/vlm-a", encoder_version="v1", dtype=torch.float16),
              fresh(master, model="org/vlm-a", encoder_version="v1", dtype=torch.bfloat16,
                    tenant="other")]
    same = fresh(master, model="org/vlm-a", encoder_version="v1", dtype="bfloat16")
    try:
        assert len({c.namespace for c in [a, *others]}) == 5 and same.namespace == a.namespace
        assert a.put("img", t)
        for c in others:
            assert c.batch_exists(["img"]) == [False] and c.get("img") is None
        assert same_bytes(same.get("img"), t)
        # clear() removes one namespace only
        assert others[0].put("img", t)
        assert a.clear() == 2                    # header + payload
        assert a.get("img") is None and same_bytes(others[0].get("img"), t)
    finally:
        for c in [a, same, *others]:
            c.clear()
            c.close()


def test_embedding_namespaces_never_equal_kv_namespaces(master):
    kv = KVNamespace("org/vlm-a", "torch.bfloat16", "page_first", 64).digest()
    with EmbeddingCache(master, namespace=kv) as named:      # any name: prefixed, never a KV one
        assert named.namespace == "emb-" + kv
    with EmbeddingCache(master, namespace="my-encoder") as mine:
        t = torch.arange(8, dtype=torch.float32)
        assert mine.namespace == "emb-my-encoder" and mine.put("img", t)
        assert same_bytes(mine.get("img"), t)
        mine.clear()
    with pytest.raises(ValueError, match="without '/'"):
        EmbeddingCache(master, namespace="a/b")
    with pytest.raises(ValueError, match="without '/'"):
        fresh(master).put("a/b", torch.ones(2))
    with pytest.raises(ValueError, match="namespace="):
        EmbeddingCache(master)


PEER = """
import sys, torch
sys.path.insert(0, {tests!r})
from test_embeddings import embedding, same_bytes
from hicache_mc import EmbeddingCache
with EmbeddingCache({master!r}, model="test/two-procs", dtype=torch.bfloat16) as c:
    mine = c.get("parent-image")
    ok = mine is not None and same_bytes(mine, embedding((64, 48), torch.bfloat16, seed=1))
    c.put("child-image", embedding((9, 48), torch.bfloat16, seed=2))
print("child read parent:", ok)
"""


def test_two_processes_share(master):
    with EmbeddingCache(master, model="test/two-procs", dtype=torch.bfloat16) as cache:
        assert cache.put("parent-image", embedding((64, 48), torch.bfloat16, seed=1))
        out = subprocess.run([sys.executable, "-c", PEER.format(
            tests=str(__import__("pathlib").Path(__file__).parent), master=master)],
            capture_output=True, text=True, timeout=120)
        assert "child read parent: True" in out.stdout, out.stdout + out.stderr
        assert same_bytes(cache.get("child-image"), embedding((9, 48), torch.bfloat16, seed=2))
        cache.clear()


def test_store_down_is_a_miss_quickly():
    with EmbeddingCache(f"tcp://127.0.0.1:{free_port()}", model="test/down", timeout_s=0.3,
                        circuit_failures=100) as cache:
        t0 = time.monotonic()
        assert cache.batch_exists([f"h{i}" for i in range(8)]) == [False] * 8
        out = torch.zeros(8)
        assert cache.batch_get_into([f"h{i}" for i in range(4)], [out.data_ptr()] * 4, [8] * 4,
                                    dtype=torch.float32, shapes=[(2,)] * 4) == [False] * 4
        assert cache.get("h0") is None
        assert cache.put("h0", out) is False
        # one deadline per call, not one per hash
        assert time.monotonic() - t0 < 6 * 0.3 + 1.0


def test_import_stays_light():
    code = ("import sys, hicache_mc; assert 'torch' not in sys.modules; "
            "from hicache_mc import EmbeddingCache; print(EmbeddingCache.__module__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "hicache_mc.embeddings", out.stderr
    assert hicache_mc.EmbeddingCache is EmbeddingCache


def test_a_client_credential_puts_the_cache_in_its_tenant(tmp_path):
    from hicache_mc.auth import issue
    from procs import Cluster
    token = "emb-token-" + "3c" * 16
    c = Cluster(tmp_path, token=token)
    c.start_serve("32MiB")
    cred = issue(token, "client", "teamA").text()
    t = embedding((4, 8), torch.float16, seed=3)
    try:
        with EmbeddingCache(c.master, model="org/vlm", dtype=torch.float16, token=cred) as derived, \
                EmbeddingCache(c.master, namespace="mine", token=cred) as named:
            assert derived.namespace.endswith("@teamA") and named.namespace == "emb-mine@teamA"
            for cache in (derived, named):
                assert cache.put("img", t) and same_bytes(cache.get("img"), t)
        with pytest.raises(ValueError, match="teamA"):
            EmbeddingCache(c.master, model="org/vlm", tenant="teamB", token=cred)
        with pytest.raises(ValueError, match="not in tenant 'teamA'"):
            EmbeddingCache(c.master, namespace="x@teamB", token=cred)
    finally:
        c.stop()
