"""The fleet simulator, the routers it compares and the sweep (see benchmarks/replay_fleet.py)."""
