"""DramTier: objects in one shared-memory file; slots, reservations, leases, LRU eviction.

The segment is a file under ``/dev/shm`` mapped with mmap (``segment_file.py``: the node's own,
mode 0600, locked while it runs). Same-host clients map it too and copy straight in (reserved
slots) or out (leased objects), so the node never touches the bytes on the shm path: whoever
can open the file, the node's user or root, reads and writes every object in it.

Contract (the node loop is the only caller; nothing else reads or writes the tier's state):

- ``reserve(key, size, now, hold_s)`` / ``reserve_row(keys, sizes, now, hold_s)``: a slot for
  a writer, evicting what may be evicted to make room (``reserve_row`` never evicts); None
  when there is no room. A reservation ends at ``commit`` (the slot becomes the key's
  object), ``give_back``, or when it lapses (``maintain``).
- ``lease(key, now)`` / ``release(key, offset)``: a reader's hold on an object.
- ``remove(keys, now)`` / ``drop(key, now)``: the object leaves the index (``drop``: an
  eviction, reported by ``take_dropped`` unless a copy stays on SSD).
- ``start_writing(slot)`` / ``written(slot, on_disk, now)``: the SSD writer reads the slot.

Reuse safety: a slot is freed only once nothing holds it. A lease holds it until the reader
releases it or the lease ends (a reader that dies never releases); an object removed while
leased is quarantined until then, so a reader never sees its slot rewritten mid-copy. The SSD
writer holds it while it reads the slot, and a stream-port transfer while it moves it
(``transfers``: ``transport/grants.py``; such a slot comes back once the transfer ends). Slots
nobody holds are reused at once. Checksums (computed by writers, verified by readers) catch
anything else: a same-host or Transfer Engine writer still copying after its reservation
expired (those copy without the node).
"""
from __future__ import annotations

import heapq
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable, Optional, Protocol

from .allocator import SlotAllocator
from .segment_file import SegmentFile

log = logging.getLogger(__name__)

HEADER_BYTES = 4096          # segment header: magic + segment id; objects start after it
SLOT_ALIGN = 256             # objects start on this boundary and take their size rounded up to it


class Transfers(Protocol):
    """Who else may be moving a slot's bytes (the stream port: ``transport/grants.py``)."""

    def hold(self, offset: int) -> bool:
        """Whether the slot at ``offset`` is being moved (its offset then comes back from
        ``take_unpinned`` once it is not)."""

    def take_unpinned(self) -> list[int]:
        """Offsets ``hold`` kept that nothing moves any more."""


class NoTransfers:
    """No one but shm and Transfer Engine clients, which copy without the node."""

    def hold(self, offset: int) -> bool:
        return False

    def take_unpinned(self) -> list[int]:
        return []


@dataclass(eq=False, slots=True)
class Slot:
    """A range of the segment: an object, or a writer's reservation. Read-only outside
    DramTier."""
    offset: int
    size: int
    checksum: int = 0
    lease_until: float = 0.0
    on_ssd: bool = False      # a copy is safely on the SSD tier: dropping this one loses nothing
    busy: int = 0             # the SSD writer is reading the slot: it must not be reused
    removed: bool = False     # removed while busy: free the slot when the writer is done
    readers: int = 0          # leases handed out and not yet released


class DramTier:
    def __init__(self, path: str, capacity: int, segment_id: str, lease_s: float,
                 high_watermark: float, low_watermark: float, prefault: bool = False,
                 transfers: Transfers = NoTransfers(), object_bytes: int = 0):
        """``object_bytes``: the node's memory per slot beyond the segment (its records,
        keys, index entries), counted against ``capacity`` with the slot's bytes: the tier
        holds fewer objects the smaller they are, and its memory stays within ``capacity``."""
        self.path = path
        self._transfers = transfers
        self._object_bytes = object_bytes
        self._slots = 0             # slots not free: objects, reservations, held ones
        self.capacity = capacity
        self.lease_s = lease_s
        self.high = int(capacity * high_watermark)
        self.low = int(capacity * low_watermark)
        self._file = SegmentFile(path, HEADER_BYTES + capacity, segment_id, prefault)
        self.mm = self._file.mm
        self._alloc = SlotAllocator(HEADER_BYTES, capacity, SLOT_ALIGN)
        self._objects: "OrderedDict[str, Slot]" = OrderedDict()   # LRU order: oldest first
        self._reserved: dict[str, tuple[Slot, float]] = {}        # key -> (slot, commit deadline)
        self._quarantine: list[tuple[float, int]] = []            # (lease end, offset)
        self._held: dict[int, Slot] = {}        # offset -> slot removed, not free yet (leased, moved)
        self._held_bytes = 0
        self._dropped: list[tuple[str, int]] = []     # (key, size) evicted, no copy on SSD
        self.evictions = 0
        # Without an SSD tier, eviction may drop any object. With one, only copies already on
        # SSD are dropped here; the rest leave DRAM by demotion (see node/writeback.py).
        self._drop_dirty = True

    # ------------------------------------------------------------ lookups

    def __contains__(self, key: str) -> bool:
        """Whether ``key`` is a readable object here."""
        return key in self._objects

    def __len__(self) -> int:
        return len(self._objects)

    def get(self, key: str) -> Optional[Slot]:
        """The object of ``key``, without marking it used."""
        return self._objects.get(key)

    def is_reserved(self, key: str) -> bool:
        return key in self._reserved

    def reservation(self, key: str) -> Optional[Slot]:
        """The slot reserved for ``key``, if any."""
        held = self._reserved.get(key)
        return held[0] if held is not None else None

    def items(self):
        """(key, object) pairs, least recently used first (a snapshot)."""
        return list(self._objects.items())

    def keys(self):
        return self._objects.keys()

    def view(self, slot: Slot) -> memoryview:
        return memoryview(self.mm)[slot.offset: slot.offset + slot.size]

    @property
    def used(self) -> int:
        """Bytes counted against the capacity: the slots' and the memory each slot costs."""
        return self._alloc.used + self._slots * self._object_bytes

    def _room_for(self, need: int, slots: int) -> bool:
        """Whether ``slots`` more slots of ``need`` segment bytes in all stay within capacity."""
        return self.used + need + slots * self._object_bytes <= self.capacity

    def excess(self) -> int:
        """Bytes to free to reach the low watermark (held slots come back by themselves);
        0 while under the high watermark."""
        if self.used <= self.high:
            return 0
        return self.used - self._held_bytes - self.low

    # ------------------------------------------------------------ writes

    def reserve(self, key: str, size: int, now: float, hold_s: float) -> Optional[Slot]:
        """A slot for ``key`` (neither stored nor reserved; commit before now+hold_s), evicting
        what may be evicted to make room; None when there is none."""
        assert key not in self._objects and key not in self._reserved, key
        offset = self._allocate(size, now)
        if offset < 0:
            return None
        slot = Slot(offset, size)
        self._reserved[key] = (slot, now + hold_s)
        return slot

    def reserve_row(self, keys: list[str], sizes: list[int], now: float,
                    hold_s: float) -> Optional[list[Slot]]:
        """Slots for a batch of keys that are neither stored nor reserved (and distinct), cut
        from one free range: one allocator call, and the objects lie in a row. None when no
        free range is big enough (evicting for one range could drop far more than needed:
        then reserve key by key)."""
        need = [self._alloc.rounded(s) for s in sizes]
        self._release_quarantine(now)
        if not self._room_for(sum(need), len(need)):
            return None
        offset = self._alloc.allocate(sum(need))
        if offset < 0:
            return None
        self._slots += len(need)
        out, until, reserved = [], now + hold_s, self._reserved
        for key, size, n in zip(keys, sizes, need):
            slot = Slot(offset, size)
            reserved[key] = (slot, until)
            out.append(slot)
            offset += n
        return out

    def commit(self, key: str, checksum: int, offset: Optional[int] = None) -> Optional[Slot]:
        """Make the slot reserved for ``key`` (at ``offset``, when given: a commit that outlived
        its reservation must not commit another writer's slot) its readable object."""
        held = self._reserved.get(key)
        if held is None or (offset is not None and held[0].offset != offset):
            return None
        del self._reserved[key]
        slot = held[0]
        slot.checksum = checksum
        self._objects[key] = slot
        return slot

    def give_back(self, key: str, offset: int) -> Optional[Slot]:
        """A writer gives back the slot it reserved for ``key`` at ``offset`` without filling
        it; the slot, or None when no such reservation is held."""
        held = self._reserved.get(key)
        if held is None or held[0].offset != offset:
            return None
        del self._reserved[key]
        self._recycle(held[0])
        return held[0]

    # ------------------------------------------------------------ reads

    def lease(self, key: str, now: float) -> Optional[Slot]:
        """The object, marked most recently used and protected from reuse for ``lease_s``."""
        slot = self._objects.get(key)
        if slot is not None:
            self._objects.move_to_end(key)
            slot.lease_until = now + self.lease_s
            slot.readers += 1
        return slot

    def release(self, key: str, offset: int) -> None:
        """A reader is done with the lease it took on ``key`` at ``offset``. When no reader is
        left the object is unprotected, and if it was removed meanwhile its slot is free now.
        A reader that never releases (it died) is covered by the lease's end."""
        slot = self._objects.get(key)
        if slot is None or slot.offset != offset:
            slot = self._held.get(offset)
        if slot is None or slot.readers <= 0:
            return
        slot.readers -= 1
        if slot.readers:
            return
        slot.lease_until = 0.0
        if self._held.get(offset) is slot and not slot.busy:
            self._unhold(slot)
            self._recycle(slot)

    # ------------------------------------------------------------ the SSD writer

    def start_writing(self, slot: Slot) -> memoryview:
        """The SSD writer is to read ``slot``: it stays out of reuse until ``written``."""
        slot.busy += 1
        return self.view(slot)

    def written(self, slot: Slot, on_disk: bool, now: float) -> None:
        """The SSD writer is done with ``slot``; ``on_disk``: its copy is on SSD now (unless the
        object was removed meanwhile)."""
        if on_disk and not slot.removed:
            slot.on_ssd = True
        slot.busy -= 1
        if slot.removed and slot.busy == 0:
            self._free(slot, now)

    def set_on_ssd(self, key: str, on_ssd: bool) -> None:
        """Whether ``key``'s object has a safe copy on the SSD tier."""
        slot = self._objects.get(key)
        if slot is not None:
            slot.on_ssd = on_ssd

    def drop_dirty(self, allowed: bool) -> None:
        """Whether eviction may drop objects with no copy on SSD (no SSD tier, or a failed disk)."""
        self._drop_dirty = allowed

    # ------------------------------------------------------------ space

    def _allocate(self, size: int, now: float) -> int:
        """The offset of a free range of ``size`` bytes within capacity, evicting LRU objects
        that may go until there is one; -1 when there is none."""
        self._release_quarantine(now)
        need, victims = self._alloc.rounded(size), None
        while True:
            if self._room_for(need, 1):
                offset = self._alloc.allocate(size)
                if offset >= 0:
                    self._slots += 1
                    return offset
            if victims is None:
                victims = iter(list(self._objects.items()))
            if not self._evict_next(victims, now):
                return -1
            self._release_quarantine(now)

    def _evict_next(self, victims, now: float) -> bool:
        """Drop the next evictable object of ``victims`` (LRU order); False when none is left."""
        for key, slot in victims:
            if slot.busy or not (slot.on_ssd or self._drop_dirty):
                continue
            self.drop(key, now)
            return True
        return False

    def drop(self, key: str, now: float) -> Slot:
        """Evict one object; ``take_dropped`` names it unless a copy stays on SSD."""
        slot = self._objects.pop(key)
        self._free(slot, now)
        if not slot.on_ssd:
            self._dropped.append((key, slot.size))
        self.evictions += 1
        return slot

    def take_dropped(self) -> list[tuple[str, int]]:
        """(key, size) of the objects evicted with no copy on SSD since the last call."""
        out, self._dropped = self._dropped, []
        return out

    def _free(self, slot: Slot, now: float) -> None:
        """``slot`` left the index: free it once nothing holds it."""
        if slot.busy:
            slot.removed = True         # freed by written()
        elif slot.lease_until > now:
            heapq.heappush(self._quarantine, (slot.lease_until, slot.offset))
            self._hold(slot)
        else:
            self._recycle(slot)

    def _recycle(self, slot: Slot) -> None:
        """Free a slot no lease or SSD write holds, unless a transfer still moves it."""
        if self._transfers.hold(slot.offset):
            self._hold(slot)            # back through take_unpinned
        else:
            self._alloc.free(slot.offset, slot.size)
            self._slots -= 1

    def _hold(self, slot: Slot) -> None:
        self._held[slot.offset] = slot
        self._held_bytes += self._alloc.rounded(slot.size) + self._object_bytes

    def _unhold(self, slot: Slot) -> None:
        del self._held[slot.offset]
        self._held_bytes -= self._alloc.rounded(slot.size) + self._object_bytes

    def _release_quarantine(self, now: float) -> None:
        """Free the held slots whose leases ended, and those no transfer moves any more."""
        q = self._quarantine
        while q and q[0][0] <= now:
            _, offset = heapq.heappop(q)
            slot = self._held.get(offset)
            # None: released early by its readers; a later lease end: the slot was reused and
            # quarantined again, and that entry is still in the heap
            if slot is not None and slot.lease_until <= now:
                self._unhold(slot)
                self._recycle(slot)
        for offset in self._transfers.take_unpinned():
            slot = self._held.get(offset)
            if slot is not None and slot.lease_until <= now and not slot.busy:
                self._unhold(slot)
                self._recycle(slot)

    def maintain(self, now: float) -> list[tuple[str, int]]:
        """Expire stale reservations, release quarantine, evict above the high watermark;
        returns the (key, size) of each reservation that expired."""
        lapsed = [(k, slot.size) for k, (slot, deadline) in self._reserved.items() if deadline < now]
        for key, _ in lapsed:
            slot, _ = self._reserved.pop(key)
            # the writer may still be copying: keep the slot out of use for one more lease
            slot.lease_until = now + self.lease_s
            self._free(slot, now)
            log.warning("reservation for %s expired before commit; slot reclaimed", key)
        self._release_quarantine(now)
        if self.used > self.high:
            # held bytes come back by themselves once their leases and transfers end
            victims = iter(list(self._objects.items()))
            while self.used - self._held_bytes > self.low:
                if not self._evict_next(victims, now):
                    break
        return lapsed

    def remove(self, keys: Iterable[str], now: float) -> list[str]:
        """Take ``keys``' objects out of the index (their slots freed once nothing holds
        them); the keys that were here."""
        gone = []
        for key in keys:
            slot = self._objects.pop(key, None)
            if slot is not None:
                self._free(slot, now)
                gone.append(key)
        return gone

    def stats(self) -> dict:
        return {"objects": len(self._objects), "used": self.used, "capacity": self.capacity,
                "reserved": len(self._reserved), "quarantined": len(self._held),
                "evictions": self.evictions}

    def close(self) -> None:
        self._file.close()
