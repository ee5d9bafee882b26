"""The SGLang embedding store under SGLang's own EmbeddingCacheController, and embeddings next
to KV pages in one small store."""
from __future__ import annotations

import asyncio
import os
import time
import types

import pytest
import torch
from sglang.srt.managers.schedule_batch import Modality
from sglang.srt.mem_cache import embedding_cache_controller as ecc
from sglang.srt.mem_cache.embedding_store import EmbeddingStore, EmbeddingStoreFactory
from sglang.srt.runtime_context import get_parallel

from procs import Cluster
from pools import fill_random, make_backend, mha_host, page_bytes, page_hashes, slots

from hicache_mc.embeddings import EmbeddingCache
from hicache_mc.sglang import plugin
from hicache_mc.sglang.embedding_store import HiCacheMCEmbeddingStore

MODEL = "test/vlm"


@pytest.fixture
def store_env(shared_store, monkeypatch):
    """What an encoder server's environment holds: the factory passes no arguments."""
    monkeypatch.setenv("HICACHE_MC_MASTER", shared_store.master)
    monkeypatch.setenv("HICACHE_MC_MODEL_NAME", MODEL)
    monkeypatch.setenv("HICACHE_MC_ENCODER_VERSION", f"v{time.monotonic_ns()}")   # fresh namespace
    plugin.register_backends()
    return shared_store


def new_store() -> HiCacheMCEmbeddingStore:
    """As SGLang's encoder server makes it: by name, no arguments."""
    store = EmbeddingStoreFactory.create_backend("hicache_mc")
    assert isinstance(store, HiCacheMCEmbeddingStore) and isinstance(store, EmbeddingStore)
    return store


def rand(shape, dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    n = int(torch.tensor(shape).prod()) * dtype.itemsize
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).view(dtype).view(shape)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8),
                                              b.contiguous().view(torch.uint8))


# ---------------------------------------------------------------------- the EmbeddingStore ABC

def test_store_satisfies_the_abc_with_pointers_into_real_tensors(store_env):
    writer, reader = new_store(), new_store()
    try:
        pool_w = torch.zeros(64, 48, dtype=torch.bfloat16)
        pool_r = torch.full((64, 48), 7.0, dtype=torch.bfloat16)
        writer.register_buffer(pool_w)
        reader.register_buffer(pool_r)
        pool_w[0:10] = rand((10, 48), torch.bfloat16, 1)
        pool_w[10:13] = rand((3, 48), torch.bfloat16, 2)
        row = 48 * 2
        ptr_w = pool_w.data_ptr()
        assert writer.batch_put(["a", "b"], [ptr_w, ptr_w + 10 * row], [10 * row, 3 * row]) == [True, True]
        assert reader.batch_is_exist(["a", "x", "b"]) == [True, False, True]
        ptr_r = pool_r.data_ptr()
        ok = reader.batch_get(["b", "x", "a"], [ptr_r + 40 * row, ptr_r, ptr_r + 20 * row],
                              [3 * row, 5 * row, 10 * row])
        assert ok == [True, False, True]
        assert same(pool_r[40:43], pool_w[10:13]) and same(pool_r[20:30], pool_w[0:10])
        assert bool((pool_r[0:5] == 7.0).all())                     # a miss writes nothing
        # another token count than stored: a miss, not a truncated or padded copy
        assert reader.batch_get(["a"], [ptr_r + 50 * row], [9 * row]) == [False]
        assert bool((pool_r[50:59] == 7.0).all())
        # the keys are SGLang's: emb_<hash>, in this deployment's namespace
        cache = EmbeddingCache(model=MODEL, encoder_version=os.environ["HICACHE_MC_ENCODER_VERSION"],
                               dtype=torch.bfloat16, client=writer.client)
        assert writer.get_key("a") == "emb_a" and same(cache.get("emb_a"), pool_w[0:10])
    finally:
        writer.close()
        reader.close()


def test_multi_buffers_with_different_page_runs_on_each_side(store_env):
    writer, reader = new_store(), new_store()
    try:
        pool_w, pool_r = torch.zeros(100, 16), torch.zeros(100, 16)
        writer.register_buffer(pool_w)
        reader.register_buffer(pool_r)
        data = rand((30, 16), torch.float32, 3)
        row = 16 * 4
        # written from runs of 8 + 8 + 14 rows, read into one run, and into runs of 5 + 25
        for (start, n), (s, e) in zip([(0, 8), (40, 8), (70, 14)], [(0, 8), (8, 16), (16, 30)]):
            pool_w[start:start + n] = data[s:e]
        base = pool_w.data_ptr()
        assert writer.batch_put_from_multi_buffers(
            ["m"], [[base, base + 40 * row, base + 70 * row]], [[8 * row, 8 * row, 14 * row]]) == [True]
        b = pool_r.data_ptr()
        assert reader.batch_get_into_multi_buffers(["m"], [[b]], [[30 * row]]) == [True]
        assert same(pool_r[0:30], data)
        assert reader.batch_get_into_multi_buffers(
            ["m"], [[b + 90 * row, b + 40 * row]], [[5 * row, 25 * row]]) == [True]
        assert same(pool_r[90:95], data[:5]) and same(pool_r[40:65], data[5:])
    finally:
        writer.close()
        reader.close()


def test_refuses_what_it_cannot_describe(store_env):
    store = new_store()
    try:
        pool = torch.zeros(8, 32, dtype=torch.float16)
        store.register_buffer(pool)
        stray = torch.zeros(64, dtype=torch.float16)
        row = 64
        assert store.batch_put(["x"], [stray.data_ptr()], [row]) == [False]        # in no pool
        assert store.batch_put(["y"], [pool.data_ptr()], [row + 2]) == [False]     # not whole rows
        assert store.batch_put(["z"], [pool.data_ptr() + 7 * row], [2 * row]) == [False]  # past the end
        assert store.batch_put(["ok"], [pool.data_ptr()], [row]) == [True]
        # another pool dim (same bytes): another shape, so a miss
        other = new_store()
        wide = torch.zeros(8, 16, dtype=torch.float16)
        other.register_buffer(wide)
        assert other.batch_get(["ok"], [wide.data_ptr()], [row]) == [False]
        other.close()
    finally:
        store.close()


def test_no_model_name_is_a_config_error(shared_store, monkeypatch):
    monkeypatch.delenv("HICACHE_MC_MODEL_NAME", raising=False)
    from hicache_mc.errors import ConfigError
    with pytest.raises(ConfigError, match="model_name"):
        HiCacheMCEmbeddingStore(master=shared_store.master)


# ---------------------------------------------------------------------- SGLang's own controller

@pytest.fixture
def controllers(store_env, monkeypatch):
    """Two encoder instances' EmbeddingCacheControllers (tiny host pools; no pinning on CPU)."""
    create = ecc.EmbeddingCacheController._create_pools
    monkeypatch.setattr(ecc.EmbeddingCacheController, "_create_pools",
                        lambda self, pin_memory: create(self, False))
    made = []
    tp = types.SimpleNamespace(cpu_group=None)
    with get_parallel().override(tp_size=1, tp_rank=0, tp_group=tp):
        for _ in range(2):
            made.append(ecc.EmbeddingCacheController(
                new_store(), max_pool_size_gb=0.0025, dtype=torch.bfloat16,
                hidden_dims={Modality.IMAGE: 64, Modality.AUDIO: 64}))
    yield made
    for c in made:
        c.stop_event.set()
        c.io_thread.join(5)
        c.embedding_store.close()


def fragment(ctl, keep_every: int, offset: int) -> None:
    """Take every vision page, then give back a scattered subset: no long free run remains."""
    pool = ctl.vision_pool
    with ctl.lock:
        runs = [pool.allocator.allocate(pool.page_size, pool.page_size)[0]
                for _ in range(pool.num_pages)]
        pool.allocator.free([r for i, r in enumerate(runs) if (i + offset) % keep_every])


def encoded(ctl, mm_hash: str, data: torch.Tensor) -> None:
    """What store_to_pool_async + wait_store_to_pool leave (their copy needs CUDA): a READY entry
    in pages the controller allocated, filled by the controller's own copy routine."""
    pool = ctl.vision_pool
    with ctl.lock:
        runs = ctl._allocate_with_eviction(pool, data.shape[0])
        entry = ecc.EmbeddingCacheEntry(hash=mm_hash, modality=Modality.IMAGE,
                                        num_tokens=data.shape[0], dim=pool.dim, page_runs=runs,
                                        state=ecc.EntryState.FILLING)
        ctl.entries[mm_hash] = entry
    ctl._copy_embedding_page_runs(src=data, dst=pool.tensor, entry=entry, pool=pool, src_is_pool=False)
    with ctl.lock:
        ctl._mark_ready(entry)


def wait_for(cond, timeout_s: float = 30.0) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


def test_real_controller_shares_embeddings_between_instances(controllers):
    a, b = controllers
    ps = a.vision_pool.page_size                # 2048 tokens of 64 bf16 = 256 KiB pages
    assert a.vision_pool.num_pages >= 6
    fragment(a, keep_every=2, offset=0)         # a: every other page free
    fragment(b, keep_every=3, offset=1)         # b: another pattern
    items = {"img1": rand((2 * ps + 100, 64), torch.bfloat16, 1),   # 3 pages, a partial last one
             "img2": rand((ps // 3, 64), torch.bfloat16, 2)}          # less than a page
    for h, t in items.items():
        encoded(a, h, t)
    assert len(a.entries["img1"].page_runs) == 3                    # scattered on the writer
    a.insert_batch(list(items), Modality.IMAGE)
    wait_for(lambda: a.insert_queue.unfinished_tasks == 0)
    assert all(e.ref_count == 0 for e in a.entries.values())        # _finish_put unpinned them

    hashes = ["img1", "never-encoded", "img2"]
    assert asyncio.run(b.batch_is_exist(hashes)) == [True, False, True]
    b.prefetch("req-1", ["img1", "img2"], [t.shape[0] for t in items.values()], Modality.IMAGE)
    wait_for(lambda: b.check_prefetch_progress("req-1"))
    assert b.has_local_embedding("img1") and b.has_local_embedding("img2")
    views = b.get_pool_views(["img1", "img2"])
    try:
        for (h, t), runs in zip(items.items(), views):
            assert same(torch.cat(runs), t), h
    finally:
        b.release_pool_views(["img1", "img2"])
    # an item the store lacks: the controller frees it and will run the encoder
    b.prefetch("req-2", ["never-encoded"], [500], Modality.IMAGE)
    wait_for(lambda: b.check_prefetch_progress("req-2"))
    assert not b.has_local_embedding("never-encoded") and "never-encoded" not in b.entries


# ---------------------------------------------------------------------- eviction next to KV pages

def test_embedding_eviction_keeps_kv_pages_intact(tmp_path, monkeypatch):
    """A 32 MiB store takes 48 MiB of KV pages and embeddings in turn, so it evicts both kinds and
    reuses each kind's slots for the other. Eviction goes in LRU order across the two (what is
    lost is exactly the oldest items), and every item still readable holds its own bytes."""
    small = Cluster(tmp_path).start_serve("32MiB")
    try:
        monkeypatch.setenv("HICACHE_MC_MASTER", small.master)
        monkeypatch.setenv("HICACHE_MC_MODEL_NAME", MODEL)
        plugin.register_backends()
        host = mha_host("page_first", layers=8, heads=8, head_dim=128, tokens=256)  # 512 KiB pages
        kv = make_backend(host, small.master, timeout_s=5.0)
        emb = new_store()
        rows = torch.empty(512, 1024, dtype=torch.bfloat16)          # 256-row items: 512 KiB
        emb.register_buffer(rows)
        history = []                                  # (kind, key, expected bytes) in write order
        seed = iter(range(10**6))

        def put_kv(n):
            idx = slots(host, n)
            fill_random(host, idx, seed=next(seed))
            hashes = page_hashes(n, host.page_size)
            assert kv.batch_set_v1(hashes, idx) == [True] * n
            history.extend(("kv", h, b) for h, b in zip(hashes, page_bytes(host, idx)))
            host.free(idx)

        def put_emb(n):
            for _ in range(n):
                h = f"img{next(seed)}"
                rows[:256] = rand((256, 1024), torch.bfloat16, next(seed))
                assert emb.batch_put([h], [rows.data_ptr()], [rows[:256].nbytes]) == [True]
                history.append(("emb", h, rows[:256].clone()))

        for _ in range(3):
            put_emb(16)
            put_kv(16)
        time.sleep(0.5)                               # the master hears of dropped keys by heartbeat

        readable = []
        for kind, key, want in history:               # one item per call, oldest first
            if kind == "kv":
                idx = slots(host, 1)
                got = kv.batch_get_v1([key], idx) == [True]
                assert not got or torch.equal(page_bytes(host, idx)[0], want), f"KV page {key} corrupt"
                host.free(idx)
            else:
                rows[256:].fill_(0)
                got = emb.batch_get([key], [rows[256:].data_ptr()], [want.nbytes]) == [True]
                assert not got or same(rows[256:], want), f"embedding {key} corrupt"
            readable.append(got)
        lost = [i for i, ok in enumerate(readable) if not ok]
        assert lost == list(range(len(lost))), f"lost items {lost}: not the oldest ones"
        assert {history[i][0] for i in lost} == {"kv", "emb"}
        assert readable.count(True) * 512 * 1024 >= 24 << 20      # the store stayed mostly full
        kv.close()
        emb.close()
    finally:
        small.stop()
