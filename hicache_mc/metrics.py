"""Prometheus text exposition for the master and the nodes, without extra dependencies.

A service builds its metric families on its own loop thread (``Service.publish_metrics``,
once a second) and the HTTP thread serves the last snapshot, so scraping never touches the
loop's live dictionaries. Opt-in: ``metrics_port`` (0 = off), bound to ``metrics_host``
(127.0.0.1 by default).
"""
from __future__ import annotations

import bisect
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Iterable, Optional

log = logging.getLogger(__name__)

# request handling time, seconds: the loop serves most requests in 20 µs .. 5 ms
BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
           0.1, 0.25, 0.5, 1.0)


class Histogram:
    __slots__ = ("counts", "total", "n")

    def __init__(self):
        self.counts = [0] * (len(BUCKETS) + 1)
        self.total = 0.0
        self.n = 0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(BUCKETS, seconds)] += 1
        self.total += seconds
        self.n += 1

    def snapshot(self) -> tuple[list[int], float, int]:
        return list(self.counts), self.total, self.n


class Family:
    """One metric family: name, type, help, samples of (labels, value)."""

    def __init__(self, name: str, kind: str, help_: str):
        self.name, self.kind, self.help = name, kind, help_
        self.samples: list[tuple[dict, object]] = []

    def add(self, value, **labels) -> "Family":
        self.samples.append((labels, value))
        return self


def gauge(name: str, help_: str, value=None, **labels) -> Family:
    f = Family(name, "gauge", help_)
    return f.add(value, **labels) if value is not None else f


def counter(name: str, help_: str, value=None, **labels) -> Family:
    f = Family(name, "counter", help_)
    return f.add(value, **labels) if value is not None else f


def histogram_family(name: str, help_: str, by_label: str, hists: dict) -> Family:
    f = Family(name, "histogram", help_)
    for label, h in sorted(hists.items()):
        f.add(h.snapshot(), **{by_label: label})
    return f


def _labels(labels: dict, extra: Optional[tuple] = None) -> str:
    items = list(labels.items()) + ([extra] if extra else [])
    if not items:
        return ""
    body = ",".join(f'{k}="{str(v).replace(chr(92), chr(92) * 2).replace(chr(34), chr(92) + chr(34))}"'
                    for k, v in items)
    return "{" + body + "}"


def _num(value) -> str:
    if isinstance(value, bool):
        return str(int(value))
    return str(value) if isinstance(value, int) else repr(float(value))


def render(families: Iterable[Family]) -> str:
    out = []
    for f in families:
        out.append(f"# HELP {f.name} {f.help}")
        out.append(f"# TYPE {f.name} {f.kind}")
        for labels, value in f.samples:
            if f.kind == "histogram":
                counts, total, n = value
                acc = 0
                for le, c in zip(list(BUCKETS) + ["+Inf"], counts):
                    acc += c
                    out.append(f"{f.name}_bucket{_labels(labels, ('le', le))} {acc}")
                out.append(f"{f.name}_sum{_labels(labels)} {total}")
                out.append(f"{f.name}_count{_labels(labels)} {n}")
            else:
                out.append(f"{f.name}{_labels(labels)} {_num(value)}")
    return "\n".join(out) + "\n"


class MetricsServer:
    """``GET /metrics`` on a daemon thread, serving what ``source()`` returns (text)."""

    def __init__(self, host: str, port: int, source: Callable[[], str]):
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                if self.path.split("?")[0] != "/metrics":
                    self.send_error(404, "only /metrics is served here")
                    return
                body = source().encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):  # scrapes are not news
                pass

        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="metrics", daemon=True)
        self.thread.start()
        log.info("metrics on http://%s:%d/metrics", host, self.port)

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
