"""The residency wire: what the master's publisher sends and a client's view reads.

One ZeroMQ message of two frames per update: the topic, ``<namespace>/`` (a namespace holds no
'/' and no '#', so one namespace's topic is never a prefix of another's), and an ``Update``.
A second topic per namespace, ``<namespace>#``, carries the keys themselves (``KeyUpdate``) for
an event bridge (sglang/kv_events.py): the master builds it only while someone follows it. Each
namespace numbers its updates 1, 2, 3, ... within one master epoch; a beat repeats the last
number, so a subscriber that missed an update learns it within a beat. The digests are the
keys' 16-byte digests (keydigest.py), end to end, as the master's index holds them.
"""
from __future__ import annotations

from typing import Annotated, Optional

import msgspec
from msgspec import Meta

from .keydigest import digests  # noqa: F401  (the wire's digests: residency.digests)
from .limits import MAX_HEADER_BYTES, MAX_KEY_BYTES, MAX_KEYS, Fence, Name, U64

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


class KeyUpdate(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """The keys stored and removed in one master loop turn (``<namespace>#``). Removals whose
    keys the master does not know (an expired node's: its index holds digests) are only in
    the namespace's ``Update``."""
    epoch: Name
    seq: U64                # numbered apart from the namespace's Updates; a beat repeats it
    stored: Annotated[list[Annotated[str, Meta(max_length=MAX_KEY_BYTES)]], Meta(max_length=MAX_KEYS)]
    removed: Annotated[list[Annotated[str, Meta(max_length=MAX_KEY_BYTES)]], Meta(max_length=MAX_KEYS)]
    beat: bool = False


_ENC = msgspec.msgpack.Encoder()
_DEC = msgspec.msgpack.Decoder(Update)
_DEC_KEYS = msgspec.msgpack.Decoder(KeyUpdate)


def encode(update) -> bytes:
    return _ENC.encode(update)


def decode_keys(frame) -> Optional[KeyUpdate]:
    try:
        return _DEC_KEYS.decode(frame)
    except msgspec.DecodeError:
        return None


def decode(frame) -> Optional[Update]:
    """The update in ``frame``, or None when it is not one (it comes from the authenticated
    master, but a version mismatch must not kill the subscriber)."""
    try:
        return _DEC.decode(frame)
    except msgspec.DecodeError:
        return None


def topic(namespace: str) -> bytes:
    return namespace.encode() + b"/"


def key_topic(namespace: str) -> bytes:
    return namespace.encode() + b"#"


def namespace_of_topic(data: bytes) -> Optional[tuple[str, bool]]:
    """(namespace, whether the keys topic) of a subscription, or None when it names no
    namespace (no prefix subscriptions: a topic is exactly ``<namespace>/`` or ``<namespace>#``)."""
    if len(data) > MAX_TOPIC or not data[-1:] in (b"/", b"#") or \
            data.count(b"/") + data.count(b"#") != 1:
        return None
    try:
        return data[:-1].decode("ascii"), data.endswith(b"#")
    except UnicodeDecodeError:
        return None

