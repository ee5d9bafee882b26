"""Puts: Place, then Reserve, copy and Commit on each node the master chose; keys stored
already are not written again and no reservation is left to expire."""
import numpy as np
import pytest

from hicache_mc import protocol as P
from hicache_mc.client import StoreClient
from procs import request


def node_stats(address: str) -> dict:
    reply = request(address, P.NodeStatsRequest())
    assert isinstance(reply, P.StatsReply), reply
    return reply.stats


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_repeated_and_deduplicated_puts_leave_no_reservation(shared_store, transport):
    node = shared_store.cluster.stats()["nodes"][0]["address"]
    objects, placed = node_stats(node)["objects"], shared_store.cluster.stats()["placed"]
    src = np.random.default_rng(1).integers(0, 256, 64 << 10, dtype=np.uint8)
    with StoreClient(shared_store.master, transport=transport) as c:
        for round_ in range(3):
            keys = [f"early-{transport}/{round_}/{i}" for i in range(16)]
            assert all(c.batch_put_from(keys, [src.ctypes.data] * 16, [src.nbytes] * 16))
            # half stored already (the master deduplicates them), half new
            mixed = keys[:8] + [f"early-{transport}/{round_}/new{i}" for i in range(8)]
            assert all(c.batch_put_from(mixed, [src.ctypes.data] * 16, [src.nbytes] * 16))
        placed = shared_store.cluster.stats()["placed"] - placed
        dst = np.zeros_like(src)
        for key in (keys[0], mixed[-1]):
            assert c.batch_get_into([key], [dst.ctypes.data], [dst.nbytes]) == [True]
            assert np.array_equal(src, dst)
    st = node_stats(node)
    assert st["reserved"] == 0 and st["objects"] - objects == 3 * 24
    assert placed == 3 * 24      # the 8 keys stored already of each round were not placed again


def test_writer_node_full_then_master_places_elsewhere(cluster):
    """Two nodes on this host: once the first is full the master places on the other."""
    cluster.start_master()
    a = cluster.add_node(dram="8MiB")
    cluster.wait_nodes(1)
    src = np.random.default_rng(2).integers(0, 256, 1 << 20, dtype=np.uint8)
    with StoreClient(cluster.master) as c:
        assert all(c.batch_put_from([f"full/a{i}" for i in range(4)], [src.ctypes.data] * 4, [src.nbytes] * 4))
        b = cluster.add_node(dram="64MiB")
        cluster.wait_nodes(2)
        ok = c.batch_put_from([f"full/b{i}" for i in range(12)], [src.ctypes.data] * 12, [src.nbytes] * 12)
        assert all(ok)
        assert c.batch_exists([f"full/b{i}" for i in range(12)]) == 12
        assert c.batch_exists([f"full/a{i}" for i in range(4)]) == 4
    assert node_stats(a.address)["reserved"] == 0
    assert node_stats(b.address)["reserved"] == 0
