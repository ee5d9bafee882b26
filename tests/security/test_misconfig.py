"""A misconfiguration is named in one line by whoever meets it: a node, a client, the CLI (the
SGLang backend: tests/sglang/test_robustness.py). A wrong or missing token is not a dead
master, a credential is not the token, a client credential is not an admin's."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from hicache_mc.auth import issue
from hicache_mc.client import StoreClient
from peers import TOKEN
from procs import Proc, free_port


def _ready(port: int) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError as exc:
        return 0, str(exc)


def _node(c, tmp_path, token: str, name: str) -> tuple[Proc, int]:
    port = free_port()
    env = dict(c.env, HICACHE_MC_TOKEN=token, HICACHE_MC_NODE_METRICS_PORT=str(port))
    if not token:
        del env["HICACHE_MC_TOKEN"]
    p = Proc(["node", "--master", c.master, "--dram", "16MiB", "--node-id", name],
             str(tmp_path / f"{name}.log"), env)
    p.env = env
    return p.start(), port


def _until_log(p: Proc, text: str, timeout_s: float = 60.0) -> list[str]:
    end = time.monotonic() + timeout_s
    while True:
        lines = [line for line in p.log().splitlines() if text in line]
        if lines:
            return lines
        assert time.monotonic() < end and p.alive, p.log()[-3000:]
        time.sleep(0.1)


@pytest.mark.parametrize("token, cause", [
    ("", "it requires a token and this process has none"),
    ("another-cluster-" + "cd" * 16, "it refused this process's token or credential"),
], ids=["no token", "wrong token"])
def test_a_node_names_a_token_the_master_refuses_in_its_log_and_ready(guarded, tmp_path, token,
                                                                       cause, monkeypatch):
    c, _ = guarded
    monkeypatch.delenv("HICACHE_MC_TOKEN", raising=False)
    node, port = _node(c, tmp_path, token, "misconfigured")
    try:
        line = _until_log(node, "cannot reach the master")[0]
        assert f"ERROR hicache_mc.link: cannot reach the master at {c.master}: {cause}" in line
        end = time.monotonic() + 60
        while cause not in (got := _ready(port))[1]:
            assert time.monotonic() < end, got
            time.sleep(0.2)
        assert got[0] == 503 and got[1].startswith(f"not ready: not registered with the master at {c.master}: ")
        time.sleep(1.0)     # it retries every 100 ms: the cause is logged once (then once a minute)
        assert len(_until_log(node, "cannot reach the master")) == 1
        assert "misconfigured" not in {n["node_id"] for n in c.stats()["nodes"]}
    finally:
        node.stop()


def test_a_node_or_master_given_a_credential_instead_of_the_token_stops_in_one_line(tmp_path):
    cred = issue(TOKEN, "admin").text()
    env = {k: v for k, v in os.environ.items() if not k.startswith("HICACHE_MC_")}
    for role in ("node", "master"):
        r = subprocess.run([sys.executable, "-m", "hicache_mc.cli", role, "--port", str(free_port())]
                           if role == "master" else [sys.executable, "-m", "hicache_mc.cli", role],
                           env={**env, "HICACHE_MC_TOKEN": cred, "HICACHE_MC_MASTER_METRICS_PORT": "0"},
                           capture_output=True, text=True, timeout=120)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1, r.stderr
        assert "a credential is for clients and administrators" in lines[0]
        assert cred not in r.stderr


@pytest.mark.parametrize("token, cause", [
    ("", "it requires a token and this process has none"),
    ("another-cluster-" + "cd" * 16, "it refused this process's token or credential"),
], ids=["no token", "wrong token"])
def test_a_client_logs_the_token_the_master_refuses_as_an_error(guarded, token, cause, caplog):
    c, _ = guarded
    caplog.set_level(logging.INFO)
    with StoreClient(c.master, token=token, timeout_s=2.0) as s:
        assert s.batch_exists(["misconfig/a"]) == 0
        assert s.check().why.startswith(f"the master at {c.master}: {cause}")
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and errors[0].startswith(f"store call failed: {c.master}: {cause}"), errors


def _cli(*args, token: str = "") -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HICACHE_MC_")}
    if token:
        env["HICACHE_MC_TOKEN"] = token
    return subprocess.run([sys.executable, "-m", "hicache_mc.cli", *args], env=env,
                          capture_output=True, text=True, timeout=120)


def test_the_cli_names_a_missing_token_and_a_client_credential_used_for_admin_work(guarded):
    c, _ = guarded
    r = _cli("stats", "--master", c.master)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1, r.stderr
    assert lines[0].startswith(f"hicache-mc: the master at {c.master} refused this connection: "
                               "it requires a token and this process has none"), lines
    assert "is it running" not in lines[0]
    client = issue(TOKEN, "client", "teamA").text()
    r = _cli("quota", "teamA", "1GiB", "--master", c.master, token=client)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1, r.stderr
    assert "forbidden: a client may not send QuotaRequest" in lines[0]
    assert "this process holds a client credential of tenant 'teamA'" in lines[0]
    assert "need an admin credential" in lines[0] and client not in r.stderr
