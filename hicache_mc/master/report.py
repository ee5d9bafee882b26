"""What the master reports: its stats (``StatsRequest``) and its Prometheus metric families,
built from the service's state on its loop thread."""
from __future__ import annotations

import time

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .. import __version__
from ..metrics import histogram_family

KEY_ROWS = 256          # tenants with a keys-per-tenant metric row of their own


def stats(m, peer) -> dict:
    """The cluster's stats as ``peer`` may see them: an admin all, a client the nodes and its
    own tenant's figures."""
    now = time.monotonic()
    nodes = []
    for st in m.registry.nodes.values():
        nodes.append({**st.info.to_dict(), **st.stats, "age_s": round(now - st.last_seen, 3)})
    tenants: dict[str, dict] = {t: {"used": 0, "quota": q} for t, q in m.quotas.items()}
    for st in m.registry.nodes.values():
        for t, used in st.stats.get("tenants", {}).items():
            tenants.setdefault(t, {"used": 0, "quota": None})["used"] += int(used)
    for t, n in m.index.tenant_keys.items():
        tenants.setdefault(t, {"used": 0, "quota": None})["keys"] = n
    for t, row in tenants.items():
        row.setdefault("keys", 0)
        row["key_limit"] = m.key_limits.get(t, m.key_limits.get("*"))
    if peer.role != "admin":   # a client sees the nodes and its own tenant's figures
        tenants = {t: v for t, v in tenants.items() if t == peer.tenant}
        nodes = [{k: v for k, v in n.items() if k != "tenants"} for n in nodes]
    stats = {"epoch": m.epoch, "version": __version__, "keys": len(m.index), "nodes": nodes, "tenants": tenants,
             "capacity": sum(st.info.capacity for st in m.registry.nodes.values()),
             "used": sum(int(st.stats.get("used", 0)) for st in m.registry.nodes.values()),
             "lost": m.registry.lost_nodes(now), "expect_nodes": m.config.expect_nodes,
             "publish_port": m.publisher.port if m.publisher else -1,
             **m.counters, **(m.publisher.counters if m.publisher else {}),
             "rejected": dict(m.rejected), "unsent": dict(m.unsent),
             "backlog": m.backlog.requests, "connections": len(m.connections),
             "residency_namespaces": m.publisher.namespaces if m.publisher else 0,
             "connections_refused": m.connections.refused}
    return stats


def families(m) -> list:
    """The master's metric families (see hicache_mc/metrics.py)."""
    now = time.monotonic()
    nodes = list(m.registry.nodes.values())
    fams = [GaugeMetricFamily("hicache_mc_master_keys", "keys in the master index", len(m.index)),
            GaugeMetricFamily("hicache_mc_master_nodes", "live storage nodes", len(nodes)),
            GaugeMetricFamily("hicache_mc_master_nodes_expected", "storage nodes the cluster "
                              "should have (expect_nodes; 0: any)", m.config.expect_nodes),
            GaugeMetricFamily("hicache_mc_master_nodes_lost", "nodes that missed their "
                              "heartbeats in the last hour and have not registered again",
                              len(m.registry.lost_nodes(now)))]
    live = GaugeMetricFamily("hicache_mc_node_heartbeat_age_seconds",
                             "seconds since each node's last heartbeat", labels=["node"])
    cap = GaugeMetricFamily("hicache_mc_node_capacity_bytes", "DRAM capacity per node", labels=["node"])
    used = GaugeMetricFamily("hicache_mc_node_used_bytes", "DRAM bytes in use per node", labels=["node"])
    for st in nodes:
        live.add_metric([st.info.node_id], round(now - st.last_seen, 3))
        cap.add_metric([st.info.node_id], st.info.capacity)
        used.add_metric([st.info.node_id], int(st.stats.get("used", 0)))
    fams += [live, cap, used]
    for name, value in {**m.counters, **(m.publisher.counters if m.publisher else {})}.items():
        fams.append(CounterMetricFamily(f"hicache_mc_master_{name}_total",
                                        f"master {name.replace('_', ' ')}", value))
    hits = CounterMetricFamily("hicache_mc_lookup_hits_total", "keys found by Locate, per key namespace",
                               labels=["namespace"])
    misses = CounterMetricFamily("hicache_mc_lookup_misses_total",
                                 "keys not found by Locate, per key namespace", labels=["namespace"])
    for ns, (found, missed) in m.by_namespace.rows.items():
        hits.add_metric([ns], found)
        misses.add_metric([ns], missed)
    rejected = CounterMetricFamily("hicache_mc_master_rejected_total",
                                   "error replies to bad requests, per code", labels=["code"])
    for code, n in m.rejected.items():
        rejected.add_metric([code], n)
    used_f = GaugeMetricFamily("hicache_mc_tenant_used_bytes", "bytes held per tenant, all nodes",
                               labels=["tenant", "node"])
    quota_f = GaugeMetricFamily("hicache_mc_tenant_quota_bytes", "quota per tenant", labels=["tenant"])
    for st in nodes:
        for t, used_bytes in st.stats.get("tenants", {}).items():
            used_f.add_metric([t, st.info.node_id], int(used_bytes))
    for t, q in m.quotas.items():
        quota_f.add_metric([t], q)
    keys_f = GaugeMetricFamily("hicache_mc_tenant_keys", "keys in the master's index per tenant "
                               f"(the {KEY_ROWS} with most; the rest as (other))", labels=["tenant"])
    ranked = sorted(m.index.tenant_keys.items(), key=lambda tn: -tn[1])
    for t, n in ranked[:KEY_ROWS]:
        keys_f.add_metric([t], n)
    if len(ranked) > KEY_ROWS:
        keys_f.add_metric(["(other)"], sum(n for _, n in ranked[KEY_ROWS:]))
    fams += [hits, misses, rejected, used_f, quota_f, keys_f,
             histogram_family("hicache_mc_master_request_seconds", "request handling time",
                              "type", m.latency)]
    return fams
