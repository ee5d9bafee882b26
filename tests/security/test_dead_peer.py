"""A node killed under a client: its keys are misses at once, not after the call's deadline,
and repeated failures open the circuit."""
from __future__ import annotations

import signal
import time

import numpy as np

from hicache_mc.client import StoreClient
from peers import TOKEN
from procs import Cluster

KiB = 1 << 10


def test_a_killed_remote_node_is_a_miss_within_a_second(tmp_path):
    # the master keeps the dead node listed for 10 s: the client finds out for itself
    c = Cluster(tmp_path, heartbeat_s=1.0, liveness=10, token=TOKEN)
    c.start_master()
    node = c.add_node(dram="64MiB")
    c.wait_nodes(1)
    try:
        src = np.random.default_rng(3).integers(0, 256, 64 * KiB, dtype=np.uint8)
        dst = np.zeros_like(src)
        keys = [f"dead/{i}" for i in range(16)]
        with StoreClient(c.master, token=TOKEN, transport="tcp", timeout_s=5.0) as s:
            assert all(s.batch_put_from(keys, [src.ctypes.data] * 16, [src.nbytes] * 16))
            assert all(s.batch_get_into(keys, [dst.ctypes.data] * 16, [dst.nbytes] * 16))
            node_id = c.stats()["nodes"][0]["node_id"]
            node.kill(signal.SIGKILL)
            node.p.wait(5)
            took = []
            for _ in range(4):
                t0 = time.monotonic()
                got = s.batch_get_into(keys, [dst.ctypes.data] * 16, [dst.nbytes] * 16)
                took.append(time.monotonic() - t0)
                assert got == [False] * 16
            assert max(took) < 1.0, f"gets after the node died took {took}"
            assert s.node_circuits.of(node_id).opens >= 1, "three failures in a row did not open its circuit"
            assert len(c.stats()["nodes"]) == 1, "the master expired the node already: test proves nothing"
    finally:
        c.stop()
