"""Stub: InterpolationMode exists; every function raises when called."""
import enum


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


def __getattr__(name):
    def _unavailable(*args, **kwargs):
        raise RuntimeError(f"torchvision.transforms.functional.{name}: stubbed for CPU tests")
    return _unavailable
