"""What a transport does, and the raw-memory helpers all of them share.

A transport moves object bytes between caller memory (raw addresses, as SGLang's host pool
gives them) and one storage node. The client has already asked the master where each key
lives (get) or where it goes (put); a transport is called once per node per batch.

- ``read(node, keys, ptrs, sizes, deadline) -> list[bool]``: fill ``ptrs[i]`` with the object
  ``keys[i]``; True only when the stored size equals ``sizes[i]`` and the checksum matches.
- ``write(node, keys, ptrs, sizes, checksums, deadline) -> list[bool]``: store and commit; True
  once the master has the key (a key already stored is True as well).

Transport failures (timeouts, error replies) raise; the client turns them into misses.
"""
from __future__ import annotations

import ctypes
import logging
from abc import ABC, abstractmethod

import xxhash

from ..protocol import NodeInfo

log = logging.getLogger(__name__)


def buffer_at(ptr: int, size: int) -> memoryview:
    """A writable byte view of ``size`` bytes at raw address ``ptr`` (no copy)."""
    if size == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_ubyte * size).from_address(ptr)).cast("B")


def checksum_at(ptr: int, size: int) -> int:
    """xxh3-64 of raw memory: ~10+ GB/s, far below memcpy cost per byte on the paths here."""
    return xxhash.xxh3_64_intdigest(buffer_at(ptr, size))


def checksum(data) -> int:
    return xxhash.xxh3_64_intdigest(data)


memmove = ctypes.memmove  # a foreign call: releases the GIL while it copies


class Transport(ABC):
    name = "base"

    @abstractmethod
    def read(self, node: NodeInfo, keys: list[str], ptrs: list[int], sizes: list[int],
             deadline: float) -> list[bool]:
        """Copy objects into caller memory; see the module docstring."""

    @abstractmethod
    def write(self, node: NodeInfo, keys: list[str], ptrs: list[int], sizes: list[int],
              checksums: list[int], deadline: float) -> list[bool]:
        """Store objects from caller memory; see the module docstring."""

    def close(self) -> None:
        """Release what the transport holds (mappings, registrations)."""


class ChecksumCounter:
    """Counts and logs checksum mismatches (a mismatch is a miss, never a wrong page)."""

    def __init__(self):
        self.failures = 0

    def check(self, key: str, expected: int, actual: int) -> bool:
        if expected == actual:
            return True
        self.failures += 1
        log.warning("checksum mismatch on %s: treated as a miss", key)
        return False
