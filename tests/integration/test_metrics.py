"""Prometheus endpoints of a real master and node, and the token read from a file."""
import socket
import time
import urllib.request

import pytest

import hicache_mc
from hicache_mc.client import StoreClient
from procs import Cluster, Proc, free_port


def get_text(port: int) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()


def scrape(port: int) -> dict:
    out = {}
    for line in get_text(port).splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def wait_metric(port, name, pred, timeout_s=10):
    end, m = time.monotonic() + timeout_s, {}
    while time.monotonic() < end:
        try:
            m = scrape(port)
        except OSError:         # not listening yet
            m = {}
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
        assert n['hicache_mc_node_request_seconds_bucket{le="+Inf",type="CommitRequest"}'] == 5
        for scraped in (m, n):          # the process's own metrics, and the version
            assert scraped["process_resident_memory_bytes"] > 0 and "process_cpu_seconds_total" in scraped
            assert any(k.startswith("python_info{") for k in scraped)
            assert scraped[f'hicache_mc_build_info{{version="{hicache_mc.__version__}"}}'] == 1
    finally:
        cl.stop()


def test_a_node_serves_metrics_on_a_free_port_by_default_and_says_where(cluster):
    cluster.start_master()
    cluster.add_node(dram="32MiB")
    cluster.wait_nodes(1)
    end = time.monotonic() + 10
    while "metrics_url" not in (node := cluster.stats()["nodes"][0]):     # from its heartbeats
        assert time.monotonic() < end, node
        time.sleep(0.1)
    assert node["metrics_url"].startswith("http://127.0.0.1:")
    port = int(node["metrics_url"].rsplit(":", 1)[1].split("/")[0])
    m = wait_metric(port, f'hicache_mc_node_dram_capacity_bytes{{node="{node["node_id"]}"}}',
                    lambda v: v == 32 << 20)
    assert m["process_open_fds"] > 0


def test_a_restarted_node_keeps_its_name_and_so_its_series(cluster, tmp_path):
    """No node_id, no port: the name comes from the node's data folder, not its random port."""
    cluster.env["HICACHE_MC_DATA_DIR"] = str(tmp_path / "data")
    cluster.start_master()
    names = []
    for run in range(2):
        node = Proc(["node", "--master", cluster.master, "--dram", "32MiB"],
                    str(tmp_path / f"node-run{run}.log"), cluster.env).start()
        cluster.nodes.append(node)
        end = time.monotonic() + 20
        while not (nodes := (cluster.stats() or {}).get("nodes")) or \
                (names and nodes[0]["address"] == names[-1][1]):     # the old one's record
            assert time.monotonic() < end, cluster.logs()
            time.sleep(0.1)
        names.append((nodes[0]["node_id"], nodes[0]["address"]))
        node.stop()
    assert names[0][0] == names[1][0] == f"{socket.gethostname()}:{tmp_path / 'data'}"
    assert names[0][1] != names[1][1]                   # on another port


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


def test_a_label_value_cannot_break_the_scrape_or_inject_samples(tmp_path):
    """A namespace comes from a client's key: a newline or a quote in it stays inside its label."""
    from prometheus_client.parser import text_string_to_metric_families
    mport = free_port()
    cl = Cluster(tmp_path)
    cl.env["HICACHE_MC_MASTER_METRICS_PORT"] = str(mport)
    cl.start_master()
    evil = 'ns\nhicache_mc_master_keys 999\n"} 7\\'
    try:
        wait_metric(mport, "hicache_mc_master_keys", lambda v: v == 0, 30)    # the master is up
        with StoreClient(cl.master) as c:
            assert c.get(f"{evil}/0/k") is None
        end = time.monotonic() + 10
        while "hicache_mc_lookup_misses_total{" not in (text := get_text(mport)):
            assert time.monotonic() < end, "the miss never showed in the scrape"
            time.sleep(0.2)
        samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
        assert [s.value for s in samples if s.name == "hicache_mc_master_keys"] == [0]
        assert [s.value for s in samples if s.name == "hicache_mc_lookup_misses_total"
                and s.labels == {"namespace": evil}] == [1]
        assert sum(line.startswith("hicache_mc_master_keys ") for line in text.splitlines()) == 1
    finally:
        cl.stop()
