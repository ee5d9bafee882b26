"""``python -m hicache_mc.sglang.launch_server [SGLang's launch_server arguments]``

SGLang's own ``launch_server``, with hicache-mc known to it by the name ``hicache_mc``:

- ``--hicache-storage-backend hicache_mc``: the KV backend. SGLang 0.5.23 builds a registered
  backend only if its name is on a closed list (``_create_builtin_backend`` raises for any
  other), and turns the zero-copy path on by name, or by ``interface_v1`` for ``dynamic``. So the
  name becomes ``dynamic`` and ``backend_name`` / ``module_path`` / ``class_name`` /
  ``interface_v1`` join the extra config (keys the user gave win): what docs/sglang.md spells out
  by hand, through the same factory.
- ``--mm-global-cache-backend hicache_mc`` (with ``--enable-mm-global-cache``): registered in
  ``EmbeddingStoreFactory``, which has no dynamic loader.

Both names join the CLI's choices. ``register()`` runs at import, so SGLang's worker processes,
started by multiprocessing with ``spawn`` (which imports this ``__main__`` module again, as
``__mp_main__``), have the registration too. ``--hicache-mc-check`` prints what would run, checks
the registration here and in a spawned process, and exits without starting a model.
"""
from __future__ import annotations

import json
import multiprocessing
import os
import sys
from typing import Any, Optional

from sglang.srt.mem_cache.embedding_store import EmbeddingStoreFactory
from sglang.srt.server_args import ServerArgs

NAME = "hicache_mc"
EMBEDDING_STORE = ("hicache_mc.sglang.embedding_store", "HiCacheMCEmbeddingStore")
KV_DYNAMIC = {"backend_name": NAME, "module_path": "hicache_mc.sglang", "class_name": "HiCacheMC",
              "interface_v1": 1}
CLI_FIELDS = ("hicache_storage_backend", "mm_global_cache_backend")
CHECK_FLAG = "--hicache-mc-check"


def register() -> None:
    """Make ``hicache_mc`` a choice of both CLI flags and an EmbeddingStoreFactory backend
    (idempotent: the factory warns on every re-registration)."""
    entry = EmbeddingStoreFactory._registry.get(NAME, {})
    if (entry.get("module_path"), entry.get("class_name")) != EMBEDDING_STORE:
        EmbeddingStoreFactory.register_backend(NAME, *EMBEDDING_STORE)
    add_cli_args = ServerArgs.add_cli_args
    if getattr(add_cli_args, "hicache_mc", False):
        return

    def with_hicache_mc(parser):
        # The choices live in per-field Arg(...) annotations that are rebuilt on every parse,
        # so they are extended on the parser SGLang has just built.
        add_cli_args(parser)
        for action in parser._actions:
            choices = action.choices
            if action.dest in CLI_FIELDS and choices is not None and NAME not in choices:
                action.choices = [*choices, NAME]
    with_hicache_mc.hicache_mc = True
    ServerArgs.add_cli_args = staticmethod(with_hicache_mc)


def read_extra_config(value: Optional[str]) -> dict:
    """``--hicache-storage-backend-extra-config``: JSON, or ``@file`` (.json, .toml, .yaml)."""
    if not value:
        return {}
    if value.startswith("@"):
        path = value[1:]
        ext = os.path.splitext(path)[1].lower()
        with open(path, "rb") as f:
            if ext == ".json":
                doc = json.load(f)
            elif ext == ".toml":
                import tomllib
                doc = tomllib.load(f)
            elif ext in (".yaml", ".yml"):
                import yaml
                doc = yaml.safe_load(f)
            else:
                raise ValueError(f"--hicache-storage-backend-extra-config {path}: "
                                 f"use .json, .toml or .yaml")
    else:
        doc = json.loads(value)
    if not isinstance(doc, dict):
        raise ValueError("--hicache-storage-backend-extra-config must hold an object")
    return doc


def resolve_kv_backend(server_args: Any) -> None:
    """``--hicache-storage-backend hicache_mc`` -> ``dynamic`` with the factory keys added."""
    if server_args.hicache_storage_backend != NAME:
        return
    extra = {**KV_DYNAMIC, **read_extra_config(server_args.hicache_storage_backend_extra_config)}
    server_args.hicache_storage_backend = "dynamic"
    server_args.hicache_storage_backend_extra_config = json.dumps(extra)


def prepare(argv: list[str]) -> ServerArgs:
    """SGLang's server args from ``argv``, with hicache-mc's names resolved."""
    from sglang.srt.server_args import prepare_server_args
    register()
    server_args = prepare_server_args(argv)
    resolve_kv_backend(server_args)
    return server_args


def registered_here() -> dict:
    """What this process's factories know of hicache-mc (run in a spawned worker by the check)."""
    entry = EmbeddingStoreFactory._registry.get(NAME)
    cls = entry["loader"]() if entry else None
    return {"embedding_store": f"{cls.__module__}.{cls.__name__}" if cls else None}


def check(server_args: ServerArgs) -> int:
    """Print what would run; confirm the registration here and in a ``spawn`` worker."""
    print(f"KV backend: {server_args.hicache_storage_backend} "
          f"{server_args.hicache_storage_backend_extra_config or ''}".rstrip())
    print(f"embedding store: {server_args.mm_global_cache_backend} "
          f"(--enable-mm-global-cache {'on' if server_args.enable_mm_global_cache else 'off'})")
    here = registered_here()
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        worker = pool.apply(registered_here)
    print(f"registered here: {here}; in a spawned worker: {worker}")
    return 0 if here == worker and here["embedding_store"] else 1


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    from sglang.srt.plugins import load_plugins
    load_plugins()
    dry = CHECK_FLAG in argv
    server_args = prepare([a for a in argv if a != CHECK_FLAG])
    if dry:
        return check(server_args)
    from sglang.launch_server import run_server
    from sglang.srt.utils import kill_process_tree
    try:
        run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)
    return 0


register()

if __name__ == "__main__":
    sys.exit(main())
