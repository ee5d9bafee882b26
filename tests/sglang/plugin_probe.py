"""Run by tests/sglang/test_install.py with the Python of a virtual environment that has
hicache-mc installed; prints what SGLang's own code made of it, as JSON. Argument: a master."""
from __future__ import annotations

import importlib.metadata as md
import json
import os
import sys

from sglang_env import apply_torchvision_stub

apply_torchvision_stub()
os.environ.pop("SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY", None)
os.environ.pop("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", None)

import sglang.launch_server  # noqa: E402
from sglang.cli.main import main as sglang_cli  # noqa: E402

MASTER = sys.argv[1]
SERVER_ARGS = ["--model-path", "/nonexistent/never-loaded", "--enable-hierarchical-cache",
               "--hicache-storage-backend", "hicache_mc", "--encoder-only",
               "--enable-mm-global-cache", "--mm-global-cache-backend", "hicache_mc",
               "--hicache-storage-backend-extra-config",
               json.dumps({"master": MASTER, "timeout_s": 2.0, "prefetch_threshold": 64})]
out: dict = {"entry_points": sorted(f"{ep.name} = {ep.value} ({ep.dist.name})"
                                    for ep in md.entry_points(group="sglang.srt.plugins"))}


def serve(argv: list[str]):
    """``sglang serve ARGV`` up to the server: SGLang's CLI loads the plugins and parses."""
    seen = []
    sglang.launch_server.run_server = seen.append
    sys.argv = ["sglang", "serve", "--model-type", "llm", *argv]
    sglang_cli()
    return seen[0]


args = serve(SERVER_ARGS)
out["serve"] = [args.hicache_storage_backend, args.mm_global_cache_backend]
try:
    serve(SERVER_ARGS[:-3] + ["bogus"])
    out["bogus"] = "accepted"
except SystemExit as exc:
    out["bogus"] = f"exit {exc.code}"

from sglang.srt.mem_cache.embedding_store import EmbeddingStoreFactory  # noqa: E402
from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController  # noqa: E402
from sglang.srt.plugins.hook_registry import HookRegistry  # noqa: E402

import hicache_mc  # noqa: E402
from hicache_mc.sglang import plugin  # noqa: E402
from controllers import attached_controller  # noqa: E402

out["hicache_mc"] = hicache_mc.__file__
out["hooked"] = sorted({h.target for h in plugin.HOOKS} & HookRegistry._patched)

extra, threshold, *_ = HybridCacheController.parse_storage_backend_extra_config(
    args.hicache_storage_backend_extra_config)
out["threshold"] = threshold
for name, cfg in (("kv", extra), ("kv_interface_v1_0", {**extra, "interface_v1": 0})):
    ctl = attached_controller(args.hicache_storage_backend, cfg)
    b = ctl.storage_backend
    out[name] = [f"{type(b).__module__}.{type(b).__name__}", b.client_config.master,
                 ctl.page_get_func.__name__, ctl.page_set_func.__name__]
    ctl.storage_backend.close()

os.environ.update(HICACHE_MC_MASTER=MASTER, HICACHE_MC_MODEL_NAME="test/vlm")
store = EmbeddingStoreFactory.create_backend(args.mm_global_cache_backend)
out["embedding_store"] = f"{type(store).__module__}.{type(store).__name__}"
store.close()
print("PROBE " + json.dumps(out), flush=True)
os._exit(0)     # the controllers' storage threads are not daemon threads
