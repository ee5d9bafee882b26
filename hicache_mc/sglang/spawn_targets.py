"""SGLang processes that load no plugins get them from the process that starts them.

SGLang 0.5.23 calls ``load_plugins()`` in its launcher, schedulers, detokenizer and DP
controller. An encoder (``--encoder-only``) with ``--tp-size`` or ``--dp-size`` above 1 starts
its other ranks with multiprocessing ``spawn``, from functions that never do: there
``--mm-global-cache-backend hicache_mc`` would be unknown ("Unknown embedding store backend").

Where SGLang names such a function as the spawn target, the plugin, loaded in the launcher,
puts a ``PluginsFirst`` in its place (``install``). ``spawn`` pickles the target: a
``PluginsFirst`` pickles as its module and name only, so the new process unpickles one without
the function, and when called it loads SGLang's plugins (hicache-mc's through its entry point,
as in any SGLang process) before it looks SGLang's function up and runs it.
"""
from __future__ import annotations

import importlib
from types import ModuleType
from typing import Callable, Optional

# (module, name) of the spawn targets in SGLang 0.5.23's encoder: its TP ranks 1.. behind the
# HTTP server, its DP ranks, its TP ranks 1.. behind the gRPC server.
ENCODER_WORKERS = (("sglang.srt.disaggregation.encoder.runtime", "launch_encoder"),
                   ("sglang.srt.disaggregation.encoder.runtime", "launch_dp_worker"),
                   ("sglang.srt.disaggregation.encoder.grpc_server", "launch_encoder"))


class PluginsFirst:
    """Stands for ``module.name``: calls ``original`` where it was installed; in a process
    that unpickled it, loads SGLang's plugins, then calls the function found there."""

    def __init__(self, module: str, name: str, original: Optional[Callable] = None):
        self.module, self.name, self.original = module, name, original

    def __reduce__(self):
        return PluginsFirst, (self.module, self.name)

    def __repr__(self) -> str:
        return f"PluginsFirst({self.module}:{self.name})"

    def __call__(self, *args, **kwargs):
        if self.original is None:
            from sglang.srt.plugins import load_plugins
            load_plugins()
            found = getattr(importlib.import_module(self.module), self.name)
            if isinstance(found, PluginsFirst):     # hicache-mc's plugin installed it here too
                found = found.original
            if found is None:
                raise RuntimeError(f"{self!r}: {self.module}.{self.name} is not a function here")
            self.original = found
        return self.original(*args, **kwargs)


def install(name: str, module: ModuleType) -> None:
    """``module.name`` becomes a ``PluginsFirst`` standing for it (once)."""
    current = getattr(module, name, None)
    if callable(current) and not isinstance(current, PluginsFirst):
        setattr(module, name, PluginsFirst(module.__name__, name, current))
