"""benchmarks/bench_sglang_hybrid.py end to end at a tiny shape: every system runs every call and
its loads check out byte for byte (the benchmark asserts that itself); no timing is asserted."""
from __future__ import annotations

import importlib.util
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import bench_sglang_hybrid  # noqa: E402
import common  # noqa: E402


def test_every_system_every_call(tmp_path, monkeypatch):
    systems = ["shm", "tcp", "file"]
    if importlib.util.find_spec("mooncake") is not None:
        systems.append("mooncake")
    monkeypatch.setattr(common, "RESULTS", str(tmp_path))    # keep the recorded results intact
    monkeypatch.setattr(sys, "argv", [
        "bench", "--pages", "3", "--states", "2", "--iters", "1", "--attn-layers", "2",
        "--mamba-layers", "2", "--v-heads", "2", "--conv-dim", "64", "--file-dir", str(tmp_path),
        "--systems", ",".join(systems)])
    bench_sglang_hybrid.main()
    doc = json.load(open(tmp_path / "bench_sglang_hybrid.json"))
    names = {"shm": "hicache-mc (shm)", "tcp": "hicache-mc (tcp)"}
    want = {names.get(s, s) for s in systems}
    assert set(doc["seconds"]) == want
    for r in doc["rows"]:
        assert (r.get("gbps") or r.get("ms")) > 0, r
    totals = {(r["op"], r["system"]) for r in doc["rows"] if r["call"] == "total"}
    assert ("prefetch", "file (cold)") in totals
    assert {s for op, s in totals if op == "backup"} == want
    ratios = {"x_file", "x_file_cold"} | ({"x_mooncake"} if "mooncake" in systems else set())
    for r in doc["rows"]:
        if r["op"] == "prefetch" and r["system"].startswith("hicache-mc"):
            assert ratios <= set(r), r
    # per transport: backup x_file, prefetch x_file and x_file_cold, and x_mooncake of both
    assert len(doc["targets"]) == 2 * (5 if "mooncake" in systems else 3)
