"""A fake torchvision for CPU-only tests (see docs/sglang.md).

The torchvision wheel that matches torch 2.13 is a CUDA build and breaks ``import sglang`` on a
CPU torch; sglang's model configs only need module-level names to exist. Anything that actually
uses torchvision fails loudly. Never on sys.path outside tests/sglang.
"""
__version__ = "0.0.0+stub"
