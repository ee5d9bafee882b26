"""Run a function once a module has been imported: at once if Python has already executed it,
else right after it does, in whichever thread imports it.

SGLang's ``HookRegistry.apply_hooks`` resolves each hook's target when the plugins load and
never tries again: a target whose module cannot be imported at that moment (a circular import,
a dependency that is not importable yet) keeps SGLang's original for the life of the process.
``when_imported`` lets the plugin register a hook when its target module exists, whatever a
process imported first, and without importing SGLang's cache modules into processes that
never use them (the launcher, the detokenizer).

A finder first on ``sys.meta_path`` watches the names asked for: it lets the other finders
find the module, and wraps the loader so that the callbacks run when the module's code has
run. Each callback runs once; one that raises is logged, and the import goes on. A module that
is half-imported when ``when_imported`` is called (by another thread, or further up the
caller's stack) was found before the finder watched it: its callbacks wait for an import that
may never come, and a warning says so. SGLang loads plugins at the start of each process, so
this does not happen there.
"""
from __future__ import annotations

import importlib.abc
import logging
import sys
import threading
from types import ModuleType
from typing import Callable, Optional

log = logging.getLogger("hicache_mc.sglang")
Callback = Callable[[ModuleType], None]

_lock = threading.RLock()
_waiting: dict[str, list[Callback]] = {}


def executed(name: str) -> Optional[ModuleType]:
    """The module ``name`` if its code has run to the end (not while it is being imported)."""
    module = sys.modules.get(name)
    if module is None or getattr(getattr(module, "__spec__", None), "_initializing", False):
        return None
    return module


def when_imported(name: str, callback: Callback) -> None:
    """``callback(module)`` now if ``name`` is imported, else once it has been."""
    with _lock:
        module = executed(name)
        if module is None:
            if name in sys.modules:
                log.warning("hicache_mc: %s is being imported; what waits for it runs only if it "
                            "is imported again", name)
            _waiting.setdefault(name, []).append(callback)
            if not any(isinstance(f, _Finder) for f in sys.meta_path):
                sys.meta_path.insert(0, _Finder())
            return
    _run(name, [callback], module)


def _run(name: str, callbacks: list[Callback], module: ModuleType) -> None:
    for callback in callbacks:
        try:
            callback(module)
        except Exception:
            log.exception("hicache_mc: a hook for %s failed when it was imported", name)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: asks the finders after it, and wraps the loader it gets."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in _waiting:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader, fullname)
                return spec
        return None


class _Loader(importlib.abc.Loader):
    """The module's own loader, then the callbacks waiting for it. Everything else (source,
    resources, ``is_package``) is the wrapped loader's."""

    def __init__(self, loader, name: str):
        self._loader, self._name = loader, name

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        with _lock:
            callbacks = _waiting.pop(self._name, [])
        _run(self._name, callbacks, module)

    def __getattr__(self, attr):
        return getattr(self._loader, attr)
