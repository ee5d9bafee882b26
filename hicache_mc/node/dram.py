"""DramTier: objects in one shared-memory file, LRU eviction, leases and quarantine.

The segment is a file under ``/dev/shm`` mapped with mmap. Same-host clients map it too and
copy straight in (reserved slots) or out (leased objects), so the node never touches the bytes
on the shm path. The node creates it (never opens one that exists) with mode 0600: whoever can
open it, the node's user or root, reads and writes every object in it.

Reuse safety: every read hands out a lease (``lease_s``); an object freed while a lease on it
is live goes to quarantine until the lease ends, so a reader never sees its slot rewritten
mid-copy. Slots never leased are reused at once. Checksums (computed by writers, verified by
readers) catch anything else, e.g. a writer still copying after its reservation expired.
"""
from __future__ import annotations

import errno
import heapq
import logging
import mmap
import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable, Optional

from ..errors import HicacheError
from ..transport.shm import MAGIC
from .allocator import SlotAllocator

log = logging.getLogger(__name__)

HEADER_BYTES = 4096          # segment header: magic + segment id; objects start after it
PREFAULT_CHUNK = 256 << 20   # the prefault's step (see DramTier._prefault)
MADV_POPULATE_WRITE = 23     # Linux 5.14+; Python's mmap module does not name it
SLOT_ALIGN = 256             # objects start on this boundary and take their size rounded up to it


@dataclass
class Obj:
    offset: int
    size: int
    checksum: int
    lease_until: float = 0.0
    on_ssd: bool = False      # a copy is safely on the SSD tier: dropping this one loses nothing
    busy: int = 0             # the SSD writer is reading the slot: it must not be reused
    removed: bool = False     # removed while busy: free the slot when the writer is done
    readers: int = 0          # leases handed out and not yet released


class DramTier:
    def __init__(self, path: str, capacity: int, segment_id: str, lease_s: float,
                 high_watermark: float, low_watermark: float, prefault: bool = False):
        self.path = path
        self.capacity = capacity
        self.lease_s = lease_s
        self.high = int(capacity * high_watermark)
        self.low = int(capacity * low_watermark)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)   # ours alone
        try:
            os.ftruncate(fd, HEADER_BYTES + capacity)
            self.mm = mmap.mmap(fd, HEADER_BYTES + capacity, flags=mmap.MAP_SHARED)
            if prefault:
                self._prefault(fd)
        except BaseException:       # no room, or SIGTERM / Ctrl-C while prefaulting: no file left
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        header = MAGIC + segment_id.encode()
        self.mm[: len(header)] = header
        self.alloc = SlotAllocator(HEADER_BYTES, capacity, SLOT_ALIGN)
        self.objects: "OrderedDict[str, Obj]" = OrderedDict()   # LRU order: oldest first
        self.reserved: dict[str, tuple[Obj, float]] = {}        # key -> (slot, commit deadline)
        self._quarantine: list[tuple[float, int]] = []          # (release time, offset)
        self._held: dict[int, Obj] = {}                         # offset -> quarantined object
        self._quarantined_bytes = 0
        self.dropped: list[tuple[str, int]] = []                # (key, size) gone from the node: tell the master
        self.evictions = 0
        # Without an SSD tier, eviction may drop any object. With one, only copies already on
        # SSD are dropped here; the rest leave DRAM by demotion (see node/store.py).
        self.drop_dirty = True

    def _prefault(self, fd: int) -> None:
        """Allocate every page of the segment now, a chunk at a time: signals are handled
        between two chunks (one MAP_POPULATE of the whole segment holds them off for about a
        second per GiB). A shm_dir without room for the segment fails here, where MAP_POPULATE
        would succeed and the first write past the room left would kill the node (SIGBUS)."""
        size = len(self.mm)
        for off in range(0, size, PREFAULT_CHUNK):
            n = min(PREFAULT_CHUNK, size - off)
            try:
                self.mm.madvise(MADV_POPULATE_WRITE, off, n)
            except OSError as exc:
                if exc.errno != errno.EINVAL:     # EFAULT: the tmpfs is full; ENOMEM
                    raise HicacheError(
                        f"{os.path.dirname(self.path)} has no room for a {size >> 20} MiB DRAM "
                        "segment: lower --dram, or enlarge it (docker run --shm-size; a "
                        "Kubernetes emptyDir of medium Memory)") from None
                # Linux before 5.14: no MADV_POPULATE_WRITE
                mmap.mmap(fd, n, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, offset=off).close()

    # ------------------------------------------------------------ writes

    def reserve(self, key: str, size: int, now: float, hold_s: float) -> int:
        """Offset of a slot for ``key`` (commit before now+hold_s); -1 = no room, -2 = stored."""
        if key in self.objects or key in self.reserved:
            return -2
        offset = self._allocate(size, now)
        if offset >= 0:
            self.reserved[key] = (Obj(offset, size, 0), now + hold_s)
        return offset

    def reserve_fresh(self, keys: list[str], sizes: list[int], now: float,
                      hold_s: float) -> Optional[list[int]]:
        """Slots for a batch of keys that are neither stored nor reserved (and distinct), cut
        from one free range: one allocator call, and the objects lie in a row. None when no
        free range is big enough (evicting for one range could drop far more than needed:
        then reserve key by key)."""
        align = self.alloc.align
        need = [max(align, -(-s // align) * align) for s in sizes]
        total = sum(need)
        self._release_quarantine(now)
        offset = self.alloc.allocate(total)
        if offset < 0:
            return None
        out, until, reserved = [], now + hold_s, self.reserved
        for key, size, n in zip(keys, sizes, need):
            reserved[key] = (Obj(offset, size, 0), until)
            out.append(offset)
            offset += n
        return out

    def commit(self, key: str, checksum: int) -> bool:
        """Make a reserved slot a readable object."""
        entry = self.reserved.pop(key, None)
        if entry is None:
            return False
        obj = entry[0]
        obj.checksum = checksum
        self.objects[key] = obj
        return True

    # ------------------------------------------------------------ reads

    def lease(self, key: str, now: float) -> Optional[Obj]:
        """The object, marked most recently used and protected from reuse for ``lease_s``."""
        obj = self.objects.get(key)
        if obj is not None:
            self.objects.move_to_end(key)
            obj.lease_until = now + self.lease_s
            obj.readers += 1
        return obj

    def unlease(self, key: str, offset: int) -> int:
        """A writer gives back the slot it reserved for ``key`` at ``offset`` without filling
        it (returns the reserved size), or a reader is done with the lease it took on it
        (returns 0). When no reader is
        left the object is unprotected, and if it was removed meanwhile its slot is free now.
        A reader that never releases (it died) is covered by the lease's end."""
        held = self.reserved.get(key)
        if held is not None and held[0].offset == offset:
            del self.reserved[key]      # a writer gives back a slot it will not fill
            self.alloc.free(offset, held[0].size)
            return held[0].size
        obj = self.objects.get(key)
        if obj is None or obj.offset != offset:
            obj = self._held.get(offset)
        if obj is None or obj.readers <= 0:
            return 0
        obj.readers -= 1
        if obj.readers:
            return 0
        obj.lease_until = 0.0
        if self._held.get(offset) is obj and not obj.busy:
            del self._held[offset]
            self._quarantined_bytes -= obj.size
            self.alloc.free(obj.offset, obj.size)
        return 0

    def view(self, obj: Obj) -> memoryview:
        return memoryview(self.mm)[obj.offset: obj.offset + obj.size]

    # ------------------------------------------------------------ space

    def _allocate(self, size: int, now: float) -> int:
        self._release_quarantine(now)
        offset = self.alloc.allocate(size)
        if offset < 0:
            victims = iter(list(self.objects.items()))
            while offset < 0:
                if not self._evict_next(victims, now):
                    break
                self._release_quarantine(now)
                offset = self.alloc.allocate(size)
        return offset

    def _evict_next(self, victims, now: float) -> bool:
        """Drop the next evictable object of ``victims`` (LRU order); False when none is left."""
        for key, obj in victims:
            if obj.busy or not (obj.on_ssd or self.drop_dirty):
                continue
            self.drop(key, now)
            return True
        return False

    def drop(self, key: str, now: float) -> None:
        """Evict one object; the master hears of it unless a copy stays on SSD."""
        obj = self.objects.pop(key)
        self._free(obj, now)
        if not obj.on_ssd:
            self.dropped.append((key, obj.size))
        self.evictions += 1

    def release(self, obj: Obj, now: float) -> None:
        """The SSD writer is done with ``obj``'s slot."""
        obj.busy -= 1
        if obj.removed and obj.busy == 0:
            self._free(obj, now)

    def _free(self, obj: Obj, now: float) -> None:
        if obj.busy:
            obj.removed = True
        elif obj.lease_until > now:
            heapq.heappush(self._quarantine, (obj.lease_until, obj.offset))
            self._held[obj.offset] = obj
            self._quarantined_bytes += obj.size
        else:
            self.alloc.free(obj.offset, obj.size)

    def _release_quarantine(self, now: float) -> None:
        q = self._quarantine
        while q and q[0][0] <= now:
            _, offset = heapq.heappop(q)
            obj = self._held.get(offset)
            # None: released early by its readers; a later lease end: the slot was reused and
            # quarantined again, and that entry is still in the heap
            if obj is not None and obj.lease_until <= now:
                del self._held[offset]
                self._quarantined_bytes -= obj.size
                self.alloc.free(offset, obj.size)

    def maintain(self, now: float) -> list[tuple[str, int]]:
        """Expire stale reservations, release quarantine, evict above the high watermark;
        returns the (key, size) of each reservation that expired."""
        lapsed = [(k, obj.size) for k, (obj, deadline) in self.reserved.items() if deadline < now]
        for key, _ in lapsed:
            obj, _ = self.reserved.pop(key)
            # the writer may still be copying: keep the slot out of use for one more lease
            obj.lease_until = now + self.lease_s
            self._free(obj, now)
            log.warning("reservation for %s expired before commit; slot reclaimed", key)
        self._release_quarantine(now)
        if self.alloc.used > self.high:
            # quarantined bytes come back by themselves once their leases end
            victims = iter(list(self.objects.items()))
            while self.alloc.used - self._quarantined_bytes > self.low:
                if not self._evict_next(victims, now):
                    break
        return lapsed

    def remove(self, keys: Iterable[str], now: float) -> list[str]:
        gone = []
        for key in keys:
            obj = self.objects.pop(key, None)
            if obj is not None:
                self._free(obj, now)
                gone.append(key)
        return gone

    def clear(self, prefix: str, now: float) -> list[str]:
        return self.remove([k for k in self.objects if k.startswith(prefix)], now)

    def stats(self) -> dict:
        return {"objects": len(self.objects), "used": self.alloc.used, "capacity": self.capacity,
                "reserved": len(self.reserved), "quarantined": len(self._held),
                "evictions": self.evictions}

    def close(self) -> None:
        try:
            self.mm.close()
        except BufferError:  # a zero-copy send still holds a view; the OS reclaims it at exit
            pass
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
