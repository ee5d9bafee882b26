"""A node bound to a wildcard address publishes one that clients can dial."""
import numpy as np

from hicache_mc.client import StoreClient


def test_a_wildcard_node_publishes_its_advertise_host_and_serves_through_it(cluster):
    cluster.start_master()
    # 127.0.0.2 reaches this host too (all of 127/8 is loopback), but only if the node says so
    cluster.add_node(args=("--host", "0.0.0.0", "--advertise-host", "127.0.0.2"))
    node, = cluster.wait_nodes(1)["nodes"]
    assert node["address"].startswith("tcp://127.0.0.2:")
    assert node["data_address"].startswith("127.0.0.2:")
    value = np.random.default_rng(0).integers(0, 256, 1 << 20, dtype=np.uint8).tobytes()
    with StoreClient(cluster.master, transport="tcp") as c:    # the stream port, as a remote host
        assert c.put("adv/1", value)
        assert c.get("adv/1") == value


def test_a_wildcard_node_without_advertise_host_publishes_its_route_to_the_master(cluster):
    cluster.start_master()
    cluster.add_node(args=("--host", "0.0.0.0"))
    node, = cluster.wait_nodes(1)["nodes"]
    # the master is on 127.0.0.1, so that is the route; never the undialable 0.0.0.0
    assert node["address"].startswith("tcp://127.0.0.1:")
    assert node["data_address"].startswith("127.0.0.1:")
