"""The client: StoreClient."""
from .client import StoreClient

__all__ = ["StoreClient"]
