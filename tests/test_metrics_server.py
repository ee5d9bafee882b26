"""The /metrics HTTP server against idle, slow and oversized peers: one thread whatever the
number of connections, bounded buffers, the oldest connection shed for a new one."""
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

from hicache_mc import metrics
from hicache_mc.metrics import MetricsServer
from rawsock import closed_within

TEXT = "# TYPE hello gauge\nhello 1\n"


@pytest.fixture
def server():
    srv = MetricsServer("127.0.0.1", 0, lambda: TEXT)
    yield srv
    srv.close()


def get(port: int, path: str) -> tuple[int, str, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.headers["Content-Type"], r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers["Content-Type"], ""


def test_metrics_are_served(server):
    assert get(server.port, "/metrics") == (200, "text/plain; version=0.0.4; charset=utf-8", TEXT)
    assert get(server.port, "/metrics?x=1")[0] == 200


def test_health_is_200_and_ready_follows_the_service():
    state = [(False, "no live storage node")]
    srv = MetricsServer("127.0.0.1", 0, lambda: TEXT, lambda: state[0])
    try:
        assert get(srv.port, "/health")[0] == 200
        assert get(srv.port, "/ready")[0] == 503
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(f"http://127.0.0.1:{srv.port}/ready", timeout=5)
        assert err.value.read().decode() == "not ready: no live storage node\n"
        state[0] = (True, "")
        assert get(srv.port, "/ready")[0] == 200
    finally:
        srv.close()


def test_an_unknown_path_is_404(server):
    assert get(server.port, "/")[0] == 404
    assert get(server.port, "/metricsx")[0] == 404


def test_an_idle_flood_neither_starves_scrapes_nor_costs_threads(server):
    before = threading.active_count()
    flood = [socket.create_connection(("127.0.0.1", server.port), timeout=5) for _ in range(1000)]
    try:
        start = time.monotonic()
        assert get(server.port, "/metrics")[2] == TEXT
        assert time.monotonic() - start < 2
        assert threading.active_count() <= before
        assert closed_within(flood[0], 2)          # shed, oldest first
    finally:
        for s in flood:
            s.close()


def test_a_huge_request_line_is_cut(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
        try:
            s.sendall(b"GET /" + b"a" * (1 << 20))
        except OSError:
            pass                                  # closed while we were still sending: cut
        assert closed_within(s, 2)
    assert get(server.port, "/metrics")[2] == TEXT


def test_a_slow_request_is_cut(server, monkeypatch):
    monkeypatch.setattr(metrics, "REQUEST_S", 0.3)
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
        s.sendall(b"GET /metrics HTTP/1.1\r\n")
        assert closed_within(s, 2)
    assert get(server.port, "/metrics")[2] == TEXT
