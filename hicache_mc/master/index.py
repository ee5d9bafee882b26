"""The master's key index: key -> (node, size, checksum), packed to keep the master small.

Keys are held as their 16-byte digests (keydigest.py: an SGLang page key's from its page hash,
any other's by xxh3-128; a page key is ~85 characters: 133 bytes as a str, 49 as a digest), and
each value is one Python int: ``checksum | size << 64 | node_slot << 104`` instead of a tuple of
three. Measured with benchmarks/bench_master.py at 1M keys: master RSS +225 B/key with str
keys, +157 B/key with digests. Two keys with one digest (by chance ~n²/2^129; on purpose
possible within a namespace) can only make the master report a key present that is not: the
node looks objects up by the full key, so the read is a miss, never another key's bytes. Node ids are interned as small slot numbers
by ``NodeSlots``. The digests sit in one map per key namespace (the part of a key before its
first '/'), so the keys of one namespace are listed without a scan (a residency snapshot).

Copies (``replicas``): a key committed by a second node with the same size and checksum is a
copy; the packed value keeps its first holder and ``_copies`` (digest -> further slots, only for
keys that have copies) the others. Lookups given the live slots answer a live holder, the
reader's own host's first; a copy that goes (evicted, its node expired) leaves the key stored
while another remains. A commit of other bytes under the key replaces every copy.
"""
from __future__ import annotations

from typing import Iterable, Optional

from ..keydigest import digest as _d, digest_list
from ..keys import tenant_of

CHECKSUM_MASK = (1 << 64) - 1
SIZE_MASK = (1 << 40) - 1       # a packed value: checksum | size << 64 | node_slot << 104
OBJECT_MASK = (1 << 104) - 1    # the object's part of a packed value: size and checksum


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


def namespace_of(key: str) -> str:
    """The namespace of a store key: what comes before its first '/' ("" for a key without)."""
    i = key.find("/")
    return key[:i] if i >= 0 else ""


def _one_namespace(keys: list[str]) -> Optional[str]:
    """The namespace of every key, or None when they have several. The usual batch has one,
    checked at C speed: every key between the least and the greatest shares a prefix both have."""
    ns = namespace_of(keys[0])
    if "/" in keys[0] and min(keys).startswith(ns + "/") and max(keys).startswith(ns + "/"):
        return ns
    return None


def _groups(keys: list[str]) -> list[tuple[str, list[int]]]:
    """(namespace, positions of its keys) per namespace."""
    ns = _one_namespace(keys)
    if ns is not None:
        return [(ns, range(len(keys)))]
    out: dict[str, list[int]] = {}
    for i, k in enumerate(keys):
        out.setdefault(namespace_of(k), []).append(i)
    return list(out.items())


_EMPTY: dict = {}


class KeyIndex:
    """key -> (node_slot, size, checksum), one map per key namespace (so a namespace's keys can
    be listed without a scan: the residency snapshot). Not thread-safe: owned by the master loop.

    ``journal`` (when not None) collects every change, ``{namespace: {digest: present}}`` with
    the last change of a key winning: the residency publisher sends and clears it each loop turn.
    """

    def __init__(self):
        self._ns: dict[str, dict[bytes, int]] = {}
        self._dropped = 0       # namespaces emptied since _ns was last rebuilt
        self.tenant_keys: dict[str, int] = {}   # tenant -> keys held (its namespaces' sizes)
        self.journal: Optional[dict[str, dict[bytes, bool]]] = None
        # the keys themselves, {namespace: {key: present}}, for the namespaces in key_spaces only
        self.key_journal: dict[str, dict[str, bool]] = {}
        self.key_spaces: set[str] = set()
        self._copies: dict[bytes, list[int]] = {}   # digest -> slots of copies beyond the first

    def __len__(self) -> int:
        return sum(map(len, self._ns.values()))

    def _note(self, ns: str, digests, present: bool) -> None:
        j = self.journal
        if j is not None and digests:
            j.setdefault(ns, {}).update(dict.fromkeys(digests, present))

    def add(self, key: str, slot: int, size: int, checksum: int) -> None:
        self.add_many([key], slot, [size], [checksum])

    def add_many(self, keys: list[str], slot: int, sizes: list[int], checksums: list[int]) -> None:
        """``add`` for a batch of one node, digested in C-level loops."""
        if not keys:
            return
        hi = slot << 104
        values = [(c & CHECKSUM_MASK) | (s & SIZE_MASK) << 64 | hi for s, c in zip(sizes, checksums)]
        groups = _groups(keys)
        digests = digest_list(keys, groups[0][0] if len(groups) == 1 and "/" in keys[0] else None)
        for ns, pos in groups:
            sub = self._ns.get(ns)
            if sub is None:
                sub = self._ns[ns] = {}
            before = len(sub)
            part = digests if len(pos) == len(keys) else [digests[i] for i in pos]
            vals = values if len(pos) == len(keys) else [values[i] for i in pos]
            olds = list(map(sub.get, part))
            sub.update(zip(part, vals))
            if olds.count(None) != len(olds):      # keys held already: copies, or new bytes
                self._merge(sub, part, olds, vals, slot)
            self._note(ns, part, True)
            if ns in self.key_spaces:
                self.key_journal.setdefault(ns, {}).update(
                    dict.fromkeys(keys if len(pos) == len(keys) else [keys[i] for i in pos], True))
            self._count(ns, len(sub) - before)

    def _merge(self, sub: dict, digests: list[bytes], olds: list, values: list[int],
               slot: int) -> None:
        """Keys held before this commit: the same object from another node is a copy (the
        first holder stays first); other bytes replace every copy."""
        copies = self._copies
        for d, old, new in zip(digests, olds, values):
            if old is None:
                continue
            if old >> 104 != slot and old & OBJECT_MASK == new & OBJECT_MASK:
                sub[d] = old
                held = copies.setdefault(d, [])
                if slot not in held:
                    held.append(slot)
            elif old & OBJECT_MASK != new & OBJECT_MASK:
                copies.pop(d, None)

    def get(self, key: str) -> Optional[tuple[int, int, int]]:
        v = self._ns.get(namespace_of(key), _EMPTY).get(_d(key))
        if v is None:
            return None
        return v >> 104, (v >> 64) & SIZE_MASK, v & CHECKSUM_MASK

    def get_many(self, keys: list[str], live: Optional[set[int]] = None,
                 near: frozenset = frozenset()) -> list[Optional[int]]:
        """The packed value of each key (None when absent), digested and looked up in C-level
        loops: ``checksum | size << 64 | node_slot << 104``. Given the ``live`` slots, a key
        with copies names a live holder, one in ``near`` first (the first holder otherwise)."""
        if not keys:
            return []
        ns = _one_namespace(keys)
        digests = digest_list(keys, ns)
        if ns is not None:
            values = list(map(self._ns.get(ns, _EMPTY).get, digests))
        else:
            get = self._ns.get
            values = [get(k.partition("/")[0] if "/" in k else "", _EMPTY).get(d)
                      for k, d in zip(keys, digests)]
        if live is not None and self._copies:
            found = list(map(self._copies.get, digests))
            for i, extra in enumerate(found):
                if extra is not None and values[i] is not None:
                    values[i] = self._choose(values[i], extra, live, near)
        return values

    @staticmethod
    def _choose(value: int, extra: list[int], live: set[int], near: frozenset) -> int:
        """``value`` with its slot replaced by the holder a reader should use."""
        holders = [value >> 104, *extra]
        usable = [s for s in holders if s in live]
        if not usable:
            return value
        best = next((s for s in usable if s in near), usable[0])
        return (value & OBJECT_MASK) | best << 104

    def holders(self, key: str) -> list[int]:
        """Every slot holding ``key``, the first holder first ([] when absent)."""
        d = _d(key)
        v = self._ns.get(namespace_of(key), _EMPTY).get(d)
        return [] if v is None else [v >> 104, *self._copies.get(d, ())]

    def held(self, key: str, live: set[int]) -> bool:
        """Whether a live slot holds ``key``."""
        return any(s in live for s in self.holders(key))

    def remove(self, key: str, slot: int) -> bool:
        """Drop ``slot``'s copy of ``key`` (a newer copy elsewhere stays); True when it held one."""
        ns = namespace_of(key)
        sub = self._ns.get(ns)
        d = _d(key)
        v = None if sub is None else sub.get(d)
        extra = self._copies.get(d)
        if extra and slot in extra:
            self._drop_copy(d, slot)
            return True
        if v is not None and v >> 104 == slot:
            if extra:       # another copy becomes the first: the key stays stored
                sub[d] = (v & OBJECT_MASK) | self._drop_copy(d, extra[0]) << 104
                return True
            del sub[d]
            self._count(ns, -1)
            if not sub:
                self._drop_namespace(ns)
            self._note(ns, (d,), False)
            if ns in self.key_spaces:
                self.key_journal.setdefault(ns, {})[key] = False
            return True
        return False

    def _drop_copy(self, d: bytes, slot: int) -> int:
        extra = self._copies[d]
        extra.remove(slot)
        if not extra:
            del self._copies[d]
        return slot

    def drop_slot(self, slot: int) -> int:
        """Remove ``slot``'s copy of every key; returns how many keys no copy holds now."""
        for d in [d for d, extra in self._copies.items() if slot in extra]:
            self._drop_copy(d, slot)
        n = 0
        for ns, sub in list(self._ns.items()):
            dead = [k for k, v in sub.items() if v >> 104 == slot]
            kept = [k for k in dead if k in self._copies]
            for k in kept:      # another copy becomes the first
                sub[k] = (sub[k] & OBJECT_MASK) | self._drop_copy(k, self._copies[k][0]) << 104
            dead = [k for k in dead if k not in kept] if kept else dead
            for k in dead:
                del sub[k]
            self._count(ns, -len(dead))
            if not sub:
                self._drop_namespace(ns)
            self._note(ns, dead, False)
            n += len(dead)
        return n

    def _count(self, ns: str, n: int) -> None:
        if n:
            t = tenant_of(ns + "/")
            left = self.tenant_keys.get(t, 0) + n
            if left:
                self.tenant_keys[t] = left
            else:
                del self.tenant_keys[t]

    def _drop_namespace(self, ns: str) -> None:
        del self._ns[ns]
        self._dropped += 1
        if self._dropped > len(self._ns):   # a dict's table never shrinks: rebuild it (amortised)
            self._ns, self._dropped = dict(self._ns), 0

    def namespace_size(self, ns: str) -> int:
        return len(self._ns.get(ns, _EMPTY))

    def digests(self, ns: str) -> bytes:
        """Every key of namespace ``ns``, as its 16-byte digests end to end (the snapshot)."""
        return b"".join(self._ns.get(ns, _EMPTY))

    def leading_run(self, keys: Iterable[str], live: set[int]) -> int:
        """How many keys, from the first, are present on live nodes."""
        n = 0
        for k in keys:
            if not self.held(k, live):
                break
            n += 1
        return n
