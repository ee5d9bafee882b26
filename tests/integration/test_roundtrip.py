"""Round trips through a real embedded store, both transports; leading-run exists; sharing."""
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from hicache_mc.client import StoreClient
from procs import in_threads

SIZES = [1 << 10, 64 << 10, 1 << 20, 8 << 20]


def payload(key: str, size: int) -> np.ndarray:
    """Content derived from the key, so a wrong object is detected."""
    seed = abs(hash(key)) % (1 << 32)
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_round_trip_sizes(shared_store, transport):
    with StoreClient(shared_store.master, transport=transport) as c:
        keys = [f"rt-{transport}/{s}" for s in SIZES]
        srcs = [payload(k, s) for k, s in zip(keys, SIZES)]
        assert c.batch_put_from(keys, [a.ctypes.data for a in srcs], SIZES) == [True] * 4
        dsts = [np.zeros(s, dtype=np.uint8) for s in SIZES]
        assert c.batch_get_into(keys, [a.ctypes.data for a in dsts], SIZES) == [True] * 4
        for a, b in zip(srcs, dsts):
            assert np.array_equal(a, b)
        # single-key API
        assert c.put(f"rt-{transport}/bytes", b"x" * 4097)
        assert c.get(f"rt-{transport}/bytes") == b"x" * 4097
        assert c.get(f"rt-{transport}/absent") is None


def eventually(fn, timeout_s: float = 2.0):
    """``fn()`` once it is truthy. A put is visible to its writer at once (fences), and to other
    clients once the master has the node's report: on one host, before the put returns (the
    node reports before it answers, and the master applies reports first); across hosts, a
    moment later."""
    end = time.monotonic() + timeout_s
    while True:
        got = fn()
        if got or time.monotonic() > end:
            return got
        time.sleep(0.01)


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_client_whose_clock_is_far_ahead_of_the_nodes_reads_and_writes(shared_store, monkeypatch,
                                                                         transport):
    """Leases and reservations are granted for a time, not until a time on the node's clock: a
    client on a host that booted long before the node's (its monotonic clock far ahead) still
    reads and writes. With absolute node deadlines, every grant looked lapsed to it."""
    real = time.monotonic
    monkeypatch.setattr(time, "monotonic", lambda: real() + 1e6)
    with StoreClient(shared_store.master, transport=transport) as c:
        for round_ in range(3):      # the first put, then the early Reserve / Lease paths
            keys = [f"clock-{transport}/{round_}/{i}" for i in range(4)]
            srcs = [payload(k, 64 << 10) for k in keys]
            assert c.batch_put_from(keys, [a.ctypes.data for a in srcs], [64 << 10] * 4) == [True] * 4
            dsts = [np.zeros(64 << 10, dtype=np.uint8) for _ in keys]
            assert c.batch_get_into(keys, [a.ctypes.data for a in dsts], [64 << 10] * 4) == [True] * 4
            assert all(np.array_equal(a, b) for a, b in zip(srcs, dsts))


def test_transports_read_each_others_writes(shared_store):
    with StoreClient(shared_store.master, transport="shm") as shm, \
            StoreClient(shared_store.master, transport="tcp") as tcp:
        a = payload("x/1", 300_000)
        assert shm.put("x/1", a)
        assert eventually(lambda: tcp.get("x/1")) == a.tobytes()
        assert tcp.put("x/2", a[:1000])
        assert eventually(lambda: shm.get("x/2")) == a[:1000].tobytes()


def test_exists_counts_leading_run(shared_store):
    with StoreClient(shared_store.master) as c:
        for k in ["e/a", "e/b", "e/d"]:
            assert c.put(k, b"1234")
        assert c.batch_exists(["e/a", "e/b", "e/c", "e/d"]) == 2
        assert c.batch_exists(["e/c", "e/a"]) == 0
        assert c.batch_exists(["e/a", "e/b", "e/d"]) == 3
        assert c.batch_exists([]) == 0
        assert c.exists("e/d") and not c.exists("e/c")


def test_get_with_wrong_size_is_a_miss(shared_store):
    with StoreClient(shared_store.master) as c:
        assert c.put("ws/a", b"abcd")
        buf = np.zeros(8, dtype=np.uint8)
        assert c.batch_get_into(["ws/a"], [buf.ctypes.data], [8]) == [False]
        assert not buf.any()


def test_put_of_stored_key_is_success_without_rewrite(shared_store):
    with StoreClient(shared_store.master) as c:
        before = c.stats()["cluster"]["deduplicated"]
        assert c.put("dup/a", b"first")
        assert c.put("dup/a", b"other")           # already stored: success, nothing rewritten
        assert c.get("dup/a") == b"first"         # (by the node, if its report was in flight)
        assert c.exists("dup/a")                  # fenced: the master has it now
        assert c.put("dup/a", b"third")           # ... so the master's Place deduplicates it
        assert c.get("dup/a") == b"first"
        assert c.stats()["cluster"]["deduplicated"] >= before + 1


def test_bad_arguments_raise_clearly(shared_store):
    with StoreClient(shared_store.master) as c:
        with pytest.raises(ValueError, match="lengths differ"):
            c.batch_put_from(["a"], [1, 2], [1])
        with pytest.raises(ValueError, match="non-empty strings"):
            c.batch_exists(["", "b"])


def test_two_processes_see_each_others_puts(shared_store):
    script = textwrap.dedent(f"""
        from hicache_mc.client import StoreClient
        with StoreClient({shared_store.master!r}) as c:
            assert c.put("proc/shared", b"from-the-other-process" * 100)
            print(c.get("proc/mine").decode())
    """)
    with StoreClient(shared_store.master) as c:
        assert c.put("proc/mine", b"hello-from-the-test")
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == "hello-from-the-test"
        assert c.get("proc/shared") == b"from-the-other-process" * 100


def test_clear_by_prefix(shared_store):
    with StoreClient(shared_store.master) as c:
        for k in ["ns1/a", "ns1/b", "ns2/a"]:
            assert c.put(k, b"v")
        assert c.clear("ns1/") == 2
        assert not c.exists("ns1/a") and not c.exists("ns1/b")
        assert c.get("ns2/a") == b"v"


def test_threads_share_one_client(shared_store):
    with StoreClient(shared_store.master) as c:
        def work(t):
            for i in range(20):
                k = f"th/{t}/{i}"
                data = payload(k, 10_000 + i)
                assert c.put(k, data)
                assert c.get(k) == data.tobytes()
                assert c.batch_exists([k]) == 1
        assert not in_threads(work, 4)


def test_per_key_answers_go_past_holes(shared_store):
    with StoreClient(shared_store.master) as c:
        for k in ["h/a", "h/c"]:
            assert c.put(k, b"12345678")
        assert c.batch_contains(["h/a", "h/b", "h/c"]) == [True, False, True]
        assert c.batch_exists(["h/a", "h/b", "h/c"]) == 1          # the prefix probe stops at the hole
        bufs = [np.zeros(8, dtype=np.uint8) for _ in range(3)]
        assert c.batch_get_into(["h/a", "h/b", "h/c"], [b.ctypes.data for b in bufs], [8] * 3) == \
            [True, False, True]
        assert bufs[2].tobytes() == b"12345678" and not bufs[1].any()


def test_get_after_exists_skips_locate_and_stale_locations_are_misses(shared_store):
    with StoreClient(shared_store.master) as c, StoreClient(shared_store.master) as other:
        for k in ["loc/a", "loc/b"]:
            assert c.put(k, b"abcdefgh")
        assert c.batch_exists(["loc/a", "loc/b"]) == 2
        bufs = [np.zeros(8, dtype=np.uint8) for _ in range(2)]
        ptrs = [b.ctypes.data for b in bufs]
        assert c.batch_get_into(["loc/a", "loc/b"], ptrs, [8, 8]) == [True, True]
        assert c.stats()["client"]["locate_saved"] == 1
        assert c.batch_exists(["loc/a"]) == 1
        assert other.clear("loc/a") == 1                  # gone between the probe and the read
        assert c.batch_get_into(["loc/a"], ptrs[:1], [8]) == [False]
        assert c.stats()["client"]["locate_saved"] == 2
        assert c.get("loc/b") == b"abcdefgh"


UNCLOSED = textwrap.dedent("""
    import gc, sys
    from hicache_mc.client import StoreClient
    for transport in ("shm", "tcp"):
        for _ in range(5):          # never closed: garbage with its sockets, as a backend SGLang drops
            c = StoreClient(sys.argv[1], transport=transport)
            assert c.put("unclosed/k", b"v" * 100) and c.get("unclosed/k") == b"v" * 100
            del c
            gc.collect()
    print("collected")
""")


def test_a_client_never_closed_is_collected_without_hanging(shared_store):
    """A StoreClient dropped without close() is cyclic garbage (it and its transports refer to
    each other). Collecting it must not block: a ZeroMQ context collected in the same cycle as
    its sockets used to wait in term() for sockets whose finalizers had not run yet."""
    r = subprocess.run([sys.executable, "-c", UNCLOSED, shared_store.master], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and "collected" in r.stdout, r.stderr[-2000:]
