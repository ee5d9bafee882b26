"""The residency wire: what the master's publisher sends and a client's view reads.

One ZeroMQ message of two frames per update: the topic, ``<namespace>/`` (a namespace holds no
'/', so one namespace's topic is never a prefix of another's), and an ``Update``. Each
namespace numbers its updates 1, 2, 3, ... within one master epoch; a beat repeats the last
number, so a subscriber that missed an update learns it within a beat. The digests are the
keys' xxh3-128 digests (16 bytes each, end to end), as the master's index holds them.
"""
from __future__ import annotations

from typing import Annotated, Optional

import msgspec
from msgspec import Meta
from xxhash import xxh3_128_digest

from .limits import MAX_HEADER_BYTES, MAX_KEYS, Fence, Name, U64

DIGEST = 16
CHUNK = MAX_KEYS            # digests per update at most (a node's expiry is sent in chunks)
MAX_TOPIC = 128             # bytes of a subscription message the publisher accepts


class Update(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    epoch: Name             # the master's incarnation
    seq: U64                # the namespace's update number (a beat: the last one sent)
    added: Annotated[bytes, Meta(max_length=MAX_HEADER_BYTES)]     # digests now stored
    removed: Annotated[bytes, Meta(max_length=MAX_HEADER_BYTES)]   # digests no longer stored
    # the reports of each live node the master had applied when it sent this (read-your-writes:
    # a writer's fence names one); a data update lists the nodes whose reports moved this turn
    nodes: Fence
    beat: bool = False      # no change: "the last update of this namespace is seq"


_ENC = msgspec.msgpack.Encoder()
_DEC = msgspec.msgpack.Decoder(Update)


def encode(update: Update) -> bytes:
    return _ENC.encode(update)


def decode(frame) -> Optional[Update]:
    """The update in ``frame``, or None when it is not one (it comes from the authenticated
    master, but a version mismatch must not kill the subscriber)."""
    try:
        return _DEC.decode(frame)
    except msgspec.DecodeError:
        return None


def topic(namespace: str) -> bytes:
    return namespace.encode() + b"/"


def namespace_of_topic(data: bytes) -> Optional[str]:
    """The namespace a subscription names, or None when it names none (no prefix
    subscriptions: a topic is exactly ``<namespace>/``)."""
    if not data.endswith(b"/") or len(data) > MAX_TOPIC or data.count(b"/") != 1:
        return None
    try:
        return data[:-1].decode("ascii")
    except UnicodeDecodeError:
        return None


def digests(keys: list[str]) -> bytes:
    """The keys' digests end to end, as the master's index holds them."""
    return b"".join(map(xxh3_128_digest, map(str.encode, keys)))
