"""Stub: names import; any transform class raises when constructed."""
from . import functional
from .functional import InterpolationMode

__all__ = ["functional", "InterpolationMode"]


def __getattr__(name):
    class _Unavailable:
        def __init__(self, *args, **kwargs):
            raise RuntimeError(f"torchvision.transforms.{name}: stubbed for CPU tests")
    _Unavailable.__name__ = name
    return _Unavailable
