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


def test_serve_runs_its_node_in_a_child_that_ends_with_it(cluster):
    """``serve``: the node has a process of its own, and it goes when ``serve`` is killed
    (even by SIGKILL), taking its segment with it."""
    import os

    cluster.start_serve()
    node = cluster.wait_nodes(1)["nodes"][0]
    child = int(os.path.basename(node["shm_path"]).split("-")[2])
    assert child != cluster.serve_proc.p.pid and os.path.exists(node["shm_path"])
    with StoreClient(cluster.master) as c:
        assert c.put("serve/a", blob("serve/a")) and c.get("serve/a") == blob("serve/a")
    cluster.serve_proc.kill()          # SIGKILL: no chance to stop the child itself
    end = time.monotonic() + 15
    while time.monotonic() < end:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        raise AssertionError("the node outlived serve")
    assert not os.path.exists(node["shm_path"])


def test_serve_whose_node_cannot_start_exits_with_the_reason(cluster, tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    proc = cluster._proc("serve", ["serve", "--port", str(cluster.port), "--dram", "64MiB",
                                   "--ssd", "64MiB", "--ssd-dir", str(not_a_dir)]).start()
    assert proc.p.wait(30) == 1
    assert "the node could not start" in proc.log()


def test_a_stale_record_of_a_restarted_node_is_neither_read_nor_written_through(cluster):
    """A node restarted at the same address has a new segment. A client still holding the old
    record must not copy the new segment's offsets through its old mapping: Lease and Reserve
    replies name their segment, and a mismatch gives misses (not checksum failures) and puts
    that are not stored, with nothing left leased or reserved on the node."""
    import numpy as np

    from hicache_mc import protocol as P
    from procs import free_port, request

    cluster.start_master()
    port = free_port()
    first = cluster.add_node(port=port)
    cluster.wait_nodes(1)
    src = np.random.default_rng(5).integers(0, 256, 100_000, dtype=np.uint8)
    with StoreClient(cluster.master, transport="shm") as c:
        assert c.batch_put_from(["stale/a"], [src.ctypes.data], [src.nbytes]) == [True]
        old = next(iter(c._nodes.values()))
        first.kill()
        cluster.wait_nodes(0, timeout_s=10)
        cluster.add_node(port=port)
        fresh = cluster.wait_nodes(1)["nodes"][0]
        assert P.segment_of(old) != fresh["shm_path"].rsplit("-", 1)[-1]
        # the new node holds the key again (it is written anew through the fresh record) ...
        assert c.batch_put_from(["stale/a"], [src.ctypes.data], [src.nbytes]) == [True]
        dst = np.zeros_like(src)
        # ... but through the old record: a miss, not a checksum failure; and no put
        ch = c._channel(old.address)
        assert c.rounds.read(ch, c.shm, old, ["stale/a"], [dst.ctypes.data], [dst.nbytes],
                             time.monotonic() + 5) == [False]
        assert c.rounds.write(ch, c.shm, old, ["stale/b"], [src.ctypes.data], [src.nbytes],
                              time.monotonic() + 5).ok == [False]
        assert c.checks.failures == 0
        stats = request(old.address, P.NodeStatsRequest()).stats
        assert stats["reserved"] == 0 and stats["quarantined"] == 0
        assert c.batch_get_into(["stale/a"], [dst.ctypes.data], [dst.nbytes]) == [True]
        assert np.array_equal(src, dst)
