"""Shared fixtures: real store processes on 127.0.0.1, always stopped afterwards."""
from __future__ import annotations

import os
import sys

# Triton kernels run through the interpreter on machines without CUDA. Decided before any
# kernel module is imported; a GPU machine compiles them for real.
try:
    import torch
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:  # pragma: no cover - torch is part of the set-up
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from procs import Cluster, Store  # noqa: E402


@pytest.fixture
def store(tmp_path):
    """A running ``hicache-mc serve`` (256 MiB DRAM) on a free port; ``.master`` is its address."""
    s = Store(tmp_path).start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def shared_store(tmp_path_factory):
    """One running store for the tests of a module, which keep apart by key prefix or
    namespace: starting one costs a second or two. A test that stops, kills or restarts the
    store, or needs it empty, takes ``store`` instead."""
    s = Store(tmp_path_factory.mktemp("store")).start()
    yield s
    s.stop()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """A tiny Qwen2 with random weights and a trained tokenizer, for live SGLang servers
    (tests/live): made once per session."""
    from live.model import make_tiny_model
    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"))


@pytest.fixture
def cluster(tmp_path):
    """An empty Cluster: start a master and nodes as separate processes as the test needs."""
    c = Cluster(tmp_path)
    yield c
    c.stop()
