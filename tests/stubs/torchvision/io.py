"""Stub: every function raises when called."""


def __getattr__(name):
    def _unavailable(*args, **kwargs):
        raise RuntimeError(f"torchvision.io.{name}: stubbed for CPU tests")
    return _unavailable
