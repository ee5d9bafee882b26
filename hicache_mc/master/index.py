"""The master's key index: key -> (node, size, checksum), packed to keep the master small.

Each entry's value is one Python int: ``checksum | size << 64 | node_slot << 104``. One int per
key instead of a tuple of three saves ~100 bytes a key (measured in benchmarks/bench_master.py).
Node ids are interned as small slot numbers by ``NodeSlots``.
"""
from __future__ import annotations

from typing import Iterable, Iterator, Optional

_CHECKSUM_MASK = (1 << 64) - 1
_SIZE_MASK = (1 << 40) - 1


class NodeSlots:
    """Interns node ids as small ints (stable for the master's lifetime)."""

    def __init__(self):
        self._slot: dict[str, int] = {}
        self._ids: list[str] = []

    def slot(self, node_id: str) -> int:
        s = self._slot.get(node_id)
        if s is None:
            s = self._slot[node_id] = len(self._ids)
            self._ids.append(node_id)
        return s

    def node_id(self, slot: int) -> str:
        return self._ids[slot]


class KeyIndex:
    """key -> (node_slot, size, checksum). Not thread-safe: owned by the master loop."""

    def __init__(self):
        self._map: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._map)

    def add(self, key: str, slot: int, size: int, checksum: int) -> None:
        self._map[key] = (checksum & _CHECKSUM_MASK) | (size & _SIZE_MASK) << 64 | slot << 104

    def get(self, key: str) -> Optional[tuple[int, int, int]]:
        v = self._map.get(key)
        if v is None:
            return None
        return v >> 104, (v >> 64) & _SIZE_MASK, v & _CHECKSUM_MASK

    def slot_of(self, key: str) -> Optional[int]:
        v = self._map.get(key)
        return None if v is None else v >> 104

    def remove(self, key: str, slot: int) -> bool:
        """Drop ``key`` if ``slot`` still holds it (a newer copy elsewhere stays)."""
        v = self._map.get(key)
        if v is not None and v >> 104 == slot:
            del self._map[key]
            return True
        return False

    def drop_slot(self, slot: int) -> int:
        """Remove every key held by ``slot``; returns how many."""
        dead = [k for k, v in self._map.items() if v >> 104 == slot]
        for k in dead:
            del self._map[k]
        return len(dead)

    def leading_run(self, keys: Iterable[str], live: set[int]) -> int:
        """How many keys, from the first, are present on live nodes."""
        n = 0
        m = self._map
        for k in keys:
            v = m.get(k)
            if v is None or (v >> 104) not in live:
                break
            n += 1
        return n

    def keys_of(self, slot: int) -> Iterator[str]:
        return (k for k, v in self._map.items() if v >> 104 == slot)
