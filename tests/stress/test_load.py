"""Load: client processes x threads of SGLang-shaped traffic against a master and two nodes.

Every page read back is compared with the bytes its key implies; the run reports ops/s,
p50/p99 and the hit rate, and fails on any wrong page, client exception, hang or call that
outlived its deadline.
"""
import pytest

from harness import (LONG_PROFILE, Load, acked_keys, assert_healthy, profile_dict, readable, record,
                     summarize, timeline)

TIMEOUT_S = max(300, int(LONG_PROFILE.seconds * 2 + 120))


@pytest.mark.timeout(TIMEOUT_S)
def test_load_two_nodes(scluster, profile, tmp_path):
    scluster.start_master()
    scluster.add_node(dram=profile.node_dram)
    scluster.add_node(dram=profile.node_dram)
    scluster.wait_nodes(2)
    load = Load(scluster.master, profile, tmp_path, tag="load")
    try:
        load.start()
        results = load.finish()
    finally:
        load.stop()
    summary = summarize(results, load.seconds)
    print(f"\n[{profile.name}] load: {summary}")
    assert_healthy(results, summary, profile)
    assert all(p.alive for p in scluster.procs())
    assert summary["hit_rate"] > 0.3, summary             # shared prefixes are found again
    # No fault and nothing evicted, so a failed put is a timeout: a starved shared machine. Three
    # in a row open a client's circuit, and its puts then fail at once until it closes, so a
    # few timeouts weigh heavily; a systematic failure would be near 0.
    assert summary["put_ok_rate"] > 0.5, summary
    assert summary["get_hit_rate"] > 0.98, summary
    st = scluster.stats()
    assert all(n.get("evictions", 0) == 0 for n in st["nodes"]), st["nodes"]
    assert all(n.get("objects", 0) > 0 for n in st["nodes"]), "placement used one node only"
    # nothing was evicted, so every acknowledged object is still there, byte for byte
    missing, wrong = readable(scluster.master, acked_keys(results), profile.page_size, timeout_s=5)
    assert not wrong and not missing, (len(missing), wrong[:5])
    record("load", {"profile": profile_dict(profile), "summary": summary, "timeline": timeline(results),
                    "store": {"keys": st["keys"], "nodes": [{k: n.get(k) for k in ("objects", "used", "evictions")}
                                                             for n in st["nodes"]]}},
           command="HICACHE_MC_STRESS_LONG=1 .venv/bin/pytest tests/stress -m slow")
