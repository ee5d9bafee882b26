"""Trace replay parts: trace and local cache, block bytes, L3 clients, instance processes,
the driver, store start-up and the report (see benchmarks/replay_trace.py)."""
