"""Mixed TP sizes: MHA pages stored in head groups (``tp_lcm_size``), read byte for byte by any
TP size whose heads are whole groups; every other TP size misses, never reads wrong bytes."""
from __future__ import annotations

import pytest
import torch

from hicache_mc.direct import kv_namespace
from hicache_mc.errors import ConfigError
from pools import (fill_random, make_backend, mha_host, page_hashes, read_token_kv, slots,
                   write_token_kv)

HEADS, LAYERS, DIM, PS, PAGES = 8, 2, 16, 8, 4     # the model's 8 KV heads, all TP ranks together
_model = iter(range(1_000_000))


class Instance:
    """The TP ranks of one SGLang instance: a real host pool and a HiCacheMC per rank."""

    def __init__(self, master: str, model: str, tp: int, lcm=None, layout: str = "page_head",
                 **extra):
        self.tp, self.heads = tp, HEADS // tp
        self.ranks = []
        for rank in range(tp):
            pool = mha_host(layout, page_size=PS, layers=LAYERS, heads=self.heads, head_dim=DIM,
                            tokens=2 * PAGES * PS)
            self.ranks.append((pool, make_backend(pool, master, tp_rank=rank, tp_size=tp,
                                                  tp_lcm_size=lcm, model=model, **extra)))

    def heads_of(self, rank: int, kv: torch.Tensor) -> torch.Tensor:
        return kv[..., rank * self.heads:(rank + 1) * self.heads, :]

    def write(self, hashes: list[str], kv: torch.Tensor) -> None:
        for rank, (pool, backend) in enumerate(self.ranks):
            idx = slots(pool, len(hashes))
            write_token_kv(pool, idx, self.heads_of(rank, kv))
            assert backend.batch_set_v1(hashes, idx) == [True] * len(hashes)
            pool.free(idx)

    def read(self, hashes: list[str], kv: torch.Tensor) -> list[int]:
        """Pages each rank finds and loads; what it loads must be its heads of ``kv``, and
        nothing else may change."""
        found = []
        for rank, (pool, backend) in enumerate(self.ranks):
            idx = slots(pool, len(hashes))
            fill_random(pool, idx, seed=rank)
            before = read_token_kv(pool, idx)
            n = backend.batch_exists(hashes)
            ok = backend.batch_get_v1(hashes, idx)
            got = read_token_kv(pool, idx)
            loaded = sum(ok) * PS
            assert ok == [True] * sum(ok) + [False] * (len(hashes) - sum(ok))
            assert same(got[:, :loaded], self.heads_of(rank, kv)[:, :loaded])
            assert same(got[:, loaded:], before[:, loaded:])      # poisoned bytes, NaNs too
            assert n == sum(ok)
            found.append(n)
            pool.free(idx)
        return found

    def close(self) -> None:
        for _, backend in self.ranks:
            backend.close()


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.fixture
def fleet(shared_store):
    """Instances of one model (a fresh one per test) sharing the store."""
    made, model = [], f"test/heads-{next(_model)}"

    def instance(tp: int, lcm=None, **kw) -> Instance:
        made.append(Instance(shared_store.master, model, tp, lcm, **kw))
        return made[-1]
    instance.model = model
    yield instance
    for i in made:
        i.close()


def conversation(seed: int) -> tuple[list[str], torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(2, PAGES * PS, LAYERS, HEADS, DIM, generator=g).bfloat16()
    return page_hashes(PAGES, PS), kv


@pytest.mark.parametrize("reader_tp", [1, 2, 4])
def test_written_at_tp2_read_at_tp1_2_and_4(fleet, reader_tp):
    hashes, kv = conversation(reader_tp)
    fleet(2, lcm=4).write(hashes, kv)
    assert fleet(reader_tp, lcm=4).read(hashes, kv) == [PAGES] * reader_tp


def test_groups_are_the_keys_of_the_tp_size_they_are_named_after(fleet):
    # a TP-4 instance without tp_lcm_size reads TP-2 groups of TP size 4, and a TP-2 instance
    # without it stores what a TP-1 instance with tp_lcm_size 2 reads
    hashes, kv = conversation(11)
    fleet(2, lcm=4).write(hashes, kv)
    assert fleet(4).read(hashes, kv) == [PAGES] * 4
    hashes, kv = conversation(12)
    fleet(2).write(hashes, kv)
    assert fleet(1, lcm=2).read(hashes, kv) == [PAGES]


@pytest.mark.parametrize("reader_tp, lcm", [(8, 8), (1, 2), (2, None), (1, None)])
def test_tp_sizes_not_made_of_stored_groups_miss(fleet, reader_tp, lcm):
    hashes, kv = conversation(20 + reader_tp)
    fleet(2, lcm=4).write(hashes, kv)
    assert fleet(reader_tp, lcm=lcm).read(hashes, kv) == [0] * reader_tp


def test_one_group_per_rank_keeps_the_ranks_own_namespace(fleet):
    for lcm in (None, 2):
        inst = fleet(2, lcm=lcm)
        for rank, (pool, backend) in enumerate(inst.ranks):
            ns = kv_namespace(fleet.model, pool.dtype, "page_head", PS, LAYERS, tp_size=2,
                              tp_rank=rank)
            assert backend.spaces == (ns.digest(),)
            assert backend.objects_per_page == 2          # k and v: no extra keys


def test_flat_page_path_reads_the_same_groups(fleet):
    hashes, kv = conversation(31)
    fleet(2, lcm=4).write(hashes, kv)
    pool, backend = fleet(1, lcm=4, interface_v1=0).ranks[0]
    pages = backend.batch_get(hashes)
    assert all(p is not None for p in pages)
    idx = slots(pool, PAGES)
    for start, page in zip(idx[::PS].tolist(), pages):
        pool.set_from_flat_data_page(start, page)
    assert torch.equal(read_token_kv(pool, idx), kv)


@pytest.mark.parametrize("layout, tp, lcm, heads, why", [
    ("page_first", 2, 4, 4, "page_head"),
    ("layer_first", 2, 4, 4, "page_head"),
    ("page_head", 2, 3, 4, "not a multiple"),
    ("page_head", 4, 8, 1, "whole heads"),
])
def test_head_groups_that_cannot_be_stored_fail_start_up(shared_store, layout, tp, lcm, heads,
                                                         why):
    pool = mha_host(layout, page_size=PS, layers=LAYERS, heads=heads, head_dim=DIM)
    with pytest.raises(ConfigError, match=why):
        make_backend(pool, shared_store.master, tp_rank=0, tp_size=tp, tp_lcm_size=lcm)


def test_hot_pages_count_every_head_group_of_a_page(tmp_path):
    """hot_pages names pages; a page stored as G/tp head groups is that many objects per part,
    every one of them hot."""
    from hicache_mc import protocol as P
    from procs import Cluster, request
    c = Cluster(tmp_path)
    c.start_master()
    for n in (1, 2):
        c.add_node(dram="64MiB")
        c.wait_nodes(n)
    try:
        pool = mha_host("page_head", page_size=PS, layers=LAYERS, heads=HEADS, head_dim=DIM)
        backend = make_backend(pool, c.master, tp_lcm_size=4, replicas=2, hot_pages=-1)
        hashes, src = page_hashes(2, PS), slots(pool, 2)
        fill_random(pool, src, seed=1)
        assert backend.batch_set_v1(hashes, src) == [True, True]
        stats = request(c.master, P.StatsRequest()).stats
        assert stats["copies_placed"] == 2 * backend.objects_per_page == 2 * 4 * 2
        backend.close()
    finally:
        c.stop()
