"""hicache-mc as an SGLang plugin: ``--hicache-storage-backend hicache_mc`` and
``--mm-global-cache-backend hicache_mc`` on plain ``python -m sglang.launch_server`` / ``sglang serve``.

SGLang 0.5.23 runs every entry point of the ``sglang.srt.plugins`` group before it parses its
arguments, in the launching process and again in each scheduler, detokenizer and DP-controller
process (``load_plugins``, then ``HookRegistry.apply_hooks``). hicache-mc declares ``load``
there (pyproject.toml). It registers both backends with SGLang's factories and five hooks, each
a pass-through for other backends:

- ``ServerArgs.add_cli_args``: ``hicache_mc`` joins the choices of both flags (closed lists).
- ``StorageBackendFactory._create_builtin_backend``: builds ``HiCacheMC(storage_config, {})``;
  the factory builds registered names from its own closed list and raises for any other.
- ``HiCacheController.attach_storage_backend``: selects the zero-copy page path
  (``batch_get_v1`` / ``batch_set_v1``), which SGLang selects by name, or for ``dynamic`` by
  ``interface_v1``; ``"interface_v1": 0`` in the extra config keeps the generic path.
- ``HybridCacheController.should_backup``: in an MLA model SGLang backs side pools up on the
  writer rank only (but Mamba state, and for ``mooncake`` MHA drafts). HiCacheMC keys a pool
  per rank where each rank holds its own bytes (``SidePool.shared_by_tp`` False: Mamba state,
  MHA pools such as an EAGLE draft over an MLA target), so every rank backs those up; else the
  other ranks would miss that pool and SGLang, taking the minimum over ranks, every hit.
- ``HybridCacheController.attach_storage_backend``: SGLang registers the side pools after the
  base attach has started the storage threads, outside that attach's rollback; a pool HiCacheMC
  refuses would leave the controller attached with its threads running. The hook detaches
  before the error goes up, so SGLang is attached fully or not at all.

SGLang's registry resolves a target when the plugins load and never again, so a hook whose
module could not be imported then would stay off in that process. ``load`` registers each hook
with SGLang's ``HookRegistry`` when its module has been imported (``post_import``): at once if
it is (``load_plugins`` applies it with the other plugins' hooks), else right after Python has
run that module (and applies it then), whatever the process imported first and without
importing SGLang's cache modules where nothing uses them. It also puts ``PluginsFirst`` in
place of the spawn targets of SGLang's encoder, whose TP and DP workers load no plugins
(``spawn_targets``).

Settings: the KV backend reads ``--hicache-storage-backend-extra-config`` (JSON or ``@file``,
parsed by SGLang) over ``HICACHE_MC_*``; the embedding store, which SGLang creates without
arguments, reads ``HICACHE_MC_*``. ``SGLANG_PLUGINS``, when set, must name ``hicache_mc``.
"""
from __future__ import annotations

import logging
from functools import partial
from typing import Callable, NamedTuple

from . import spawn_targets
from .post_import import executed, when_imported

logger = logging.getLogger("hicache_mc.sglang")
NAME = "hicache_mc"
DIST = "hicache-mc"
KV_BACKEND = ("hicache_mc.sglang", "HiCacheMC")
EMBEDDING_STORE = ("hicache_mc.sglang.embedding_store", "HiCacheMCEmbeddingStore")
CLI_FIELDS = ("hicache_storage_backend", "mm_global_cache_backend")
_hooks_registered = False


class Hook(NamedTuple):
    """One hook: SGLang's ``module.attribute`` wrapped by ``function`` (a ``HookType`` name)."""
    module: str
    attribute: str
    kind: str
    function: Callable

    @property
    def target(self) -> str:
        return f"{self.module}.{self.attribute}"


def register_backends() -> None:
    """Both factories know ``hicache_mc`` (idempotent: they warn on every re-registration)."""
    from sglang.srt.mem_cache.embedding_store import EmbeddingStoreFactory
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
    for factory, (module_path, class_name) in ((StorageBackendFactory, KV_BACKEND),
                                               (EmbeddingStoreFactory, EMBEDDING_STORE)):
        entry = factory._registry.get(NAME, {})
        if (entry.get("module_path"), entry.get("class_name")) != (module_path, class_name):
            factory.register_backend(NAME, module_path, class_name)


def load() -> None:
    """The entry point: both factories, then each hook as its module arrives, and the
    encoder's spawn targets."""
    global _hooks_registered
    register_backends()
    if _hooks_registered:
        return
    _hooks_registered = True
    for hook in HOOKS:
        if executed(hook.module):
            _register(hook)             # load_plugins applies it with the other plugins' hooks
        else:
            when_imported(hook.module, partial(_register_late, hook))
    for module, name in spawn_targets.ENCODER_WORKERS:
        when_imported(module, partial(spawn_targets.install, name))


def _register(hook: Hook) -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookSource, HookType
    HookRegistry.register(hook.target, hook.function, HookType[hook.kind],
                          source=HookSource(plugin_name=NAME, dist_name=DIST))


def _register_late(hook: Hook, _module) -> None:
    """The module arrived after ``load_plugins`` applied the hooks: apply this one now (the
    registry skips every target it has patched already)."""
    from sglang.srt.plugins.hook_registry import HookRegistry
    _register(hook)
    HookRegistry.apply_hooks()


def _add_choices(_result, parser) -> None:
    # The choices live in per-field annotations rebuilt on every parse, so they are extended
    # on the parser SGLang has just built.
    for action in parser._actions:
        if action.dest in CLI_FIELDS and action.choices is not None and NAME not in action.choices:
            action.choices = [*action.choices, NAME]


def _create(original, cls, backend_name, backend_class, storage_config, *args, **kwargs):
    if backend_name == NAME:
        return backend_class(storage_config, {})
    return original(cls, backend_name, backend_class, storage_config, *args, **kwargs)


def _zero_copy(_result, controller, *args, **kwargs) -> None:
    if controller.storage_backend_type != NAME:
        return
    extra = getattr(controller.storage_config, "extra_config", None) or {}
    zero_copy = bool(extra.get("interface_v1", 1))
    if zero_copy:
        controller.page_get_func = controller._page_get_zero_copy
        controller.page_set_func = controller._page_set_zero_copy
    logger.info("hicache_mc: SGLang's page path: %s", "zero-copy (batch_get_v1 / batch_set_v1)"
                if zero_copy else "generic (batch_get / batch_set; interface_v1 0)")


def _backup_per_rank(original, controller, transfer) -> bool:
    if original(controller, transfer):
        return True
    side = getattr(getattr(controller, "storage_backend", None), "side_pools", {}).get(
        str(transfer.name))
    from .hybrid import HybridPools
    return isinstance(controller.storage_backend, HybridPools) and side is not None \
        and not side.shared_by_tp


def _attach_or_roll_back(original, controller, *args, **kwargs):
    try:
        return original(controller, *args, **kwargs)
    except Exception:
        from .hybrid import HybridPools
        if controller.enable_storage and isinstance(controller.storage_backend, HybridPools):
            controller.detach_storage_backend()     # threads stopped, HiCacheMC closed
        raise


# below the functions it names
HOOKS = (Hook("sglang.srt.server_args", "ServerArgs.add_cli_args", "AFTER", _add_choices),
         Hook("sglang.srt.mem_cache.storage.backend_factory",
              "StorageBackendFactory._create_builtin_backend", "AROUND", _create),
         Hook("sglang.srt.managers.cache_controller", "HiCacheController.attach_storage_backend",
              "AFTER", _zero_copy),
         Hook("sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller",
              "HybridCacheController.should_backup", "AROUND", _backup_per_rank),
         Hook("sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller",
              "HybridCacheController.attach_storage_backend", "AROUND", _attach_or_roll_back))
