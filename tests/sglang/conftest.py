"""Fixtures for the SGLang backend tests: real sglang host pools on CPU; the
store is tests/conftest.py's ``shared_store``."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from sglang_env import apply_torchvision_stub  # noqa: E402

apply_torchvision_stub()
# The factory wraps backends in a failure injector when these are set; never in these tests.
os.environ.pop("SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY", None)
os.environ.pop("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", None)
