"""The Mooncake TE transport against real node processes, over TCP on loopback."""
from __future__ import annotations

import numpy as np
import pytest

from hicache_mc.client import StoreClient

pytest.importorskip("mooncake.engine", reason="the Mooncake transfer engine is not installed")

KiB, MiB = 1 << 10, 1 << 20


def arrays(n: int, size: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(n)]


def ptrs(arrs) -> list[int]:
    return [a.ctypes.data for a in arrs]


@pytest.mark.parametrize("size", [4 * KiB, 64 * KiB + 17, MiB, 8 * MiB])
@pytest.mark.parametrize("registered", [False, True], ids=["staged", "registered"])
def test_round_trip_bytes(te_store, size, registered):
    n = 3
    src, dst = arrays(n, size, seed=size), [np.full(size, 0xAB, np.uint8) for _ in range(n)]
    keys = [f"rt/{registered}/{size}/{i}" for i in range(n)]
    with StoreClient(te_store.master, transport="mooncake") as c:
        if registered:
            for a in src + dst:
                assert c.register_buffer(a.ctypes.data, a.nbytes)
        assert c.batch_put_from(keys, ptrs(src), [size] * n) == [True] * n
        assert c.batch_get_into(keys, ptrs(dst), [size] * n) == [True] * n
        for s, d in zip(src, dst):
            assert np.array_equal(s, d)
        node = next(iter(c._nodes.values()))
        assert c.transport_for(node) is c.te
        path = "direct" if registered else "staged"
        assert c.te.counters[path] == 2 * n               # n written, n read, all on that path
    # another client reads what this one wrote
    with StoreClient(te_store.master, transport="mooncake") as c2:
        out = np.zeros(size, np.uint8)
        assert c2.batch_get_into(keys[:1], [out.ctypes.data], [size]) == [True]
        assert np.array_equal(out, src[0])


def test_small_staging_rounds_and_one_off_registration(te_store):
    # 1 MiB of staging: 256 KiB objects go four to a chunk, 2 MiB ones are registered one-off;
    # 40 MiB + 48 MiB > one 64 MiB round, so the batch also takes two leases/reservations.
    sizes = [256 * KiB] * 160 + [2 * MiB] * 24
    src = [a for s in sorted(set(sizes)) for a in arrays(sizes.count(s), s, seed=s)]
    sizes = [a.nbytes for a in src]
    dst = [np.zeros(s, np.uint8) for s in sizes]
    keys = [f"rounds/{i}" for i in range(len(src))]
    with StoreClient(te_store.master, transport="mooncake", te_staging="1MiB") as c:
        assert all(c.batch_put_from(keys, ptrs(src), sizes))
        assert all(c.batch_get_into(keys, ptrs(dst), sizes))
        assert all(np.array_equal(s, d) for s, d in zip(src, dst))
        assert c.te.counters["staged"] == 2 * 160 and c.te.counters["one_off"] == 2 * 24
        assert not c.te._region_list                   # one-off registrations were undone
        c.clear("rounds/")


def test_unregister_buffer_goes_back_to_staging(te_store):
    src, dst = arrays(1, MiB, seed=5)[0], np.zeros(MiB, np.uint8)
    with StoreClient(te_store.master, transport="mooncake") as c:
        assert c.register_buffer(src.ctypes.data, src.nbytes)
        assert c.put("unreg/a", src)
        assert c.te.counters["direct"] == 1
        c.unregister_buffer(src.ctypes.data)
        assert c.batch_get_into(["unreg/a"], [src.ctypes.data], [MiB]) == [True]
        assert c.te.counters == {"direct": 1, "staged": 1, "one_off": 0, "late_released": 0}
        assert c.batch_get_into(["unreg/a"], [dst.ctypes.data], [MiB]) == [True]
        assert np.array_equal(src, dst)


def test_misses_wrong_sizes_and_rewrites(te_store):
    a = arrays(1, 64 * KiB, seed=9)[0]
    out = np.zeros(128 * KiB, np.uint8)
    with StoreClient(te_store.master, transport="mooncake") as c:
        assert c.batch_put_from(["mr/a"], [a.ctypes.data], [a.nbytes]) == [True]
        b = arrays(1, 64 * KiB, seed=10)[0]
        assert c.batch_put_from(["mr/a"], [b.ctypes.data], [b.nbytes]) == [True]   # stored: no rewrite
        got = c.batch_get_into(["mr/a", "mr/absent", "mr/a"],
                               [out.ctypes.data, out.ctypes.data, out.ctypes.data + 64 * KiB],
                               [64 * KiB, 64 * KiB, 32 * KiB])          # the last asks a wrong size
        assert got == [True, False, False]
        assert np.array_equal(out[:64 * KiB], a)
        assert c.batch_exists(["mr/a", "mr/absent"]) == 1


def test_concurrent_threads(te_store):
    from concurrent.futures import ThreadPoolExecutor
    with StoreClient(te_store.master, transport="mooncake") as c:
        def work(t):
            src = arrays(8, 128 * KiB, seed=100 + t)
            dst = [np.zeros_like(s) for s in src]
            keys = [f"thr/{t}/{i}" for i in range(8)]
            return (c.batch_put_from(keys, ptrs(src), [s.nbytes for s in src]) == [True] * 8 and
                    c.batch_get_into(keys, ptrs(dst), [s.nbytes for s in src]) == [True] * 8 and
                    all(np.array_equal(s, d) for s, d in zip(src, dst)))
        with ThreadPoolExecutor(4) as ex:
            assert all(ex.map(work, range(4)))
