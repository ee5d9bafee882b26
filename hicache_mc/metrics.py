"""Prometheus metrics of the master and the nodes, and the port that serves them, which also
answers the health (``/health``) and readiness (``/ready``) probes.

A service builds its metric families (prometheus_client's ``*MetricFamily`` types) on its own
loop thread, once a second (``Service.metric_families``), and publishes the list; a scrape
renders the last list with prometheus_client's ``generate_latest``, which escapes label values,
after ``hicache_mc_build_info`` and before the process's own metrics (``ProcessCollector``,
``PlatformCollector``). Scraping never touches the loop's live dictionaries. The port is
``metrics_port`` (0 = any free port, -1 = off) on ``metrics_host`` (127.0.0.1 by default), open
to whoever reaches it: the server holds every connection to a fixed buffer, a deadline and a
cap, on one thread (see MetricsServer); prometheus_client's own server, a thread per
connection, is not used.
"""
from __future__ import annotations

import bisect
import itertools
import logging
import os
import selectors
import socket
import threading
import time
from collections import OrderedDict
from contextlib import suppress
from typing import Callable, Union

from prometheus_client import CollectorRegistry, PlatformCollector, ProcessCollector, generate_latest
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from . import __version__

log = logging.getLogger(__name__)

# request handling time, seconds: the loop serves most requests in 20 µs .. 5 ms
BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
           0.1, 0.25, 0.5, 1.0)
_LE = [floatToGoString(b) for b in BUCKETS] + ["+Inf"]
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"     # what generate_latest writes


class Histogram:
    """Handling times of one request type, observed on the loop thread (no lock needed)."""
    __slots__ = ("counts", "total")

    def __init__(self):
        self.counts = [0] * (len(BUCKETS) + 1)
        self.total = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(BUCKETS, seconds)] += 1
        self.total += seconds


def histogram_family(name: str, help_: str, by_label: str, hists: dict) -> HistogramMetricFamily:
    f = HistogramMetricFamily(name, help_, labels=[by_label])
    for label, h in sorted(hists.items()):
        f.add_metric([label], list(zip(_LE, itertools.accumulate(h.counts))), h.total)
    return f


class Exposition:
    """What ``/metrics`` serves: the families a service's loop published last, then the
    process's own. ``publish`` on the loop thread, ``text`` on the HTTP thread."""

    def __init__(self):
        build = GaugeMetricFamily("hicache_mc_build_info", "version of this process", labels=["version"])
        build.add_metric([__version__], 1)
        self._build = build
        self._families: list[Metric] = []
        self.registry = CollectorRegistry()
        self.registry.register(self)
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)

    def publish(self, families: list[Metric]) -> None:
        self._families = [self._build, *families]      # one assignment: a scrape sees all or none

    def collect(self) -> list[Metric]:
        return self._families

    def text(self) -> bytes:
        return generate_latest(self.registry)


# The HTTP side: every connection on one thread, each held to a fixed buffer and a deadline
# (module-level: tests patch them smaller).
REQUEST_MAX = 8 << 10     # request line and headers; a scrape sends ~200 bytes
REQUEST_S = 2.0           # to send the whole request, from the accept
REPLY_S = 10.0            # to take the whole reply (a few KiB to a few hundred)
CONNECTIONS_MAX = 64      # Prometheus keeps one or two; a newcomer sheds the oldest past this
ACCEPT_BATCH = 16         # accepts per turn of the loop: peers already in are served between bursts
_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 431: "Request Header Fields Too Large",
            500: "Internal Server Error", 503: "Service Unavailable"}


class _Peer:
    __slots__ = ("sock", "buf", "got", "out", "deadline")

    def __init__(self, sock: socket.socket):
        self.sock, self.buf, self.got, self.out = sock, bytearray(REQUEST_MAX), 0, None
        self.deadline = time.monotonic() + REQUEST_S


class MetricsServer:
    """``GET /metrics`` serving what ``source()`` returns (text); ``/health``: 200 while the
    process serves; ``/ready``: 200, or 503 with the reason ``ready()`` gives; anything else
    404. Every reply closes its connection. One thread runs a selectors loop over all
    connections: an idle or slow peer costs a slot and 8 KiB until its deadline, never a thread."""

    def __init__(self, host: str, port: int, source: Callable[[], Union[bytes, str]],
                 ready: Callable[[], tuple[bool, str]] = lambda: (True, "")):
        self.source, self.ready = source, ready
        try:
            self.listener = socket.create_server((host, port), backlog=1024)
        except OSError as exc:      # name the port: the service may hold several
            raise OSError(exc.errno, f"{os.strerror(exc.errno)} (metrics port {host}:{port})") from None
        self.listener.setblocking(False)
        self.port = self.listener.getsockname()[1]
        self._peers: OrderedDict[socket.socket, _Peer] = OrderedDict()     # oldest first
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()    # close() ends the selector's wait
        self._sel.register(self.listener, selectors.EVENT_READ)
        self._sel.register(self._wake_r, selectors.EVENT_READ)
        self._stopping = False
        self.thread = threading.Thread(target=self._loop, name="metrics", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        try:
            while not self._stopping:
                now = time.monotonic()
                for p in [p for p in self._peers.values() if p.deadline <= now]:
                    self._drop(p)
                wait = min(p.deadline for p in self._peers.values()) - now if self._peers else None
                for key, _ in self._sel.select(wait):
                    try:
                        if key.fileobj is self.listener:
                            self._accept()
                        elif isinstance(key.data, _Peer):
                            self._step(key.data)
                    except Exception:       # a bug must not end scraping for good
                        log.exception("metrics: serving a connection failed")
                        if isinstance(key.data, _Peer):
                            self._drop(key.data)
        finally:
            for p in list(self._peers.values()):
                self._drop(p)
            self._sel.close()
            self.listener.close()

    def _accept(self) -> None:
        for _ in range(ACCEPT_BATCH):
            try:
                sock, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:     # out of descriptors: they wait in the backlog; no busy loop
                time.sleep(0.01)
                return
            if len(self._peers) >= CONNECTIONS_MAX:
                self._drop(next(iter(self._peers.values())))
            sock.setblocking(False)
            p = self._peers[sock] = _Peer(sock)
            self._sel.register(sock, selectors.EVENT_READ, p)

    def _drop(self, p: _Peer) -> None:
        if self._peers.pop(p.sock, None) is not None:
            self._sel.unregister(p.sock)
        p.sock.close()

    def _step(self, p: _Peer) -> None:
        """Read more of the request, or send more of the reply."""
        try:
            if p.out is not None:
                p.out = p.out[p.sock.send(p.out):]
                if not p.out:
                    self._drop(p)
                return
            k = p.sock.recv_into(memoryview(p.buf)[p.got:])
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            k = 0
        if k == 0:
            self._drop(p)
            return
        p.got += k
        end = p.buf.find(b"\r\n\r\n", 0, p.got)
        if end >= 0:
            self._reply(p, *self._answer(bytes(p.buf[:end])))
        elif p.got == len(p.buf):
            self._reply(p, 431, f"request over {REQUEST_MAX} bytes\n")

    def _answer(self, head: bytes) -> tuple[int, Union[bytes, str]]:
        parts = head.split(b"\r\n", 1)[0].split(b" ")
        if len(parts) != 3:
            return 400, "bad request line\n"
        path = parts[1].split(b"?", 1)[0]
        if parts[0] != b"GET" or path not in (b"/metrics", b"/health", b"/ready"):
            return 404, "only GET /metrics, /health and /ready are served here\n"
        if path == b"/health":
            return 200, "ok\n"
        try:
            if path == b"/ready":
                ok, why = self.ready()
                return (200, "ready\n") if ok else (503, f"not ready: {why}\n")
            return 200, self.source()
        except Exception:
            log.exception("metrics: the source failed")
            return 500, "metrics unavailable\n"

    def _reply(self, p: _Peer, code: int, text: Union[bytes, str]) -> None:
        body = text if isinstance(text, bytes) else text.encode()
        ctype = CONTENT_TYPE if code == 200 else "text/plain"
        p.out = memoryview(f"HTTP/1.1 {code} {_REASONS[code]}\r\nContent-Type: {ctype}\r\n"
                           f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
        p.buf, p.deadline = b"", time.monotonic() + REPLY_S     # the request buffer is done with
        self._sel.modify(p.sock, selectors.EVENT_WRITE, p)
        self._step(p)

    def close(self) -> None:
        self._stopping = True
        with suppress(OSError):
            self._wake_w.send(b"x")
        self.thread.join(2.0)
        self._wake_r.close()
        self._wake_w.close()
