"""The conductor's Prometheus metrics (``GET /metrics``), through prometheus_client.

Counters and histograms are updated as requests pass; the fleet's state (each worker's
health, load and event stream, the block index's size and bytes per block) is read when
scraped, by a collector, on the conductor's loop, which owns that state.
"""
from __future__ import annotations

from typing import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric

from .. import __version__

P = "hicache_mc_conductor_"
# TTFTs of interactive serving: 10 ms .. 30 s
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0)
# the conductor's own time per request (parse, tokenize, decide): 20 µs .. 50 ms
OVERHEAD_BUCKETS = (0.00002, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05)
ERROR_BUCKETS = (-8.0, -2.0, -1.0, -0.5, -0.25, -0.1, -0.05, 0.0, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 8.0)


class Metrics:
    def __init__(self, state: Callable[[], Iterable[Metric]]):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(P + "requests", "Requests answered, by endpoint and outcome",
                                ["endpoint", "outcome"], registry=r)
        self.decisions = Counter(P + "decisions", "Requests sent to a worker (retries count again)",
                                 ["worker"], registry=r)
        self.rejections = Counter(P + "rejections", "Requests answered 429, by reason",
                                  ["reason"], registry=r)
        self.late = Counter(P + "late", "Requests late on every worker, sent to the longest "
                            "queue (admission off, triage on)", ["worker"], registry=r)
        self.retries = Counter(P + "retries", "Requests sent elsewhere after a worker failed them "
                               "before they started", ["worker"], registry=r)
        self.unroutable = Counter(P + "unroutable", "Requests routed on load alone: their prompt "
                                  "could not be tokenized as SGLang does", ["why"], registry=r)
        self.predicted = Histogram(P + "predicted_ttft_seconds", "Predicted TTFT of routed requests",
                                   ["worker"], buckets=TTFT_BUCKETS, registry=r)
        self.actual = Histogram(P + "ttft_seconds", "TTFT of streamed requests (request sent to "
                                "first bytes back) or as the worker reported it", ["worker"],
                                buckets=TTFT_BUCKETS, registry=r)
        self.error = Histogram(P + "ttft_error_seconds", "Actual minus predicted TTFT",
                               buckets=ERROR_BUCKETS, registry=r)
        self.overhead = Histogram(P + "overhead_seconds", "The conductor's time from a request's "
                                  "arrival to its forwarding (parse, tokenize, decide)",
                                  buckets=OVERHEAD_BUCKETS, registry=r)
        self.predicted_pages = Counter(P + "predicted_pages", "Prompt pages predicted to come from "
                                       "each tier at the chosen worker", ["tier"], registry=r)
        self.cached_tokens = Counter(P + "cached_tokens", "Prompt tokens the workers reported as "
                                     "served from each tier", ["tier"], registry=r)
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prompt tokens of finished requests",
                                     registry=r)
        r.register(_State(state))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _State:
    def __init__(self, state: Callable[[], Iterable[Metric]]):
        self.state = state

    def collect(self):
        yield _info()
        yield from self.state()


def _info() -> GaugeMetricFamily:
    g = GaugeMetricFamily(P + "build_info", "The running hicache-mc version", labels=["version"])
    g.add_metric([__version__], 1)
    return g


def gauge(name: str, help_: str, labels: list[str], rows: Iterable[tuple]) -> GaugeMetricFamily:
    """A gauge family from ``(label values..., value)`` rows."""
    g = GaugeMetricFamily(P + name, help_, labels=labels)
    for row in rows:
        g.add_metric([str(v) for v in row[:-1]], float(row[-1]))
    return g
