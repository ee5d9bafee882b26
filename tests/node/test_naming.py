"""A node's default name: unique among live nodes, and the same after a restart."""
import os
import socket

from hicache_mc.config import NodeConfig
from hicache_mc.node.naming import node_name

HOST = socket.gethostname()


def test_node_id_then_a_fixed_port_win():
    assert node_name(NodeConfig(node_id="gpu-3", port=7400), 41000) == ("gpu-3", None)
    assert node_name(NodeConfig(port=7400), 7400) == ("127.0.0.1:7400", None)
    assert node_name(NodeConfig(host="0.0.0.0", port=7400), 7400) == (f"{HOST}:7400", None)


def test_a_node_with_an_ssd_tier_is_named_by_its_folder(tmp_path):
    assert node_name(NodeConfig(ssd=1 << 30, ssd_dir=str(tmp_path / "nvme")), 41000) == \
        (f"{HOST}:{tmp_path / 'nvme'}", None)
    assert node_name(NodeConfig(ssd=1 << 30, data_dir=str(tmp_path)), 41000) == \
        (f"{HOST}:{tmp_path / 'ssd'}", None)


def test_one_node_per_data_dir_holds_its_name_the_next_one_gets_its_port(tmp_path):
    config = NodeConfig(data_dir=str(tmp_path / "data"))
    first, lock = node_name(config, 41000)
    assert first == f"{HOST}:{tmp_path / 'data'}" and lock is not None
    assert node_name(config, 41001) == ("127.0.0.1:41001", None)     # while the first runs
    os.close(lock)                                                    # the first stops
    again, lock = node_name(config, 41002)
    assert again == first and lock is not None                        # its restart
    os.close(lock)


def test_an_unwritable_data_dir_falls_back_to_the_port(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("")
    assert node_name(NodeConfig(data_dir=str(blocked / "data")), 41000) == ("127.0.0.1:41000", None)
