"""Fixtures of the conductor's tests: a tokenizer trained here, stand-in worker fleets and the
conductor as real processes (harness.py)."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from tokenizer import train  # noqa: E402


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> str:
    """A byte-level BPE tokenizer with a Qwen2-style chat template (tokenizer.py)."""
    return train(str(tmp_path_factory.mktemp("tokenizer")))
