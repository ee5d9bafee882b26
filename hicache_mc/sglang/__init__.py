"""SGLang HiCache adapter: the only package that imports sglang.

With hicache-mc installed, SGLang loads its plugin (``plugin.py``) and takes
``--hicache-storage-backend hicache_mc`` (see docs/sglang.md).
"""
try:
    import sglang  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("hicache_mc.sglang needs sglang >= 0.5.23: pip install '.[sglang]' from a "
                      "checkout (GPU machines), or see docs/sglang.md for the CPU test install") from exc

from .backend import HiCacheMC

__all__ = ["HiCacheMC"]
