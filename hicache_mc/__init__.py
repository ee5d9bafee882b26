"""hicache-mc: an L3 KV-cache store for SGLang's hierarchical cache."""

__version__ = "0.1.0"
