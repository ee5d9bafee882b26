"""deploy/ agrees with the code: its files parse, every hicache-mc command in them passes the
real CLI parser, every HICACHE_MC_* variable names a setting, a bind beyond loopback comes
with a token from a file, Prometheus scrapes the metrics ports the compose file sets, and the
Grafana dashboard uses only metrics that a running master and node serve; the conductor's
config files load, and it binds beyond loopback only with an API key. Docker, systemd and
Kubernetes are not needed."""
import dataclasses
import json
import re
import shlex
import time
import urllib.request
from pathlib import Path

import pytest

from hicache_mc.cli import build_parser
from hicache_mc.config import (ENV_PREFIX, ClientConfig, ConductorServerConfig, MasterConfig,
                               NodeConfig, load_config)
from procs import free_port

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
ROLES = {"master": MasterConfig, "node": NodeConfig, "client": ClientConfig,
         "conductor": ConductorServerConfig}
SERVICE_ROLES = {"serve": ("master", "node"), "master": ("master",), "node": ("node",),
                 "conductor": ("conductor",)}


def load_yaml(name: str) -> list:
    yaml = pytest.importorskip("yaml", reason="PyYAML is not installed")
    return [d for d in yaml.safe_load_all((DEPLOY / name).read_text()) if d is not None]


def check_command(argv: list[str], env: dict, where: str) -> None:
    """``hicache-mc ARGV`` under ``env``: a server command the real parser accepts, HICACHE_MC_*
    variables that name settings of its roles, and a token from a file for any bind beyond
    loopback."""
    assert argv and argv[0] in SERVICE_ROLES, f"{where}: not a server command: {argv}"
    try:
        args = build_parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"{where}: hicache-mc rejects {shlex.join(argv)} (see stderr)")
    roles = {role: {f.name for f in dataclasses.fields(ROLES[role])} for role in SERVICE_ROLES[argv[0]]}
    for name in (n for n in env if n.startswith(ENV_PREFIX)):
        setting = name[len(ENV_PREFIX):].lower()         # HICACHE_MC_DRAM, HICACHE_MC_NODE_PORT
        role, _, rest = setting.partition("_")
        assert any(setting in f for f in roles.values()) or rest in roles.get(role, ()), \
            f"{where}: {name} names no setting of hicache-mc {argv[0]}"
    token = env.get(f"{ENV_PREFIX}TOKEN", "")
    assert not token or token.startswith("@"), f"{where}: a literal token in HICACHE_MC_TOKEN"
    host = args.host or env.get(f"{ENV_PREFIX}HOST") or "127.0.0.1"
    if not host.startswith("127."):
        assert args.token_file or token, f"{where}: binds {host} without a token file"
        if argv[0] == "conductor":
            assert args.api_key_file and args.admin_key_file, \
                f"{where}: the conductor binds {host} without API and admin keys from files"


def compose() -> dict:
    return load_yaml("compose.yaml")[0]


def compose_commands() -> dict:
    """service -> (argv, env) of the compose services that run the hicache-mc image."""
    return {name: (svc["command"], svc.get("environment", {}))
            for name, svc in compose()["services"].items() if svc.get("image") == "hicache-mc:local"}


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_compose_runs_a_master_and_two_nodes_with_valid_commands():
    doc = compose()
    commands = compose_commands()
    assert sorted(argv[0] for argv, _ in commands.values()) == ["conductor", "master", "node", "node"]
    for name, (argv, env) in commands.items():
        check_command(argv, env, f"compose.yaml {name}")
        if "--token-file" in argv:
            assert doc["secrets"], "the token file comes from a compose secret"
            assert flag(argv, "--token-file").startswith("/run/secrets/")
    assert {"prometheus", "grafana"} <= set(doc["services"])
    for name, (argv, _) in commands.items():      # a node's DRAM segment needs room in /dev/shm
        if argv[0] == "node":
            assert doc["services"][name]["shm_size"]


def test_prometheus_scrapes_the_metrics_ports_of_the_compose_file():
    expected = set()
    for name, (argv, env) in compose_commands().items():
        if argv[0] == "conductor":                  # /metrics on its HTTP port
            expected.add(f"{name}:{flag(argv, '--port')}")
            continue
        port = flag(argv, "--metrics-port" if argv[0] == "master" else "--node-metrics-port")
        expected.add(f"{name}:{port}")
        assert env.get("HICACHE_MC_METRICS_HOST") == "0.0.0.0", f"{name}: metrics only on its loopback"
    prometheus = load_yaml("prometheus.yml")[0]
    targets = {t for job in prometheus["scrape_configs"] for sc in job["static_configs"]
               for t in sc["targets"]}
    assert targets == expected
    assert compose()["services"]["prometheus"]["volumes"][0].startswith("./prometheus.yml:")


def test_kubernetes_manifests_parse_and_their_commands_are_valid():
    docs = load_yaml("kubernetes.yaml")
    kinds: dict = {}
    for d in docs:
        kinds.setdefault(d["kind"], []).append(d)
    assert {"Deployment", "Service", "DaemonSet", "ConfigMap"} <= set(kinds)
    runs = {}
    for kind in ("Deployment", "DaemonSet"):
        for workload in kinds[kind]:
            for c in workload["spec"]["template"]["spec"]["containers"]:
                env = {e["name"]: e.get("value", "") for e in c.get("env", [])}
                check_command(c["args"], env, f"kubernetes.yaml {kind} {c['name']}")
                runs[c["args"][0]] = c
    master, node, conductor = runs["master"], runs["node"], runs["conductor"]
    # readiness: a TCP check on the port the command sets (the node's stream port opens last)
    assert master["readinessProbe"]["tcpSocket"]["port"] == int(flag(master["args"], "--port"))
    assert node["readinessProbe"]["tcpSocket"]["port"] == int(flag(node["args"], "--data-port"))
    assert conductor["readinessProbe"]["httpGet"] == {"path": "/ready", "port": int(flag(conductor["args"], "--port"))}
    services = {svc["metadata"]["name"]: svc for svc in kinds["Service"]}
    master_svc = services["hicache-mc-master"]
    assert int(flag(master["args"], "--port")) in {p["targetPort"] for p in master_svc["spec"]["ports"]}
    assert int(flag(conductor["args"], "--port")) in \
        {p["targetPort"] for p in services["hicache-mc-conductor"]["spec"]["ports"]}
    store = f"{master_svc['metadata']['name']}.{master_svc['metadata']['namespace']}:{flag(master['args'], '--port')}"
    assert flag(node["args"], "--master").endswith(store)
    # the conductor's settings, from its ConfigMap, load and point at that master
    (config_map,) = kinds["ConfigMap"]
    mounts = {m["name"]: m["mountPath"] for m in conductor["volumeMounts"]}
    assert flag(conductor["args"], "--config") == f"{mounts['config']}/conductor.toml"
    config = _load_conductor_toml(config_map["data"]["conductor.toml"])
    assert config.l3_master.endswith(store) and config.worker_urls


def _load_conductor_toml(text: str) -> ConductorServerConfig:
    import tempfile
    with tempfile.NamedTemporaryFile("w", suffix=".toml") as f:
        f.write(text)
        f.flush()
        return load_config(ConductorServerConfig, file=f.name, env={}, section="conductor")


def test_the_compose_conductor_reads_its_config_and_reaches_the_master():
    argv, _ = compose_commands()["conductor"]
    volumes = compose()["services"]["conductor"]["volumes"]
    mounted = {v.split(":")[1]: v.split(":")[0] for v in volumes}
    assert mounted[flag(argv, "--config")] == "./conductor.toml"
    config = _load_conductor_toml((DEPLOY / "conductor.toml").read_text())
    master_argv, _ = compose_commands()["master"]
    master_ip = compose()["services"]["master"]["networks"]["store"]["ipv4_address"]
    assert config.l3_master == f"tcp://{master_ip}:{flag(master_argv, '--port')}"
    assert config.tokenizer in mounted


def test_dockerfile_and_systemd_units_run_valid_commands():
    text = (DEPLOY / "Dockerfile").read_text()
    entry = json.loads(re.search(r"^ENTRYPOINT (.*)$", text, re.M).group(1))
    cmd = json.loads(re.search(r"^CMD (.*)$", text, re.M).group(1))
    assert entry == ["hicache-mc"]
    check_command(cmd, {}, "Dockerfile CMD")
    runs = [line for line in text.splitlines() if line.startswith("RUN ")]
    assert any("requirements/base.txt -c requirements/constraints.txt" in line for line in runs)
    assert not any(re.search(r"torch|sglang|mooncake", line) for line in runs)   # a CPU image
    units = sorted((DEPLOY / "systemd").glob("*.service"))
    assert [u.name for u in units] == ["hicache-mc-master.service", "hicache-mc-node.service"]
    for unit in units:
        lines = unit.read_text().replace("\\\n", " ").splitlines()
        env = dict(line.split("=", 1)[1].split("=", 1) for line in lines if line.startswith("Environment="))
        exec_start = [shlex.split(line.split("=", 1)[1]) for line in lines if line.startswith("ExecStart=")]
        assert len(exec_start) == 1 and exec_start[0][0].endswith("/hicache-mc"), unit.name
        check_command(exec_start[0][1:], env, unit.name)


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return r.read().decode()


def _names(text: str) -> set[str]:
    """Metric names of an exposition: families (with a histogram's series) and samples."""
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()[:4]
            names.add(name)
            if kind == "histogram":
                names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, 1)[0])
    return names


def alert_rules() -> list[dict]:
    """The rules of deploy/alerts.yml, each checked for the fields Prometheus needs."""
    doc = load_yaml("alerts.yml")[0]
    rules = [r for g in doc["groups"] for r in g["rules"]]
    for r in rules:
        assert set(r) <= {"alert", "expr", "for", "labels", "annotations"}, r
        assert re.fullmatch(r"[A-Z][A-Za-z]+", r["alert"]) and r["expr"].strip(), r
        assert r["labels"]["severity"] in ("info", "warning", "critical") and r["annotations"]["summary"]
        assert r["expr"].count("(") == r["expr"].count(")"), r["alert"]
    return rules


def test_alert_rules_cover_the_failures_and_prometheus_loads_them():
    names = {r["alert"] for r in alert_rules()}
    for want in ("NodeDown", "TierDegraded", "QuotaNearlyFull", "ViewsOutOfSync"):
        assert f"HicacheMc{want}" in names
    prometheus = load_yaml("prometheus.yml")[0]
    mounts = dict(v.rsplit(":", 1)[0].split(":") for v in compose()["services"]["prometheus"]["volumes"])
    assert mounts["./alerts.yml"] in prometheus["rule_files"]


def test_the_dashboard_and_alert_rules_use_metrics_a_master_and_a_node_serve(cluster, tmp_path):
    dashboard = json.loads((DEPLOY / "grafana" / "dashboards" / "hicache-mc.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    used = {m for e in exprs for m in re.findall(r"\bhicache_mc_\w+", e)}
    assert len(used) >= 20
    alerting = {m for r in alert_rules() for m in re.findall(r"\bhicache_mc_\w+", r["expr"])}
    assert len(alerting) >= 6
    used |= alerting
    master_port, node_port = free_port(), free_port()
    cluster.start_master(args=("--metrics-port", str(master_port)))
    cluster.add_node(args=("--node-metrics-port", str(node_port), "--ssd", "64MiB",
                           "--ssd-dir", str(tmp_path / "ssd")))
    cluster.wait_nodes(1)
    end = time.monotonic() + 30           # the services refresh their metrics once a second
    while True:
        try:
            served = _names(_scrape(master_port)) | _names(_scrape(node_port))
        except OSError:
            served = set()
        if "hicache_mc_node_ssd_capacity_bytes" in served and "hicache_mc_master_nodes" in served:
            break
        assert time.monotonic() < end, "no metrics from the master and the node"
        time.sleep(0.2)
    assert sorted(used - served) == []


PUBLISH_PORT = MasterConfig().publish_port


def test_the_publish_port_is_fixed_and_open_in_every_deploy_file():
    assert PUBLISH_PORT > 0
    master_argv = compose_commands()["master"][0]
    assert int(flag(master_argv, "--publish-port")) == PUBLISH_PORT
    docs = {(d["kind"], d["metadata"]["name"]): d for d in load_yaml("kubernetes.yaml")}
    master = docs["Deployment", "hicache-mc-master"]["spec"]["template"]["spec"]["containers"][0]
    assert int(flag(master["args"], "--publish-port")) == PUBLISH_PORT
    assert PUBLISH_PORT in {p["containerPort"] for p in master["ports"]}
    assert PUBLISH_PORT in {p["targetPort"] for p in docs["Service", "hicache-mc-master"]["spec"]["ports"]}
    unit = (DEPLOY / "systemd" / "hicache-mc-master.service").read_text().replace("\\\n", " ")
    assert f"--publish-port {PUBLISH_PORT}" in unit
    expose = re.search(r"^EXPOSE (.*)$", (DEPLOY / "Dockerfile").read_text(), re.M).group(1)
    assert str(PUBLISH_PORT) in expose.split()
    firewall = (DEPLOY.parent / "docs" / "operations.md").read_text().split("## 5. Ports")[1]
    assert f"TCP {PUBLISH_PORT} to the master" in firewall.split("## 6.")[0]


def _mounts(container: dict, volumes: list[dict]) -> dict:
    """mount path -> the volume's source (a host path, or a volume name)."""
    by_name = {v["name"]: v.get("hostPath", {}).get("path", v["name"]) for v in volumes}
    return {m["mountPath"]: by_name[m["name"]] for m in container.get("volumeMounts", [])}


def test_the_kubernetes_sglang_pods_share_the_nodes_segment_folder_and_user():
    node_pod = next(d for d in load_yaml("kubernetes.yaml") if d["kind"] == "DaemonSet")
    sglang_pod = load_yaml("kubernetes-sglang.yaml")[0]
    node_spec, sglang_spec = node_pod["spec"]["template"]["spec"], sglang_pod["spec"]["template"]["spec"]
    node = node_spec["containers"][0]
    shm_dir = {e["name"]: e.get("value") for e in node["env"]}["HICACHE_MC_SHM_DIR"]
    host_dir = _mounts(node, node_spec["volumes"])[shm_dir]
    assert host_dir.startswith("/dev/shm/")                 # the host's tmpfs
    sglang = sglang_spec["containers"][0]
    assert _mounts(sglang, sglang_spec["volumes"])[shm_dir] == host_dir   # the same path
    assert sglang_spec["securityContext"]["runAsUser"] == node_spec["securityContext"]["runAsUser"]
    argv = sglang["command"]
    assert flag(argv, "--hicache-storage-backend") == "hicache_mc"
    extra = json.loads(flag(argv, "--hicache-storage-backend-extra-config"))
    assert extra["master"].startswith("tcp://hicache-mc-master.hicache-mc:")
    assert extra["token"].startswith("@")


def test_the_compose_sglang_service_shares_node1s_segment_volume_and_user():
    doc, base = load_yaml("compose.sglang.yaml")[0], compose()
    node, sglang = doc["services"]["node1"], doc["services"]["sglang"]
    shm_dir = node["environment"]["HICACHE_MC_SHM_DIR"]
    volume = next(v.split(":")[0] for v in node["volumes"] if v.endswith(":" + shm_dir))
    assert f"{volume}:{shm_dir}" in sglang["volumes"]
    assert doc["volumes"][volume]["driver_opts"]["type"] == "tmpfs"
    image_user = re.search(r"useradd .*--uid (\d+)", (DEPLOY / "Dockerfile").read_text()).group(1)
    assert sglang["user"].split(":")[0] == image_user       # node1 runs as the image's user
    assert "uid=" + image_user in doc["volumes"][volume]["driver_opts"]["o"]
    argv = sglang["command"]
    extra = json.loads(flag(argv, "--hicache-storage-backend-extra-config"))
    assert extra["master"] == flag(base["services"]["node1"]["command"], "--master")
    assert sglang["networks"]["store"]["ipv4_address"].startswith("172.28.0.")
