"""Run by tests/sglang/test_plugin_order.py in a fresh interpreter: SGLang's plugins loaded as
one of SGLang's processes loads them, in the order ``argv[1]`` names; prints what became of
hicache-mc's hooks as JSON on a line that starts with ``PROBE``.

- ``plugins-first``: ``load_plugins()`` while SGLang's cache modules cannot be imported yet (on
  this machine: before the torchvision stub is on ``sys.path``), as a process that imports them
  only later; then they are imported.
- ``scheduler``: as a scheduler process: the module of its spawn target, then ``load_plugins()``.
- ``cache-first``: the cache modules, then ``load_plugins()``.
- ``encoder``: as the launcher of an encoder with more than one TP or DP rank: ``load_plugins()``,
  its runtime module, then a process spawned the way that runtime spawns its other ranks.
"""
from __future__ import annotations

import importlib
import inspect
import json
import multiprocessing
import os
import pickle
import sys

from sglang_env import apply_torchvision_stub

# SGLang functions hicache-mc hooks: (module, class, attribute)
HOOKED = (("sglang.srt.server_args", "ServerArgs", "add_cli_args"),
          ("sglang.srt.mem_cache.storage.backend_factory", "StorageBackendFactory",
           "_create_builtin_backend"),
          ("sglang.srt.managers.cache_controller", "HiCacheController", "attach_storage_backend"),
          ("sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller", "HybridCacheController",
           "should_backup"),
          ("sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller", "HybridCacheController",
           "attach_storage_backend"))
ENCODER = "sglang.srt.disaggregation.encoder"


def load_plugins() -> None:
    from sglang.srt.plugins import load_plugins as sglang_load_plugins
    sglang_load_plugins()


def cache_modules() -> None:
    for module, _, _ in HOOKED:
        importlib.import_module(module)


def hooks() -> dict:
    """Per hooked function, the hicache-mc hook HookRegistry's wrapper calls (None: unhooked)."""
    found = {}
    for module, cls, name in HOOKED:
        fn = vars(getattr(importlib.import_module(module), cls))[name]
        hook = inspect.getclosurevars(getattr(fn, "__func__", fn)).nonlocals.get("hook")
        found[f"{cls}.{name}"] = f"{hook.__module__}.{hook.__name__}" if hook else None
    return found


def controller() -> list:
    """What SGLang's cache controller attaches for ``hicache_mc``, and its page functions."""
    from controllers import attached_controller
    ctl = attached_controller("hicache_mc", {"master": "tcp://127.0.0.1:1", "timeout_s": 1.0})
    backend = ctl.storage_backend
    ctl.storage_backend.close()
    return [f"{type(backend).__module__}.{type(backend).__name__}", ctl.page_get_func.__name__,
            ctl.page_set_func.__name__]


def registered(queue) -> None:
    """In the spawned process: which of SGLang's factories know hicache_mc."""
    from sglang.srt.mem_cache.embedding_store import EmbeddingStoreFactory
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
    queue.put({"embedding_store": "hicache_mc" in EmbeddingStoreFactory._registry,
               "kv_backend": "hicache_mc" in StorageBackendFactory._registry, "pid": os.getpid()})


def encoder() -> dict:
    """The runtime's spawn targets after the launcher loaded plugins, and what a process
    spawned through such a target has registered before its function runs."""
    from hicache_mc.sglang.spawn_targets import PluginsFirst
    runtime = importlib.import_module(f"{ENCODER}.runtime")
    server = importlib.import_module(f"{ENCODER}.server")
    out = {"launch_encoder": runtime.launch_encoder.original is server.launch_encoder,
           "launch_dp_worker": getattr(runtime.launch_dp_worker.original, "__qualname__", None),
           "pickled": [repr(pickle.loads(pickle.dumps(t)))
                       for t in (runtime.launch_encoder, runtime.launch_dp_worker)]}
    ctx = multiprocessing.get_context("spawn")      # as the runtime starts its other ranks
    queue = ctx.Queue()
    worker = ctx.Process(target=PluginsFirst("__main__", "registered"), args=(queue,))
    worker.start()
    out["worker"] = queue.get(timeout=240)
    worker.join(60)
    out["worker_exit"] = worker.exitcode
    return out


def main(order: str) -> dict:
    if order == "plugins-first":
        load_plugins()
        apply_torchvision_stub()
        cache_modules()
    else:
        apply_torchvision_stub()
        if order == "scheduler":
            importlib.import_module("sglang.srt.managers.scheduler")
        elif order == "cache-first":
            cache_modules()
        load_plugins()
    out = {"hooks": hooks(), "controller": controller()}
    if order == "encoder":
        out["encoder"] = encoder()
    return out


if __name__ == "__main__":
    os.environ.pop("SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY", None)
    os.environ.pop("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", None)
    print("PROBE " + json.dumps(main(sys.argv[1])), flush=True)
    os._exit(0)     # the controller's storage threads are not daemon threads
