"""Kernel launch under the Triton interpreter: one process-wide lock.

The interpreter (``TRITON_INTERPRET=1``, how the kernels run on CPU) keeps global state per
launch; launches from several threads at once fail with ``InterpreterError`` (45 of 80 in a
4-thread trial, 0 with a lock; see cpu-toolchain.md section 7.2). HiCache calls a backend
from its prefetch, prefetch-I/O and backup threads, so every launch goes through ``launch``.
On a GPU the lock is not taken: compiled launches are thread-safe.
"""
from __future__ import annotations

import os
import threading

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_LAUNCH_LOCK = threading.Lock()


def launch(kernel, grid, *args, **meta) -> None:
    """Launch ``kernel[grid](*args, **meta)``, serialized when running in the interpreter."""
    if INTERPRET:
        with _LAUNCH_LOCK:
            kernel[grid](*args, **meta)
    else:
        kernel[grid](*args, **meta)
