"""The SSD tier with real node processes and real files in a temporary folder."""
import os
import random
import resource
import subprocess
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

from hicache_mc.client import StoreClient
from hicache_mc.node.ssd import scan_segment
from procs import free_port

MiB = 1 << 20


def blob(key: str, size: int = MiB) -> bytes:
    seed = int.from_bytes(key.encode()[-8:].rjust(8, b"\0"), "little") ^ len(key)
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


def ssd_node(cluster, ssd_dir, dram="16MiB", ssd="256MiB", durability="async", port=None,
             segment="8MiB", preexec=None):
    env_args = ("--ssd", ssd, "--ssd-dir", str(ssd_dir), "--durability", durability)
    cluster.env["HICACHE_MC_SSD_SEGMENT"] = segment
    node = cluster.add_node(dram=dram, port=port, args=env_args, preexec=preexec)
    return node


def node_stats(cluster):
    return cluster.stats()["nodes"][0]


def wait_for(pred, timeout_s=20.0, what="condition"):
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if pred():
            return
        time.sleep(0.05)
    raise TimeoutError(what)


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_workload_larger_than_dram_stays_readable(cluster, tmp_path, transport):
    cluster.start_master()
    ssd_node(cluster, tmp_path / "ssd")
    cluster.wait_nodes(1)
    keys = [f"big/{transport}/{i:03d}" for i in range(48)]          # 48 MiB through 16 MiB of DRAM
    with StoreClient(cluster.master, transport=transport) as c:
        for k in keys:
            assert c.put(k, blob(k))
        # every object on disk (the async writer may lag under load): then DRAM copies can be
        # dropped to make room, and a read of an SSD-only object stages it back into DRAM
        wait_for(lambda: node_stats(cluster).get("ssd_objects", 0) == len(keys), what="all on SSD")
        for k in keys:
            assert c.get(k) == blob(k), k
        # the master's copy of the node's counters comes with heartbeats: wait for one sent after the reads
        wait_for(lambda: node_stats(cluster)["reads"] >= len(keys), what="stats")
        st = node_stats(cluster)
        assert st["used"] <= 16 * MiB and st["ssd_objects"] >= len(keys) - 16
        assert st["ssd_promotions"] > 0           # reads stage SSD objects back into DRAM
        # one get of three times the DRAM tier: the node stages what fits, the client reads
        # and releases it, and asks for the rest in further rounds
        dst = [np.zeros(MiB, np.uint8) for _ in keys]
        assert c.batch_get_into(keys, [d.ctypes.data for d in dst], [MiB] * len(keys)) == [True] * len(keys)
        assert all(d.tobytes() == blob(k) for k, d in zip(keys, dst))


def test_sigkill_restart_keeps_acknowledged_objects(cluster, tmp_path):
    cluster.start_master()
    port = free_port()
    node = ssd_node(cluster, tmp_path / "ssd", durability="sync", port=port)
    cluster.wait_nodes(1)
    acked, stop = [], threading.Event()

    def writer():
        with StoreClient(cluster.master, timeout_s=2.0, circuit_open_s=0.1) as c:
            i = 0
            while not stop.is_set():
                k = f"kill/{i:04d}"
                if c.put(k, blob(k, 256 << 10)):
                    acked.append(k)
                i += 1

    t = threading.Thread(target=writer)
    t.start()
    wait_for(lambda: len(acked) >= 40, what="writes")
    node.kill()                                                  # mid-stream
    stop.set()
    t.join()
    assert len(acked) >= 40
    cluster.nodes.clear()
    cluster.wait_nodes(0)                      # the master forgot the old node and its keys
    ssd_node(cluster, tmp_path / "ssd", durability="sync", port=port)
    cluster.wait_nodes(1)
    with StoreClient(cluster.master) as c:
        wait_for(lambda: c.batch_exists(acked) == len(acked), what="re-registration")
        for k in acked:
            assert c.get(k) == blob(k, 256 << 10), k


def _segments(d):
    return sorted(os.path.join(d, n) for n in os.listdir(d) if n.endswith(".dat"))


def test_torn_and_corrupted_records_are_never_served(cluster, tmp_path):
    ssd_dir = tmp_path / "ssd"
    cluster.start_master()
    port = free_port()
    node = ssd_node(cluster, ssd_dir, durability="sync", port=port, segment="2MiB")
    cluster.wait_nodes(1)
    keys = [f"tc/{i:03d}" for i in range(24)]
    with StoreClient(cluster.master) as c:
        for k in keys:
            assert c.put(k, blob(k, 300_000))
    node.kill()
    segs = _segments(ssd_dir)
    assert len(segs) >= 3
    # flip bytes inside the value of the first record of the first segment
    first = next(scan_segment(segs[0], 0))
    with open(segs[0], "r+b") as f:
        f.seek(first[2].offset + 1000)
        f.write(b"\xde\xad\xbe\xef")
    flipped = first[1]
    # tear the last record of the last segment
    last = list(scan_segment(segs[-1], 0))[-1]
    with open(segs[-1], "r+b") as f:
        f.truncate(last[2].offset + 10)
    torn = last[1]
    cluster.nodes.clear()
    cluster.wait_nodes(0)                      # the master forgot the old node and its keys
    ssd_node(cluster, ssd_dir, durability="sync", port=port, segment="2MiB")
    cluster.wait_nodes(1)
    with StoreClient(cluster.master) as c, StoreClient(cluster.master, transport="tcp") as t:
        wait_for(lambda: c.exists(keys[5]), what="re-registration")
        assert not c.exists(torn)                    # the torn record was never indexed
        for client in (c, t):
            assert client.get(flipped) is None       # damaged value: a miss, never the bytes
        for k in keys:
            if k not in (flipped, torn):
                assert t.get(k) == blob(k, 300_000), k
        # dropped once detected, and the master told once its tombstone is written
        wait_for(lambda: not c.exists(flipped), what="the damaged record reported gone")


def test_master_restart_with_ssd_only_data(cluster, tmp_path):
    cluster.start_master()
    ssd_node(cluster, tmp_path / "ssd", dram="8MiB", durability="sync")
    cluster.wait_nodes(1)
    keys = [f"mo/{i}" for i in range(30)]
    with StoreClient(cluster.master, timeout_s=1.0, circuit_open_s=0.1) as c:
        for k in keys:
            assert c.put(k, blob(k, 512 << 10))
        wait_for(lambda: node_stats(cluster)["objects"] < len(keys), what="demotion")
        cluster.master_proc.kill()
        cluster.start_master()
        cluster.wait_keys(len(keys), timeout_s=30)
        wait_for(lambda: c.get(keys[0]) is not None, what="client reconnect")
        for k in keys:
            assert c.get(k) == blob(k, 512 << 10)


def _limit_file_size():
    # files the node writes stop growing at 12 MiB: the DRAM segment (8 MiB) fits, each SSD
    # segment file fills after ~23 objects of 512 KiB and then fails with EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (12 * MiB, 12 * MiB))


@pytest.fixture
def small_disk(tmp_path):
    """(folder, preexec): a 6 MiB tmpfs where we may mount one, else a per-file size limit."""
    d = tmp_path / "disk"
    d.mkdir()
    if os.geteuid() == 0 and subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(d)],
                                            capture_output=True).returncode == 0:
        yield d, None
        subprocess.run(["umount", "-l", str(d)], check=False)
    else:
        yield d, _limit_file_size


def _http(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.read().decode()


def test_full_disk_drops_instead_of_demoting_and_keeps_serving(cluster, small_disk):
    folder, preexec = small_disk
    cluster.start_master()
    node = ssd_node(cluster, folder / "ssd", dram="8MiB", durability="async", segment="64MiB",
                    preexec=preexec)
    cluster.wait_nodes(1)
    keys = [f"full/{i}" for i in range(50)]
    with StoreClient(cluster.master) as c:
        for k in keys:
            assert c.put(k, blob(k, 512 << 10))     # async: acknowledged from DRAM
        wait_for(lambda: node_stats(cluster).get("ssd_write_errors", 0) >= 1, what="disk error")
        # visible: in the node's stats as the master shows them, its metrics and its /ready
        wait_for(lambda: "ssd tier unusable" in node_stats(cluster).get("degraded", ""),
                 what="degraded in stats")
        url = node_stats(cluster)["metrics_url"]
        wait_for(lambda: any(line.startswith("hicache_mc_node_degraded{") and line.endswith(" 1.0")
                             for line in _http(url).splitlines()), what="degraded in the metrics")
        with pytest.raises(urllib.error.HTTPError) as ready:
            _http(url.replace("/metrics", "/ready"))
        assert ready.value.code == 503 and b"ssd tier unusable" in ready.value.read()
        assert c.put("full/after", b"still serving")  # DRAM drops like a cache instead
        assert c.get("full/after") == b"still serving"
        survivors = [k for k in keys if c.exists(k)]
        assert survivors
        for k in survivors:                         # whatever is still indexed is right
            got = c.get(k)
            assert got is None or got == blob(k, 512 << 10)
    assert node.alive
    assert node.log().count("ssd tier unusable") == 1     # logged once, clearly


def test_sync_puts_fail_per_key_on_full_disk(cluster, small_disk):
    folder, preexec = small_disk
    cluster.start_master()
    node = ssd_node(cluster, folder / "ssd", dram="8MiB", durability="sync", segment="64MiB",
                    preexec=preexec)
    cluster.wait_nodes(1)
    with StoreClient(cluster.master) as c:
        results = [c.put(f"sync/{i}", blob(f"sync/{i}", 512 << 10)) for i in range(40)]
        assert results[0] and not all(results)      # the first fit, some later ones could not
        if preexec is None:                         # a really full disk: nothing fits after
            first_fail = results.index(False)
            assert not any(results[first_fail:])
        for i, ok in enumerate(results):
            assert c.exists(f"sync/{i}") == ok      # a failed put leaves nothing behind
            if ok:
                assert c.get(f"sync/{i}") == blob(f"sync/{i}", 512 << 10)
    assert node.alive


def test_compaction_under_concurrent_reads(cluster, tmp_path):
    cluster.start_master()
    ssd_node(cluster, tmp_path / "ssd", dram="4MiB", ssd="24MiB", durability="sync", segment="2MiB")
    cluster.wait_nodes(1)
    size = 200_000
    errors = []
    stop = threading.Event()
    with StoreClient(cluster.master, transport="tcp") as c:
        for i in range(60):
            assert c.put(f"cp/{i}", blob(f"cp/{i}", size))

        def reader():
            rng = random.Random(1)
            while not stop.is_set():
                k = f"cp/{rng.randrange(200)}"
                got = c.get(k)
                if got is not None and got != blob(k, size):
                    errors.append(k)
        threads = [threading.Thread(target=reader) for _ in range(2)]
        for t in threads:
            t.start()
        for i in range(60, 200):                        # overflow the SSD: eviction + compaction
            c.put(f"cp/{i}", blob(f"cp/{i}", size))
        c.clear("cp/1")                                 # dead records everywhere
        wait_for(lambda: node_stats(cluster).get("ssd_compactions", 0) > 0, what="compaction")
        time.sleep(1.0)
        stop.set()
        for t in threads:
            t.join()
        assert not errors
        for i in range(200):
            got = c.get(f"cp/{i}")
            assert got is None or got == blob(f"cp/{i}", size)
        st = node_stats(cluster)
        assert st["ssd_used"] <= 24 * MiB
