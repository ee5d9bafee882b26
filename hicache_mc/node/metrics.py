"""A storage node's Prometheus metric families, from its stats (see hicache_mc/metrics.py)."""
from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..metrics import histogram_family


def node_families(node: str, st: dict, rejected: dict, latency: dict) -> list:
    fams = []
    gauges = {"capacity": ("dram_capacity_bytes", "DRAM tier capacity"),
              "used": ("dram_used_bytes", "DRAM tier bytes in use"),
              "objects": ("dram_objects", "objects in the DRAM tier"),
              "ssd_capacity": ("ssd_capacity_bytes", "SSD tier capacity"),
              "ssd_used": ("ssd_used_bytes", "SSD tier bytes on disk"),
              "ssd_live": ("ssd_live_bytes", "SSD tier bytes of live records"),
              "ssd_objects": ("ssd_objects", "objects in the SSD tier"),
              "objects_total": ("objects", "objects on this node, any tier")}
    for key, (name, help_) in gauges.items():
        if key in st:
            fams.append(GaugeMetricFamily(f"hicache_mc_node_{name}", help_, labels=["node"]))
            fams[-1].add_metric([node], st[key])
    fams.append(GaugeMetricFamily("hicache_mc_node_degraded", "1 while a tier of the node is "
                                  "unusable (its stats' degraded says why)", labels=["node"]))
    fams[-1].add_metric([node], 1 if st.get("degraded") else 0)
    counters = {"evictions": "objects evicted from DRAM", "reads": "keys asked for",
                "read_hits": "keys served", "writes": "objects committed",
                "bytes_in": "object bytes written",
                "ssd_demotions": "objects demoted to SSD", "ssd_promotions": "objects staged back into DRAM",
                "ssd_compactions": "SSD segments compacted", "ssd_evictions": "records evicted from SSD",
                "ssd_corrupt": "damaged SSD records found (checksum failures)",
                "ssd_write_errors": "failed SSD writes",
                "stream_reads": "objects read through the stream port",
                "stream_writes": "objects written through the stream port",
                "stream_refused": "stream-port requests refused (bad header or range)",
                "stream_cut": "stream-port transfers cut because their lease or reservation ended",
                "stream_auth_failed": "stream-port peers refused at the handshake (wrong token)",
                "stream_auth_timeout": "stream-port peers that did not answer the handshake in time",
                "stream_shed": "stream-port peers dropped to make room (connection caps)"}
    for key, help_ in counters.items():
        if key in st:
            fams.append(CounterMetricFamily(f"hicache_mc_node_{key}_total", help_, labels=["node"]))
            fams[-1].add_metric([node], st[key])
    refusals = CounterMetricFamily("hicache_mc_node_rejected_total", "error replies to bad requests, per code",
                                   labels=["code", "node"])
    for code, n in rejected.items():
        refusals.add_metric([code, node], n)
    fams += [refusals, histogram_family("hicache_mc_node_request_seconds", "request handling time",
                                        "type", latency)]
    return fams
