"""The client commands of ``hicache-mc`` (stats, quota, clear) against a real store with a
token: one configuration for all of them, confirmation before a full clear, and one clear line
with a non-zero exit when something is wrong."""
import json
import os
import secrets
import socket
import subprocess
import sys

import pytest

import hicache_mc
from hicache_mc.client import StoreClient
from procs import Cluster, free_port


def cli(*args, env=None) -> subprocess.CompletedProcess:
    """``hicache-mc ARGS`` with none of this process's HICACHE_MC_* settings, plus ``env`` (a
    master's metrics on any free port: 9370 may be another test's)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("HICACHE_MC_")}
    base["HICACHE_MC_MASTER_METRICS_PORT"] = "0"
    base["HICACHE_MC_PUBLISH_PORT"] = "0"
    return subprocess.run([sys.executable, "-m", "hicache_mc.cli", *args], capture_output=True,
                          text=True, timeout=120, env={**base, **(env or {})})


def one_line(r: subprocess.CompletedProcess) -> str:
    """The error a command printed: exactly one line on stderr, no traceback."""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    return lines[0]


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    """A ``serve`` with a cluster token; ``.token_file`` holds it, ``.cred_file`` a client
    credential of the default tenant."""
    tmp = tmp_path_factory.mktemp("cli")
    token = secrets.token_hex(16)
    c = Cluster(tmp, token=token)
    c.token_file = tmp / "token"
    c.token_file.write_text(token + "\n")
    c.start_serve("64MiB")
    r = cli("credential", "--token-file", str(c.token_file))
    assert r.returncode == 0, r.stderr
    c.cred_file = tmp / "client.cred"
    c.cred_file.write_text(r.stdout)
    yield c
    c.stop()


def test_client_commands_read_the_master_and_the_token_from_env_or_config_file(secured, tmp_path):
    host_port = secured.master.removeprefix("tcp://")           # Mooncake's habit
    r = cli("stats", env={"HICACHE_MC_MASTER": host_port, "HICACHE_MC_TOKEN": f"@{secured.cred_file}"})
    assert r.returncode == 0, r.stderr
    assert "on 1 node," in r.stdout and f"(hicache-mc {hicache_mc.__version__})" in r.stdout
    conf = tmp_path / "client.toml"
    conf.write_text(f'[client]\nmaster = "{host_port}"\ntoken = "@{secured.token_file}"\n')
    r = cli("stats", "--json", "--config", str(conf))
    assert r.returncode == 0 and json.loads(r.stdout)["version"] == hicache_mc.__version__
    r = cli("quota", "--master", host_port, "--token-file", str(secured.token_file), "teamx", "1MiB")
    assert r.returncode == 0 and "teamx" in r.stdout, r.stderr
    # a client credential may not set quotas: refused, in one line
    r = cli("quota", "teamx", "none", env={"HICACHE_MC_MASTER": host_port,
                                           "HICACHE_MC_TOKEN": f"@{secured.cred_file}"})
    assert r.returncode == 1 and "refused" in one_line(r)


def test_clear_without_a_prefix_asks_for_yes_and_removes_nothing(secured):
    keys = [f"cli-clear/{i}" for i in range(3)]
    with StoreClient(secured.master, token=secured.token) as c:
        assert all(c.put(k, b"x" * 100) for k in keys)
        env = {"HICACHE_MC_MASTER": secured.master, "HICACHE_MC_TOKEN": f"@{secured.token_file}"}
        r = cli("clear", env=env)
        assert r.returncode == 2 and "--yes" in one_line(r)
        assert c.batch_exists(keys) == 3
        r = cli("clear", "--prefix", "cli-clear/1", env=env)
        assert r.returncode == 0 and "removed 1 objects" in r.stdout, r.stderr
        r = cli("clear", "--yes", env=env)
        assert r.returncode == 0 and "removed 2 objects" in r.stdout, r.stderr
        assert c.batch_contains(keys) == [False] * 3


@pytest.mark.parametrize("args", [("stats",), ("stats", "--json"), ("clear", "--yes"),
                                  ("clear", "--prefix", "a/"), ("quota", "t", "1MiB")])
def test_client_commands_fail_in_one_line_when_no_master_answers(args):
    r = cli(*args, "--master", f"127.0.0.1:{free_port()}")
    assert r.returncode == 1, r.stdout
    assert one_line(r).startswith("hicache-mc: no answer from the master at tcp://127.0.0.1:")
    assert r.stdout == ""


def test_a_master_address_that_cannot_be_dialled_is_refused_in_one_line():
    r = cli("stats", "--master", "127.0.0.1")
    assert r.returncode == 2 and "tcp://HOST:PORT or HOST:PORT" in one_line(r)
    r = cli("stats", env={"HICACHE_MC_MASTER": "tcp://127.0.0.1"})
    assert r.returncode == 2 and "master" in one_line(r)


@pytest.fixture
def taken():
    """A port some other process (here: this one) listens on."""
    with socket.create_server(("127.0.0.1", 0)) as s:
        yield str(s.getsockname()[1])


@pytest.mark.parametrize("args", [("master", "--port", "{taken}"),
                                  ("master", "--port", "{free}", "--metrics-port", "{taken}"),
                                  ("node", "--node-port", "{taken}", "--dram", "16MiB"),
                                  ("node", "--data-port", "{taken}", "--dram", "16MiB"),
                                  ("serve", "--port", "{taken}", "--dram", "16MiB")])
def test_a_port_in_use_is_one_line_and_exit_2(taken, args, tmp_path):
    # (the nodes' master; a data folder of their own, so no other node's lock on the default
    # one makes a node log how it names itself)
    r = cli(*[a.format(taken=taken, free=free_port()) for a in args],
            env={"HICACHE_MC_MASTER": f"127.0.0.1:{free_port()}", "HICACHE_MC_DATA_DIR": str(tmp_path)})
    assert r.returncode == 2
    assert "address already in use" in one_line(r).lower() and taken in r.stderr


def test_serve_whose_node_port_is_in_use_exits_2_naming_it(taken):
    r = cli("serve", "--port", str(free_port()), "--node-port", taken, "--dram", "16MiB")
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert any("the node could not start: cannot listen" in line and taken in line
               for line in r.stderr.splitlines()), r.stderr


def test_the_version_has_one_source():
    from setuptools.config.pyprojecttoml import read_configuration
    root = os.path.join(os.path.dirname(__file__), "..", "..")
    assert read_configuration(os.path.join(root, "pyproject.toml"))["project"]["version"] == \
        hicache_mc.__version__
    r = cli("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"hicache-mc {hicache_mc.__version__}"


def test_wait_probes_with_a_tenant_credential(secured, tmp_path):
    r = cli("credential", "--tenant", "teamw", "--token-file", str(secured.token_file))
    cred = tmp_path / "teamw.cred"
    cred.write_text(r.stdout)
    r = cli("wait", "--timeout", "120", env={"HICACHE_MC_MASTER": secured.master,
                                             "HICACHE_MC_TOKEN": f"@{cred}"})
    assert r.returncode == 0 and "a probe put succeeded" in r.stdout, r.stderr


def test_a_secret_given_as_an_argument_is_refused_without_echoing_it():
    secret = "hmc1:client::" + "ab" * 32 + ":" + "cd" * 32
    for argv in (["stats", "--token", secret], ["stats", f"--token={secret}"],
                 ["serve", "--token", secret], ["wait", "--token-fil", "x"]):
        r = cli(*argv)
        assert r.returncode == 2 and secret not in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert "a secret is never an argument" in r.stderr or "unrecognized arguments" in r.stderr


def test_a_credential_written_to_a_file_is_readable_by_its_owner_only(secured, tmp_path):
    out = tmp_path / "teamA.cred"
    r = subprocess.run(f"umask 022; {sys.executable} -m hicache_mc.cli credential --tenant teamA "
                       f"--token-file {secured.token_file} > {out}", shell=True,
                       capture_output=True, text=True, timeout=120,
                       env={k: v for k, v in os.environ.items() if not k.startswith("HICACHE_MC_")})
    assert r.returncode == 0, r.stderr
    assert out.read_text().startswith("hmc1:client:teamA:") and (out.stat().st_mode & 0o777) == 0o600


def test_serve_with_the_masters_port_in_the_environment_starts(tmp_path):
    """HICACHE_MC_PORT set the node's port too: serve's node then failed, "address in use"."""
    port = free_port()
    env = {"HICACHE_MC_PORT": str(port), "HICACHE_MC_DATA_DIR": str(tmp_path)}
    base = {k: v for k, v in os.environ.items() if not k.startswith("HICACHE_MC_")}
    base.update(HICACHE_MC_MASTER_METRICS_PORT="0", HICACHE_MC_PUBLISH_PORT="0", **env)
    p = subprocess.Popen([sys.executable, "-m", "hicache_mc.cli", "serve", "--dram", "32MiB"],
                         env=base, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        r = cli("wait", "--master", f"127.0.0.1:{port}", "--timeout", "60")
        assert r.returncode == 0, r.stderr + (p.stderr.read() if p.poll() is not None else "")
    finally:
        p.terminate()
        p.wait(30)
