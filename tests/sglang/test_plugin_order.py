"""hicache-mc's plugin applies its hooks in every SGLang process whatever that process imported
first, and reaches the encoder workers SGLang spawns without loading plugins. Each case runs
plugin_order_probe.py in a fresh interpreter, loading the plugins through SGLang's own
``load_plugins()`` and the installed entry point, as SGLang's processes do."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# a fresh SGLang import per case: about 35 s each on a busy 2-core machine
pytestmark = pytest.mark.timeout(600)
PROBE = Path(__file__).with_name("plugin_order_probe.py")
ENV = {k: v for k, v in os.environ.items()
       if k != "PYTHONPATH" and not k.startswith("SGLANG_TEST_HICACHE_BACKEND_RANDOM_")}
ENV["SGLANG_PLUGINS"] = "hicache_mc"        # this checkout's plugin alone
RUNTIME = "sglang.srt.disaggregation.encoder.runtime"
ZERO_COPY = ["hicache_mc.sglang.backend.HiCacheMC", "_page_get_zero_copy", "_page_set_zero_copy"]


def probe(order: str) -> tuple[dict, str]:
    out = subprocess.run([sys.executable, str(PROBE), order], capture_output=True, text=True,
                         env=ENV, cwd=PROBE.parent, timeout=400)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("PROBE ")), None)
    assert out.returncode == 0 and line, out.stdout[-2000:] + out.stderr[-6000:]
    return json.loads(line[len("PROBE "):]), out.stderr


@pytest.mark.parametrize("order", ["plugins-first", "scheduler", "cache-first"])
def test_hooks_apply_whatever_the_import_order(order):
    """Every hook wraps its SGLang function, and SGLang's controller gets HiCacheMC on the
    zero-copy path, whether the plugins load before or after SGLang's cache modules; SGLang's
    registry logs no failed hook (it did when the plugins came first)."""
    got, stderr = probe(order)
    assert "Failed to apply hooks" not in stderr, stderr[-4000:]
    assert all(h and h.startswith("hicache_mc.sglang.plugin.") for h in got["hooks"].values()), \
        got["hooks"]
    assert got["controller"] == ZERO_COPY


def test_encoder_workers_load_the_plugins():
    """An encoder with --tp-size or --dp-size above 1 spawns its other ranks without loading
    plugins; after the launcher loaded them, both spawn targets of SGLang's encoder runtime
    load them first, and a process spawned that way knows hicache_mc in both factories
    before its function runs."""
    got, stderr = probe("encoder")
    enc = got["encoder"]
    assert enc["launch_encoder"] is True                        # wraps SGLang's own function
    assert enc["launch_dp_worker"] == "launch_dp_worker"
    assert enc["pickled"] == [f"PluginsFirst({RUNTIME}:launch_encoder)",    # by name, no function
                              f"PluginsFirst({RUNTIME}:launch_dp_worker)"]
    assert enc["worker"]["embedding_store"] and enc["worker"]["kv_backend"], enc
    assert enc["worker_exit"] == 0, stderr[-4000:]
    assert got["controller"] == ZERO_COPY
