"""Several processes: two nodes behind one master, node and master failures."""
import time

import numpy as np

from hicache_mc.client import StoreClient


def blob(key: str, size: int = 50_000) -> bytes:
    return np.random.default_rng(abs(hash(key)) % (1 << 32)).integers(0, 256, size, dtype=np.uint8).tobytes()


def test_two_nodes_spread_and_serve(cluster):
    cluster.start_master()
    cluster.add_node()
    cluster.add_node()
    cluster.wait_nodes(2)
    with StoreClient(cluster.master) as c:
        keys = [f"spread/{i}" for i in range(40)]
        for k in keys:
            assert c.put(k, blob(k))
        per_node = cluster.wait_objects(40)
        assert len(per_node) == 2 and all(n > 0 for n in per_node.values()), per_node
        for k in keys:
            assert c.get(k) == blob(k)


def test_killed_node_keys_become_misses_others_still_work(cluster):
    cluster.start_master()
    victim = cluster.add_node()
    cluster.add_node()
    cluster.wait_nodes(2)
    with StoreClient(cluster.master, timeout_s=2.0) as c:
        keys = [f"kill/{i}" for i in range(30)]
        for k in keys:
            assert c.put(k, blob(k))
        where = cluster.wait_objects(30)
        assert where[victim.address] > 0
        victim.kill()
        cluster.wait_nodes(1, timeout_s=10)      # dropped within the liveness window
        survivors = [k for k in keys if c.exists(k)]
        assert 0 < len(survivors) < len(keys)
        t0 = time.monotonic()
        for k in keys:                           # misses, never a hang or a wrong value
            got = c.get(k)
            assert got is None or got == blob(k)
        assert time.monotonic() - t0 < 10
        for k in survivors:
            assert c.get(k) == blob(k)
        assert c.put("kill/new", b"still writable")
        assert c.get("kill/new") == b"still writable"


def test_master_restart_rebuilds_index_from_nodes(cluster):
    cluster.start_master()
    cluster.add_node()
    cluster.wait_nodes(1)
    with StoreClient(cluster.master, timeout_s=1.0, circuit_open_s=0.2) as c:
        for i in range(20):
            assert c.put(f"mr/{i}", blob(f"mr/{i}"))
        cluster.master_proc.kill()
        assert c.get("mr/0") is None             # master down: a miss, not a hang
        assert c.batch_exists(["mr/0"]) == 0
        cluster.start_master()
        cluster.wait_keys(20, timeout_s=20)
        end = time.monotonic() + 10
        while c.get("mr/0") is None and time.monotonic() < end:
            time.sleep(0.2)                      # the circuit may still be open briefly
        for i in range(20):
            assert c.get(f"mr/{i}") == blob(f"mr/{i}")


def test_client_never_hangs_when_store_is_down(cluster):
    cluster.start_master()
    cluster.add_node()
    cluster.wait_nodes(1)
    with StoreClient(cluster.master, timeout_s=0.5, circuit_failures=2, circuit_open_s=30) as c:
        assert c.put("down/a", b"1")
        for p in cluster.procs():
            p.kill()
        t0 = time.monotonic()
        assert c.get("down/a") is None
        assert c.get("down/a") is None            # second failure opens the circuit
        t1 = time.monotonic()
        assert c.batch_exists(["down/a"]) == 0     # answered at once: the circuit is open
        assert c.batch_put_from(["down/b"], [0], [0]) == [False]
        assert time.monotonic() - t1 < 0.1
        assert t1 - t0 < 5
        assert c.stats()["client"]["circuit_opens"] == 1
