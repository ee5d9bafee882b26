"""The client: StoreClient, and the Chain a put's keys belong to."""
from .client import StoreClient
from .writes import Chain

__all__ = ["Chain", "StoreClient"]
