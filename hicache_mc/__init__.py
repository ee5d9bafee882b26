"""hicache-mc: an L3 KV-cache store for SGLang's hierarchical cache."""

__version__ = "0.1.0"     # the one place; pyproject.toml reads it

__all__ = ["EmbeddingCache"]


def __getattr__(name):
    # Lazy: ``import hicache_mc`` stays light (no torch) for the store processes and the CLI.
    if name == "EmbeddingCache":
        from .embeddings import EmbeddingCache
        return EmbeddingCache
    raise AttributeError(f"module 'hicache_mc' has no attribute {name!r}")
