"""Prometheus endpoints of a real master and node, and the token read from a file."""
import time
import urllib.request

import pytest

from hicache_mc.client import StoreClient
from procs import Cluster, free_port


def scrape(port: int) -> dict:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def wait_metric(port, name, pred, timeout_s=10):
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        m = scrape(port)
        if name in m and pred(m[name]):
            return m
        time.sleep(0.2)
    raise AssertionError(f"{name} never satisfied the condition; last scrape: {m.get(name)}")


def test_metrics_endpoints_follow_the_traffic(tmp_path):
    mport, nport = free_port(), free_port()
    cl = Cluster(tmp_path)
    cl.env.update(HICACHE_MC_MASTER_METRICS_PORT=str(mport), HICACHE_MC_NODE_METRICS_PORT=str(nport))
    cl.start_master()
    cl.add_node()
    try:
        cl.wait_nodes(1)
        with StoreClient(cl.master) as c:
            for i in range(5):
                assert c.put(f"tenantA-ns/{i}/k", b"x" * 1000)
            assert c.get("tenantA-ns/0/k") == b"x" * 1000
            assert c.get("other-ns/9/k") is None
        m = wait_metric(mport, "hicache_mc_master_keys", lambda v: v == 5)
        assert m['hicache_mc_lookup_hits_total{namespace="tenantA-ns"}'] >= 1
        assert m['hicache_mc_lookup_misses_total{namespace="other-ns"}'] == 1
        assert m["hicache_mc_master_nodes"] == 1
        assert m['hicache_mc_master_request_seconds_count{type="PlaceRequest"}'] == 5
        assert m['hicache_mc_master_request_seconds_count{type="CommittedRequest"}'] >= 5
        node_id = next(k for k in m if k.startswith("hicache_mc_node_heartbeat_age_seconds"))
        assert m[node_id] < 5
        n = wait_metric(nport, next(k for k in scrape(nport) if k.startswith("hicache_mc_node_objects{")),
                        lambda v: v == 5)
        assert any(k.startswith("hicache_mc_node_bytes_in_total") and v == 5000 for k, v in n.items())
        assert any(k.startswith("hicache_mc_node_dram_capacity_bytes") and v == 256 << 20 for k, v in n.items())
        assert n['hicache_mc_node_request_seconds_bucket{type="CommitRequest",le="+Inf"}'] == 5
    finally:
        cl.stop()


def test_token_from_file_and_a_wrong_token_refused(tmp_path):
    secret = tmp_path / "token"
    secret.write_text("from-a-file\n")
    mport = free_port()
    cl = Cluster(tmp_path)
    cl.env.update(HICACHE_MC_TOKEN=f"@{secret}", HICACHE_MC_MASTER_METRICS_PORT=str(mport))
    cl.token = "from-a-file"
    cl.start_master()
    cl.add_node()
    try:
        cl.wait_nodes(1)
        with StoreClient(cl.master, token="from-a-file") as c:
            assert c.put("t/a", b"1") and c.get("t/a") == b"1"
        with StoreClient(cl.master, token="wrong", timeout_s=5) as bad:
            t0 = time.monotonic()
            assert bad.get("t/a") is None
            assert time.monotonic() - t0 < 3, "a wrong token should fail the handshake, not wait"
        assert wait_metric(mport, "hicache_mc_master_keys", lambda v: v == 1)
    finally:
        cl.stop()


def test_binding_beyond_loopback_without_token_warns():
    # decided without binding anything beyond loopback (tests stay on 127.0.0.1)
    from hicache_mc.rpc import exposed_without_token
    assert exposed_without_token("tcp://0.0.0.0:7370", "")
    assert exposed_without_token("tcp://10.1.2.3:7370", "")
    assert exposed_without_token("tcp://eth0:7370", "")
    assert not exposed_without_token("tcp://0.0.0.0:7370", "secret")
    assert not exposed_without_token("tcp://127.0.0.1:7370", "")
    assert not exposed_without_token("tcp://127.0.0.2:7370", "")
    assert not exposed_without_token("tcp://[::1]:7370", "")
    assert not exposed_without_token("tcp://localhost:7370", "")


def test_unknown_metrics_path_is_404(tmp_path):
    mport = free_port()
    cl = Cluster(tmp_path)
    cl.env["HICACHE_MC_MASTER_METRICS_PORT"] = str(mport)
    cl.start_master()
    try:
        end = time.monotonic() + 10
        while True:
            try:
                scrape(mport)
                break
            except OSError:
                assert time.monotonic() < end
                time.sleep(0.1)
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(f"http://127.0.0.1:{mport}/secret", timeout=5)
    finally:
        cl.stop()
