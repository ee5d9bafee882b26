"""Make sglang 0.5.23 importable on a CPU-only machine (tests only; see docs/sglang.md).

``sglang.srt.configs`` imports ``torchvision.transforms`` at module level, and the torchvision
wheel matching torch 2.13 is a CUDA build. A stub package (tests/stubs) provides the names; it
becomes visible only after transformers has cached "torchvision is unavailable", so transformers
never tries to use it.
"""
import os
import sys

STUBS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "stubs")


def apply_torchvision_stub() -> None:
    import transformers.utils.import_utils as iu
    iu.is_torchvision_available()      # lru_cached False while the stub is still invisible
    if STUBS not in sys.path:
        sys.path.insert(0, STUBS)
