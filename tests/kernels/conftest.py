"""Kernel tests: on a machine without CUDA the kernels run in the Triton interpreter.

``TRITON_INTERPRET`` is read when ``@triton.jit`` decorates a kernel, so it is set here, before
any test module imports ``hicache_mc.kernels``. With CUDA present (and the variable unset) the
same tests run compiled, on the GPU.
"""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"


@pytest.fixture
def device() -> str:
    """Where kernel tensors live: CPU under the interpreter, else the GPU."""
    return DEVICE
