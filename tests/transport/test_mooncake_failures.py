"""Mooncake transport failure behaviour: dead and hung nodes, TE-less installs, bad settings."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

from te_env import te_cluster
from hicache_mc.client import StoreClient
from hicache_mc.config import ClientConfig, NodeConfig, load_config
from hicache_mc.errors import ConfigError
from hicache_mc.transport import mooncake as M

MiB = 1 << 20
needs_te = pytest.mark.skipif(not M.available(), reason="the Mooncake transfer engine is not installed")


def put_blobs(client, prefix: str, n: int, size: int) -> list[np.ndarray]:
    rng = np.random.default_rng(n)
    src = [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(n)]
    keys = [f"{prefix}/{i}" for i in range(n)]
    assert all(client.batch_put_from(keys, [a.ctypes.data for a in src], [size] * n))
    return src


@needs_te
def test_node_killed_mid_transfer_gives_misses_not_a_hang(tmp_path):
    cluster = te_cluster(tmp_path)
    try:
        cluster.start_master()
        node = cluster.add_node("256MiB")
        cluster.wait_nodes(1)
        n, timeout = 64, 1.0
        with StoreClient(cluster.master, transport="mooncake", timeout_s=timeout,
                         circuit_failures=10_000) as c:
            src = put_blobs(c, "kill", n, MiB)
            dst = np.zeros(n * MiB, np.uint8)
            c.register_buffer(dst.ctypes.data, dst.nbytes)
            keys = [f"kill/{i}" for i in range(n)]
            hits, took, stop = [], [], threading.Event()

            def reader():
                while not stop.is_set():
                    t0 = time.monotonic()
                    ok = c.batch_get_into(keys, [dst.ctypes.data + i * MiB for i in range(n)], [MiB] * n)
                    took.append(time.monotonic() - t0)
                    hits.append(sum(ok))
            t = threading.Thread(target=reader)
            t.start()
            while len(hits) < 3:               # reading for real before the kill
                time.sleep(0.01)
            node.kill()                        # SIGKILL, most likely inside a 64 MiB TE read
            time.sleep(2 * timeout + 1)
            stop.set()
            t.join(timeout + 5)
            assert not t.is_alive(), "a get hung after the node died"
            assert hits[0] == n and np.array_equal(dst[:MiB], src[0])
            assert hits[-1] == 0                               # misses once the node is gone
            assert max(took) < timeout + 1.0, f"slowest get {max(took):.2f}s"
    finally:
        cluster.stop()


@needs_te
def test_hung_node_bounds_the_te_call_and_the_get(tmp_path):
    cluster = te_cluster(tmp_path)
    try:
        cluster.start_master()
        node = cluster.add_node("64MiB")
        cluster.wait_nodes(1)
        with StoreClient(cluster.master, transport="mooncake", timeout_s=1.0,
                         circuit_failures=10_000) as c:
            put_blobs(c, "hang", 4, MiB)
            info = next(iter(c._nodes.values()))
            buf = np.zeros(MiB, np.uint8)
            node.pause()
            try:
                t0 = time.monotonic()
                with pytest.raises(M.TransferEngineError) as err:   # the TE alone would wait >= 5 s
                    c.te._move(info, True, [(buf.ctypes.data, 4096, MiB)], time.monotonic() + 0.5)
                assert err.value.abandoned and time.monotonic() - t0 < 1.0
                t0 = time.monotonic()
                assert c.batch_get_into(["hang/0"], [buf.ctypes.data], [MiB]) == [False]
                assert time.monotonic() - t0 < 1.5
            finally:
                node.kill(signal.SIGCONT)
            time.sleep(0.5)
            assert c.batch_get_into(["hang/1"], [buf.ctypes.data], [MiB]) == [True]
    finally:
        cluster.stop()


@needs_te
def test_an_abandoned_transfer_never_writes_into_caller_memory(tmp_path):
    """An object bigger than the staging buffer (SGLang's flat pages over 64 MiB) moves through
    a staging buffer of its own. Abandoned at the deadline by a hung node, its transfer finishes
    into that buffer once the node wakes, and the buffer is freed only then; the caller's memory,
    which the caller may have freed meanwhile, is never written."""
    cluster = te_cluster(tmp_path)
    try:
        cluster.start_master()
        node = cluster.add_node("64MiB")
        cluster.wait_nodes(1)
        with StoreClient(cluster.master, transport="mooncake", timeout_s=1.0, te_staging="1MiB",
                         circuit_failures=10_000) as c:
            put_blobs(c, "late", 24, 2 * MiB)          # random bytes in the node's DRAM
            info = next(iter(c._nodes.values()))
            buf = np.zeros(8 * MiB, np.uint8)         # 8 x the staging buffer
            node.pause()
            try:
                with pytest.raises(M.TransferEngineError) as err:
                    c.te._move(info, True, [(buf.ctypes.data, 0, buf.nbytes)],
                               time.monotonic() + 0.5)
                assert err.value.abandoned
            finally:
                node.kill(signal.SIGCONT)
            end = time.monotonic() + 30                # the engine finishes the read, somewhere
            while c.te.counters.get("late_released", 0) < 1 and not buf.any():
                assert time.monotonic() < end, "the abandoned transfer never finished"
                time.sleep(0.01)
            assert not buf.any(), "the engine wrote into caller memory after the call gave up"
            assert c.te.counters["late_released"] == 1
    finally:
        cluster.stop()


@needs_te
def test_workload_larger_than_dram_reads_back_through_te(tmp_path):
    # 48 MiB through 16 MiB of DRAM: SSD objects are staged back into DRAM under a lease; those
    # DRAM has no room for until the client releases others come in later rounds (LEASE_LATER)
    cluster = te_cluster(tmp_path)
    cluster.env["HICACHE_MC_SSD_SEGMENT"] = "8MiB"
    try:
        cluster.start_master()
        cluster.add_node("16MiB", args=("--ssd", "256MiB", "--ssd-dir", str(tmp_path / "ssd")))
        cluster.wait_nodes(1)
        n = 48
        rng = np.random.default_rng(48)
        src = [rng.integers(0, 256, MiB, dtype=np.uint8) for _ in range(n)]
        keys = [f"big/{i}" for i in range(n)]
        with StoreClient(cluster.master, transport="mooncake") as c:
            for k, a in zip(keys, src):
                # a put finding DRAM full of objects not yet written through fails; retry
                end = time.monotonic() + 10
                while not c.put(k, a) and time.monotonic() < end:
                    time.sleep(0.05)
            dst = [np.zeros(MiB, np.uint8) for _ in range(n)]
            got = c.batch_get_into(keys, [a.ctypes.data for a in dst], [MiB] * n)
            assert got == [True] * n
            assert all(np.array_equal(s, d) for s, d in zip(src, dst))
            assert c.te.counters["staged"] > n
    finally:
        cluster.stop()


FALLBACK = textwrap.dedent("""
    import logging, sys
    sys.modules["mooncake"] = None          # an install without the Mooncake wheel
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="LOG %(name)s: %(message)s")
    import numpy as np
    from hicache_mc.client import StoreClient
    with StoreClient(sys.argv[1], transport=sys.argv[2]) as c:
        if sys.argv[2] == "auto":
            c.host = "another-host"         # the node is remote as far as this client knows
        a = np.arange(1 << 20, dtype=np.uint8)
        c.register_buffer(a.ctypes.data, a.nbytes)
        out = np.zeros_like(a)
        ok = []
        for i in range(3):
            ok += c.batch_put_from([f"fb/{sys.argv[2]}/{i}"], [a.ctypes.data], [a.nbytes])
            ok += c.batch_get_into([f"fb/{sys.argv[2]}/{i}"], [out.ctypes.data], [a.nbytes])
        node = next(iter(c._nodes.values()))
        print("RESULT", all(ok) and bool((a == out).all()), c.transport_for(node).name,
              bool(node.te_address))
""")


@pytest.mark.parametrize("mode", ["mooncake", "auto"])
def test_te_less_install_falls_back_to_tcp_with_one_log_line(tmp_path, mode):
    cluster = te_cluster(tmp_path)
    if not M.available():
        cluster.env.pop("HICACHE_MC_TE_PROTOCOL")     # the node cannot run a TE either
    try:
        cluster.start_serve("64MiB")
        out = subprocess.run([sys.executable, "-c", FALLBACK, cluster.master, mode],
                             capture_output=True, text=True, timeout=60,
                             env=dict(os.environ, PYTHONPATH=os.getcwd())).stdout
        assert "RESULT True tcp" in out, out
        lines = [ln for ln in out.splitlines() if ln.startswith("LOG") and "mooncake" in ln.lower()]
        if M.available():           # the node publishes a TE address, so the client tries once
            assert len(lines) == 1, out
            assert "using tcp" in lines[0] and "pip install mooncake-transfer-engine" in lines[0]
    finally:
        cluster.stop()


@needs_te
def test_auto_picks_mooncake_for_a_remote_node_and_shm_for_a_local_one(te_store):
    with StoreClient(te_store.master) as c:
        put_blobs(c, "auto", 1, 4096)
        node = next(iter(c._nodes.values()))
        assert node.te_address and c.transport_for(node) is c.shm
        c.host = "another-host"
        assert c.transport_for(node) is c.te
        put_blobs(c, "auto2", 2, 4096)
        assert c.te.counters["staged"] == 2


@needs_te
def test_rdma_without_an_rdma_device_fails_node_start(tmp_path):
    if os.path.isdir("/sys/class/infiniband") and os.listdir("/sys/class/infiniband"):
        pytest.skip("this machine has RDMA devices")
    cluster = te_cluster(tmp_path)
    cluster.env["HICACHE_MC_TE_PROTOCOL"] = "rdma"
    try:
        cluster.start_master()
        node = cluster.add_node("16MiB")
        assert node.p.wait(30) == 1
        assert "no RDMA device found" in node.log()
    finally:
        cluster.stop()


def test_settings():
    assert load_config(ClientConfig, env={}, transport="mooncake").transport == "mooncake"
    assert load_config(NodeConfig, env={"HICACHE_MC_TE_PROTOCOL": "tcp"}).te_protocol == "tcp"
    assert NodeConfig().te_protocol == "" and ClientConfig().te_metadata == "P2PHANDSHAKE"
    for cls in (ClientConfig, NodeConfig):
        with pytest.raises(ConfigError, match="te_protocol"):
            load_config(cls, env={}, te_protocol="udp")
    with pytest.raises(ConfigError, match="te_staging"):
        load_config(ClientConfig, env={}, te_staging="4KiB")


def test_te_device_per_rank_map(monkeypatch):
    assert M.resolve_device("mlx5_0,mlx5_1") == "mlx5_0,mlx5_1"
    table = '{"0": "mlx5_0", "1": "mlx5_1"}'
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert M.resolve_device(table) == "mlx5_1"
    assert M.resolve_device('{"*": "mlx5_2"}') == "mlx5_2"
    monkeypatch.setenv("LOCAL_RANK", "7")
    with pytest.raises(M.TransferEngineError, match="rank 7"):
        M.resolve_device(table)
    assert M.route_address("tcp://127.0.0.1:7370") == "127.0.0.1"
