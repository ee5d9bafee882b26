"""Every call ends by its deadline, whatever state its socket is in: a wrong token, no token, a
master that is down or one that restarts, in loops of hundreds of fresh clients and CLI runs.
A hang is what fails: each call is held to its deadline plus a generous slack (a loaded 2-core
host), never to a tight timing."""
from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from hicache_mc import cli
from hicache_mc.client import StoreClient
from peers import TOKEN
from procs import Cluster, free_port

# Short: a wrong or missing token fails every call only at its deadline (``wait`` retries
# until then), 200 runs in a row; what is checked is that none runs past it.
DEADLINE_S = 0.2
SLACK_S = 3.0           # far above any honest call here; a blocked send never returns at all
FRESH_CLIENTS = 200
CLI_RUNS = 200
KiB = 1 << 10
RESTARTS = 5


def _client_rounds(master: str, token: str, rounds: int, more=lambda: False) -> list[float]:
    """``rounds`` fresh clients (and more while ``more()``), each making an exists, a put and a
    get: every call's duration."""
    page = np.arange(16 * KiB, dtype=np.uint8)
    took = []
    for i in itertools.count():
        if i >= rounds and not more():
            break
        with StoreClient(master, token=token, timeout_s=DEADLINE_S, transport="tcp") as c:
            for call in (lambda: c.batch_exists([f"dl/{i}"]),
                         lambda: c.batch_put_from([f"dl/{i}"], [page.ctypes.data], [page.nbytes]),
                         lambda: c.batch_get_into([f"dl/{i}"], [page.ctypes.data], [page.nbytes])):
                t0 = time.monotonic()
                call()
                took.append(time.monotonic() - t0)
    return took


@pytest.mark.parametrize("token", ["", "another-cluster-" + "ab" * 16, TOKEN[::-1]],
                         ids=["no token", "wrong token", "reversed token"])
def test_fresh_clients_with_a_wrong_or_no_token_end_every_call_by_its_deadline(guarded, token):
    c, _ = guarded
    took = _client_rounds(c.master, token, FRESH_CLIENTS)
    assert max(took) < DEADLINE_S + SLACK_S, f"slowest call {max(took):.2f} s"


def test_fresh_clients_of_a_master_that_is_down_end_every_call_by_its_deadline():
    took = _client_rounds(f"tcp://127.0.0.1:{free_port()}", TOKEN, FRESH_CLIENTS)
    assert max(took) < DEADLINE_S + SLACK_S, f"slowest call {max(took):.2f} s"


def test_fresh_clients_of_a_master_that_restarts_end_every_call_by_its_deadline(tmp_path):
    c = Cluster(tmp_path, heartbeat_s=0.25, liveness=4, token=TOKEN)
    c.start_master()
    c.add_node(dram="32MiB")
    c.wait_nodes(1)
    stop, restarts = threading.Event(), []

    def restart_forever():
        while not stop.wait(0.3):
            c.master_proc.kill(signal.SIGKILL)
            c.start_master()
            restarts.append(time.monotonic())
    t = threading.Thread(target=restart_forever)
    t.start()
    try:
        took = _client_rounds(c.master, TOKEN, FRESH_CLIENTS, lambda: len(restarts) < RESTARTS)
    finally:
        stop.set()
        t.join()
        c.stop()
    assert max(took) < DEADLINE_S + SLACK_S, f"slowest call {max(took):.2f} s"


def _cli_run(argv: list[str], capsys) -> tuple[int, float, str]:
    t0 = time.monotonic()
    rc = cli.main(argv)
    return rc, time.monotonic() - t0, capsys.readouterr().err


@pytest.mark.parametrize("token", ["", "another-cluster-" + "ab" * 16], ids=["no token", "wrong token"])
def test_cli_runs_with_a_wrong_or_no_token_fail_by_their_deadline(guarded, token, monkeypatch,
                                                                   capsys):
    c, _ = guarded
    monkeypatch.delenv("HICACHE_MC_TOKEN", raising=False)
    if token:
        monkeypatch.setenv("HICACHE_MC_TOKEN", token)
    slowest = 0.0
    for i in range(CLI_RUNS):
        argv = ["stats", "--master", c.master, "--timeout", str(DEADLINE_S)] if i % 4 else \
            ["wait", "--master", c.master, "--nodes", "2", "--timeout", str(DEADLINE_S)]
        rc, took, err = _cli_run(argv, capsys)
        assert rc == 1, err
        slowest = max(slowest, took)
    assert slowest < DEADLINE_S + SLACK_S, f"slowest run {slowest:.2f} s"


def test_cli_processes_without_the_token_end_by_their_deadline(guarded):
    """The case first seen: ``hicache-mc wait --nodes 2 --timeout 2`` without the token, in
    fresh processes side by side, hung in 5 of 40 runs."""
    c, _ = guarded
    env = {k: v for k, v in os.environ.items() if not k.startswith("HICACHE_MC_")}
    runs = 0
    for _ in range(5):
        procs = [subprocess.Popen([sys.executable, "-m", "hicache_mc.cli", "wait", "--master",
                                   c.master, "--nodes", "2", "--timeout", "1"], env=env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                 for _ in range(8)]
        for p in procs:
            try:    # (interpreter start-up on a loaded host: the slack covers it, not a hang)
                err = p.communicate(timeout=1 + 20)[1]
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                pytest.fail("a wait without the token did not end by its deadline")
            assert p.returncode == 1 and "requires a token" in err, err
            runs += 1
    assert runs == 40
