"""Stand-in SGLang workers for the conductor's tests and benchmarks (see worker.py)."""
