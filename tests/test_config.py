import json

import pytest

from hicache_mc.config import (ClientConfig, ConductorServerConfig, MasterConfig, NodeConfig, load_config,
                               parse_size)
from hicache_mc.errors import ConfigError


@pytest.mark.parametrize("text,value", [("4GiB", 4 << 30), ("512MiB", 512 << 20), ("64KB", 64000),
                                        ("1.5GiB", 3 << 29), (4096, 4096), ("4096", 4096)])
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("bad", ["4XB", "-1", "", "GiB", True, -5])
def test_parse_size_rejects(bad):
    with pytest.raises(ConfigError, match="dram"):
        parse_size(bad, "dram")


def test_precedence_defaults_file_env_explicit(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('[node]\ndram = "1GiB"\nlease_s = 3.0\nport = 7000\n')
    env = {"HICACHE_MC_LEASE_S": "4.5", "HICACHE_MC_PORT": "7001"}
    cfg = load_config(NodeConfig, file=str(f), env=env, section="node", port=7002)
    assert cfg.dram == 1 << 30          # file over default
    assert cfg.lease_s == 4.5           # env over file
    assert cfg.port == 7002             # explicit over env
    assert cfg.high_watermark == NodeConfig().high_watermark


def test_json_file(tmp_path):
    f = tmp_path / "c.json"
    f.write_text(json.dumps({"timeout_s": 1.5, "transport": "tcp"}))
    cfg = load_config(ClientConfig, file=str(f), env={})
    assert cfg.timeout_s == 1.5 and cfg.transport == "tcp"


def test_unknown_keys_and_bad_values_name_the_key(tmp_path):
    with pytest.raises(ConfigError, match="bogus"):
        load_config(ClientConfig, env={}, bogus=1)
    f = tmp_path / "c.toml"
    f.write_text("colour = 3\n")
    with pytest.raises(ConfigError, match="colour"):
        load_config(MasterConfig, file=str(f), env={})
    with pytest.raises(ConfigError, match="timeout_s"):
        load_config(ClientConfig, env={"HICACHE_MC_TIMEOUT_S": "soon"})
    with pytest.raises(ConfigError, match="transport"):
        load_config(ClientConfig, env={}, transport="carrier-pigeon")
    with pytest.raises(ConfigError, match="port"):
        load_config(MasterConfig, env={}, port=70000)
    with pytest.raises(ConfigError, match="watermark"):
        load_config(NodeConfig, env={}, low_watermark=0.99, high_watermark=0.5)
    with pytest.raises(ConfigError, match="verify_checksums"):
        load_config(ClientConfig, env={}, verify_checksums="maybe")


def test_configs_are_frozen():
    cfg = MasterConfig()
    with pytest.raises(Exception):
        cfg.port = 1


def test_role_specific_env_wins():
    env = {"HICACHE_MC_PORT": "7001", "HICACHE_MC_NODE_PORT": "7002"}
    assert load_config(NodeConfig, env=env, section="node").port == 7002
    assert load_config(MasterConfig, env=env, section="master").port == 7001


def test_metrics_are_on_by_default_on_loopback():
    """The master on 9370; a node on any free port (several share a host); -1 turns them off."""
    assert (MasterConfig().metrics_host, MasterConfig().metrics_port) == ("127.0.0.1", 9370)
    assert (NodeConfig().metrics_host, NodeConfig().metrics_port) == ("127.0.0.1", 0)
    for cls in (MasterConfig, NodeConfig):
        assert load_config(cls, env={"HICACHE_MC_METRICS_PORT": "-1"}).metrics_port == -1
        with pytest.raises(ConfigError, match="metrics_port: expected -1..65535, got -2"):
            load_config(cls, env={}, metrics_port=-2)


def test_every_setting_is_documented():
    import dataclasses
    import os
    doc = open(os.path.join(os.path.dirname(__file__), "..", "docs", "configuration.md")).read()
    for cls in (MasterConfig, NodeConfig, ClientConfig, ConductorServerConfig):
        for f in dataclasses.fields(cls):
            assert f"`{f.name}`" in doc, f"{cls.__name__}.{f.name} is missing from docs/configuration.md"


def test_a_token_file_that_is_empty_is_refused(tmp_path):
    empty = tmp_path / "token"
    empty.write_text("\n")
    with pytest.raises(ConfigError, match="is empty"):
        load_config(ClientConfig, token=f"@{empty}")


@pytest.mark.parametrize("given", ["127.0.0.1:7370", "tcp://127.0.0.1:7370", " 127.0.0.1:7370 "])
def test_a_master_is_tcp_host_port_or_host_port(given):
    for cls, section in ((ClientConfig, "client"), (NodeConfig, "node")):
        assert load_config(cls, env={}, section=section, master=given).master == "tcp://127.0.0.1:7370"
    assert load_config(ClientConfig, env={"HICACHE_MC_MASTER": given}).master == "tcp://127.0.0.1:7370"


@pytest.mark.parametrize("bad", ["127.0.0.1", "tcp://127.0.0.1", "127.0.0.1:port", "http://h:1",
                                 "h:0", "h:70000", ":7370"])
def test_a_master_that_cannot_be_dialled_is_refused(bad):
    for cls in (ClientConfig, NodeConfig):
        with pytest.raises(ConfigError, match="master: expected tcp://HOST:PORT or HOST:PORT"):
            load_config(cls, env={}, master=bad)


@pytest.mark.parametrize("where", ["explicit", "env", "file"])
def test_an_ssd_dir_without_an_ssd_tier_is_refused(tmp_path, where):
    f = tmp_path / "c.toml"
    f.write_text('[node]\nssd_dir = "/nvme/x"\n' if where == "file" else "")
    env = {"HICACHE_MC_SSD_DIR": "/nvme/x"} if where == "env" else {}
    explicit = {"ssd_dir": "/nvme/x"} if where == "explicit" else {}
    with pytest.raises(ConfigError, match=r"ssd_dir.*\bssd\b.*--ssd\b"):
        load_config(NodeConfig, file=str(f), env=env, section="node", **explicit)
    assert load_config(NodeConfig, file=str(f), env=env, section="node", ssd="1GiB", **explicit).ssd_dir


@pytest.mark.parametrize("section", ["master", "node", "client"])
def test_an_unknown_section_is_refused_naming_the_known_ones(tmp_path, section):
    f = tmp_path / "c.toml"
    f.write_text('[master]\nport = 7000\n[nodes]\ndram = "1GiB"\n')
    cls = {"master": MasterConfig, "node": NodeConfig, "client": ClientConfig}[section]
    with pytest.raises(ConfigError, match=r"\[nodes\].*\[master\], \[node\], \[client\]"):
        load_config(cls, file=str(f), env={}, section=section)


def test_conductor_settings_are_checked(tmp_path):
    with pytest.raises(ConfigError, match="admission: expected off, early or predictive"):
        load_config(ConductorServerConfig, env={}, admission="sometimes")
    with pytest.raises(ConfigError, match="l3_master and l3_namespace"):
        load_config(ConductorServerConfig, env={}, l3_master="tcp://127.0.0.1:7370")
    key = tmp_path / "key"
    key.write_text("s3cret\n")
    c = load_config(ConductorServerConfig, env={"HICACHE_MC_CONDUCTOR_PORT": "31000"}, section="conductor",
                    api_key=f"@{key}", l3_master="10.0.0.2:7370", l3_namespace="ns")
    assert (c.port, c.api_key, c.l3_master) == (31000, "s3cret", "tcp://10.0.0.2:7370")
    assert "s3cret" not in repr(c)
    (tmp_path / "empty").write_text("")
    with pytest.raises(ConfigError, match="admin_key: .* is empty"):
        load_config(ConductorServerConfig, env={}, admin_key=f"@{tmp_path / 'empty'}")


def test_the_masters_port_variable_never_moves_a_nodes_port():
    """HICACHE_MC_PORT is the master's port; a node (serve's too) takes HICACHE_MC_NODE_PORT only,
    and each role's metrics port its own variable only (both would bind one port in serve)."""
    env = {"HICACHE_MC_PORT": "7411", "HICACHE_MC_METRICS_PORT": "9999"}
    assert load_config(MasterConfig, env=env, section="master").port == 7411
    assert load_config(NodeConfig, env=env, section="node").port == 0
    assert load_config(MasterConfig, env=env, section="master").metrics_port == 9370
    assert load_config(NodeConfig, env=env, section="node").metrics_port == 0
    assert load_config(NodeConfig, env={"HICACHE_MC_NODE_METRICS_PORT": "9371"},
                       section="node").metrics_port == 9371
    assert load_config(ConductorServerConfig, env=env, section="conductor").port == 30000
