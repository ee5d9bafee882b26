"""The master's key index: key -> (node, size, checksum), packed to keep the master small.

Keys are held as 16-byte xxh3-128 digests (a page key is ~85 characters: 133 bytes as a str,
49 as a digest), and each value is one Python int: ``checksum | size << 64 | node_slot << 104``
instead of a tuple of three. Measured with benchmarks/bench_master.py at 1M keys: master RSS
+225 B/key with str keys, +157 B/key with digests. xxh3-128 hashes a key in ~0.25 µs against
~1.9 µs for BLAKE2b (the master digests every key of every request). Two keys that collide
(~n²/2^129 for honest keys; a crafted pair is possible, xxh3 not being cryptographic) can only
make the master report a key present that is not: the node looks objects up by the full key,
so the read is a miss, never another key's bytes. Node ids are interned as small slot numbers
by ``NodeSlots``.
"""
from __future__ import annotations

from typing import Iterable, Optional

from xxhash import xxh3_128_digest

CHECKSUM_MASK = (1 << 64) - 1
SIZE_MASK = (1 << 40) - 1       # a packed value: checksum | size << 64 | node_slot << 104


class NodeSlots:
    """Interns node ids as small ints (stable for the master's lifetime)."""

    def __init__(self):
        self._slot: dict[str, int] = {}
        self.ids: list[str] = []        # slot -> node id

    def slot(self, node_id: str) -> int:
        s = self._slot.get(node_id)
        if s is None:
            s = self._slot[node_id] = len(self.ids)
            self.ids.append(node_id)
        return s

    def node_id(self, slot: int) -> str:
        return self.ids[slot]


def _d(key: str) -> bytes:
    return xxh3_128_digest(key.encode())


class KeyIndex:
    """key -> (node_slot, size, checksum). Not thread-safe: owned by the master loop."""

    def __init__(self):
        self._map: dict[bytes, int] = {}

    def __len__(self) -> int:
        return len(self._map)

    def add(self, key: str, slot: int, size: int, checksum: int) -> None:
        self._map[_d(key)] = (checksum & CHECKSUM_MASK) | (size & SIZE_MASK) << 64 | slot << 104

    def add_many(self, keys: list[str], slot: int, sizes: list[int], checksums: list[int]) -> None:
        """``add`` for a batch of one node, digested in C-level loops."""
        hi = slot << 104
        self._map.update(zip(map(xxh3_128_digest, map(str.encode, keys)),
                             [(c & CHECKSUM_MASK) | (s & SIZE_MASK) << 64 | hi
                              for s, c in zip(sizes, checksums)]))

    def get(self, key: str) -> Optional[tuple[int, int, int]]:
        v = self._map.get(_d(key))
        if v is None:
            return None
        return v >> 104, (v >> 64) & SIZE_MASK, v & CHECKSUM_MASK

    def get_many(self, keys: list[str]) -> list[Optional[int]]:
        """The packed value of each key (None when absent), digested and looked up in C-level
        loops: ``checksum | size << 64 | node_slot << 104``."""
        return list(map(self._map.get, map(xxh3_128_digest, map(str.encode, keys))))

    def slot_of(self, key: str) -> Optional[int]:
        v = self._map.get(_d(key))
        return None if v is None else v >> 104

    def remove(self, key: str, slot: int) -> bool:
        """Drop ``key`` if ``slot`` still holds it (a newer copy elsewhere stays)."""
        d = _d(key)
        v = self._map.get(d)
        if v is not None and v >> 104 == slot:
            del self._map[d]
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
            v = m.get(_d(k))
            if v is None or (v >> 104) not in live:
                break
            n += 1
        return n
