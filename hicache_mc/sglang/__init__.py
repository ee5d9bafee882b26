"""SGLang HiCache adapter: the only package that imports sglang.

Load it with ``--hicache-storage-backend dynamic --hicache-storage-backend-extra-config
'{"backend_name":"hicache_mc","module_path":"hicache_mc.sglang","class_name":"HiCacheMC",
"interface_v1":1,"master":"tcp://127.0.0.1:7370"}'`` (see docs/sglang.md).
"""
try:
    import sglang  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("hicache_mc.sglang needs sglang >= 0.5.23: pip install '.[sglang]' from a "
                      "checkout (GPU machines), or see docs/sglang.md for the CPU test install") from exc

from .backend import HiCacheMC

__all__ = ["HiCacheMC"]
