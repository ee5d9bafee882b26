"""The SSD tier's on-disk format: records in append-only segment files, and their scan.

Little endian, one record after another in ``seg-<n>.dat`` files of at most ``segment_bytes``
each (a larger record gets a segment of its own)::

    magic   4s   b"HCR1"
    version u8   1
    kind    u8   1 = object, 2 = tombstone (the key was removed on purpose)
    key_len u16
    hcrc    u32  crc32 of this header (with hcrc = 0) and the key
    vlen    u64  value bytes that follow the key (0 for a tombstone)
    vsum    u64  xxh3-64 of the value (the object's checksum, as clients verify it)
    key     key_len bytes, UTF-8
    value   vlen bytes

A scan reads every segment in order; a header that fails its magic, version, crc or length
check ends that segment's scan (a torn tail), and later segments go on.
"""
from __future__ import annotations

import logging
import os
import struct
import zlib
from dataclasses import dataclass

log = logging.getLogger(__name__)

HEADER = struct.Struct("<4sBBHIQQ")
MAGIC = b"HCR1"
FORMAT_VERSION = 1
KIND_OBJECT, KIND_TOMBSTONE = 1, 2


@dataclass(slots=True)
class Rec:
    seg: int
    offset: int        # where the value starts in the segment file
    size: int
    checksum: int


def header_for(kind: int, key: bytes, vlen: int, vsum: int) -> bytes:
    crc = zlib.crc32(HEADER.pack(MAGIC, FORMAT_VERSION, kind, len(key), 0, vlen, vsum) + key)
    return HEADER.pack(MAGIC, FORMAT_VERSION, kind, len(key), crc, vlen, vsum) + key


def scan_segment(path: str, seg: int):
    """Yield (kind, key, Rec) for every intact record header of one segment file."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        pos = 0
        while pos + HEADER.size <= size:
            f.seek(pos)
            head = f.read(HEADER.size)
            magic, ver, kind, klen, crc, vlen, vsum = HEADER.unpack(head)
            if magic != MAGIC or ver != FORMAT_VERSION or kind not in (KIND_OBJECT, KIND_TOMBSTONE):
                log.warning("%s: bad record header at %d; ignoring the rest of the segment", path, pos)
                return
            key = f.read(klen)
            value_at = pos + HEADER.size + klen
            if len(key) != klen or value_at + vlen > size:
                log.warning("%s: torn record at %d; ignoring the rest of the segment", path, pos)
                return
            if zlib.crc32(HEADER.pack(MAGIC, ver, kind, klen, 0, vlen, vsum) + key) != crc:
                log.warning("%s: record header checksum mismatch at %d; ignoring the rest", path, pos)
                return
            try:
                name = key.decode()
            except UnicodeDecodeError:
                return
            yield kind, name, Rec(seg, value_at, vlen, vsum)
            pos = value_at + vlen
