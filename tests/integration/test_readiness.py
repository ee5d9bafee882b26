"""Readiness of real processes: the metrics ports' /health and /ready."""
import time
import urllib.error
import urllib.request

import hicache_mc
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
    until(mport, "/metrics", 200, f'hicache_mc_build_info{{version="{hicache_mc.__version__}"}} 1\n')
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
