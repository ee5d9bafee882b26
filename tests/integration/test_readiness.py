"""Readiness of real processes: serve's "ready" line, ``hicache-mc wait``, and the metrics
ports' /health and /ready."""
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

import hicache_mc
from hicache_mc.client import StoreClient
from procs import free_port


def status(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def until(port: int, path: str, code: int, text: str = "", timeout_s: float = 60) -> str:
    """The body of the first ``code`` answer of ``path`` that holds ``text`` (generous: the
    machine may be slow)."""
    end = time.monotonic() + timeout_s
    while True:
        try:
            got = status(port, path)
            if got[0] == code and text in got[1]:
                return got[1]
        except OSError as exc:      # not listening yet
            got = exc
        if time.monotonic() > end:
            raise AssertionError(f"{path} on {port} never answered {code}; last: {got}")
        time.sleep(0.2)


def test_health_and_ready_follow_the_cluster(cluster):
    mport, nport = free_port(), free_port()
    cluster.env.update(HICACHE_MC_MASTER_METRICS_PORT=str(mport),
                       HICACHE_MC_NODE_METRICS_PORT=str(nport))
    cluster.start_master()
    until(mport, "/health", 200)
    until(mport, "/ready", 503, "not ready: no live storage node\n")
    until(mport, "/metrics", 200, f'hicache_mc_build_info{{version="{hicache_mc.__version__}"}} 1.0\n')
    node = cluster.add_node(dram="32MiB")
    until(nport, "/ready", 200)                    # the node registered
    until(mport, "/ready", 200)                    # the master has a live node
    cluster.master_proc.stop()
    until(nport, "/ready", 503, f"not ready: not registered with the master at {cluster.master}")
    assert status(nport, "/health")[0] == 200      # alive all the same
    cluster.start_master()                         # it registers again
    until(nport, "/ready", 200)
    node.stop()
    until(mport, "/ready", 503)                    # its heartbeats stopped


def cli(*args, **kw) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HICACHE_MC_")}
    return subprocess.Popen([sys.executable, "-m", "hicache_mc.cli", *args], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)


def test_serve_logs_ready_once_its_node_takes_writes(cluster):
    serve = cluster.start_serve("32MiB", wait=False).serve_proc
    end = time.monotonic() + 120
    while "hicache-mc ready: " not in serve.log():
        assert time.monotonic() < end and serve.alive, cluster.logs()
        time.sleep(0.1)
    with StoreClient(cluster.master) as c:              # nothing but the line was waited for
        assert c.put("ready/0", b"x" * 4096)
    ready = [line for line in serve.log().splitlines() if "ready" in line.split(": ", 1)[-1]]
    assert len(ready) == 1 and cluster.master in ready[0], ready


def test_wait_times_out_in_one_line_then_returns_once_the_cluster_takes_writes(cluster):
    p = cli("wait", "--master", f"127.0.0.1:{cluster.port}", "--timeout", "1")
    out, err = p.communicate(timeout=120)
    assert p.returncode == 1 and out == ""
    assert err.startswith("hicache-mc: not ready after 1 s: no answer from the master at") and \
        err.count("\n") == 1, err
    cluster.start_master()
    p = cli("wait", "--master", cluster.master, "--nodes", "2", "--timeout", "1.5")
    out, err = p.communicate(timeout=120)
    assert p.returncode == 1 and err.strip().endswith("0 of 2 storage nodes live"), err
    p = cli("wait", "--master", cluster.master, "--nodes", "2", "--timeout", "300")
    cluster.add_node(dram="32MiB")
    cluster.add_node(dram="32MiB")
    out, err = p.communicate(timeout=320)
    assert p.returncode == 0, err
    assert out.startswith("ready: ") and "2 nodes live" in out and "a probe put succeeded" in out
    cluster.wait_keys(0)                               # the probe object is gone again
    cluster.wait_objects(0)


def test_a_lost_node_is_named_by_stats_and_ready_is_degraded_below_expect_nodes(cluster):
    mport = free_port()
    cluster.env.update(HICACHE_MC_MASTER_METRICS_PORT=str(mport), HICACHE_MC_EXPECT_NODES="2")
    cluster.start_master()
    cluster.add_node(dram="32MiB")
    until(mport, "/ready", 503, "degraded: 1 of 2 storage nodes live (expect_nodes)\n")
    second = cluster.add_node(dram="32MiB")
    until(mport, "/ready", 200)
    lost = next(n["node_id"] for n in cluster.wait_nodes(2)["nodes"] if n["address"] == second.address)
    second.kill()
    until(mport, "/ready", 503, "degraded: 1 of 2 storage nodes live (expect_nodes)\n")
    p = cli("stats", "--master", cluster.master)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    said = [line for line in out.splitlines() if line.startswith("LOST ")]
    assert len(said) == 1 and said[0].startswith(f"LOST {lost} ({second.address}): missed its "
                                                 "heartbeats "), out
    assert "DEGRADED: 1 of 2 storage nodes live (expect_nodes)" in out
    cluster.add_node(dram="32MiB", port=second.port)     # the same name: it registers again
    until(mport, "/ready", 200)
    assert cluster.stats()["lost"] == []


def test_stats_piped_into_head_ends_without_a_traceback(cluster):
    cluster.start_master()
    cluster.add_node(dram="32MiB")
    cluster.wait_nodes(1)
    env = {k: v for k, v in os.environ.items() if not k.startswith("HICACHE_MC_")}
    # --watch prints again after head has gone: the write meets a closed pipe
    r = subprocess.run(f"{sys.executable} -m hicache_mc.cli stats --watch 0.1 --master "
                       f"{cluster.master} | head -3", shell=True, env=env, capture_output=True,
                       text=True, timeout=120)
    assert "master " in r.stdout and r.stderr == "", r.stderr


def test_waits_probe_is_cleared_not_counted_as_an_eviction(cluster):
    cluster.start_master()
    cluster.add_node(dram="32MiB")
    cluster.wait_nodes(1)
    p = cli("wait", "--master", cluster.master, "--timeout", "60")
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0 and "a probe put succeeded" in out, err
    end = time.monotonic() + 10
    while cluster.stats()["cleared"] < 1:       # the node's report reaches the master
        assert time.monotonic() < end
        time.sleep(0.05)
    assert cluster.stats()["evicted"] == 0


def test_wait_gives_up_at_once_when_the_store_it_waits_for_has_exited(tmp_path):
    """The examples waited 300 s for a serve that had exited at once (its metrics port taken)."""
    import socket
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = free_port()
    serve = cli("serve", "--port", str(port), "--dram", "16MiB", "--metrics-port",
                str(taken.getsockname()[1]), "--publish-port", "0")
    try:
        t0 = time.monotonic()
        p = cli("wait", "--master", f"127.0.0.1:{port}", "--timeout", "300", "--pid", str(serve.pid))
        out, err = p.communicate(timeout=120)
        assert p.returncode == 1 and time.monotonic() - t0 < 60
        assert err.startswith(f"hicache-mc: not ready: process {serve.pid} ended"), err
        assert serve.wait(30) == 2 and "cannot listen" in serve.stderr.read()
    finally:
        if serve.poll() is None:
            serve.kill()
        taken.close()
