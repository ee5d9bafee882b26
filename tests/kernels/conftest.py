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


def random_bytes(shape, dtype, device, gen: torch.Generator) -> torch.Tensor:
    """A tensor of ``dtype`` filled with random bytes (NaN and inf patterns included)."""
    isz = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * isz), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).to(device)


def poisoned(shape, dtype, device) -> torch.Tensor:
    """A tensor of ``dtype`` whose bytes are all 0xFF (NaN for every float dtype here)."""
    isz = torch.empty((), dtype=dtype).element_size()
    raw = torch.full((*shape[:-1], shape[-1] * isz), 0xFF, dtype=torch.uint8, device=device)
    return raw.view(dtype)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN payloads included); works for fp8, which ``torch.equal`` may not."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
