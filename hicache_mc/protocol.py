"""Wire protocol: typed messages with msgpack headers; page bytes travel as separate frames.

A message on the wire is one ZeroMQ multipart message::

    [header, payload_0, payload_1, ...]
    header = msgpack([VERSION, type_name, request_id, token, [field values in declaration order]])

Payload frames carry object bytes (``Write`` requests, ``Read`` replies) and are sent with
``copy=False``; they never go through msgpack. No pickle anywhere. ROUTER sockets see the peer
identity as an extra leading frame, which the services strip before ``decode``.

Every request class is named ``<Verb>Request`` and is answered by ``<Verb>Reply`` or by
``ErrorReply`` (bad input, bad token, unknown type, wrong version, server-side failure).
"""
from __future__ import annotations

import dataclasses
import functools
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Optional

import msgpack

from .errors import ProtocolError, RemoteError

VERSION = 7   # bump whenever a message's fields or meaning change (3: column-wise locations, Release,
              # data_address; 4: locations without checksums; 5: commit sequence numbers, fences;
              # 6: arenas, grants with a ttl instead of a node-clock deadline; 7: an arena commit
              # may ask for the next arena, Place names the cluster's only node)
# Limits on what a peer can make a server decode. A header frame bigger than MAX_HEADER_BYTES
# is refused by ZeroMQ itself (the sender is disconnected) before it is buffered whole; within
# it, msgpack refuses lists longer than MAX_KEYS while unpacking, so no request can keep a
# service's loop busy for long (2M keys took the master ~4 s: longer than the liveness window).
# SGLang's hybrid controller probes every page of a request in one call: 128k keys = 4M tokens
# at page size 64 with K and V objects.
MAX_HEADER_BYTES = 16 << 20
MAX_KEYS = 1 << 17
MAX_KEY_BYTES = 1024          # longer keys are refused (the SSD record header holds up to 65535)
_U64 = (1 << 64) - 1

_REGISTRY: dict[str, type["Message"]] = {}


class Message:
    """Base of every wire message. Subclasses are frozen dataclasses registered by name."""
    TYPE: ClassVar[str]

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.TYPE = cls.__name__
        _REGISTRY[cls.TYPE] = cls


# element types whose lists are checked in one C-level pass (msgpack yields exact types)
_EXACT = {str: {str}, int: {int}, bool: {bool}, list: {list}, dict: {dict}, float: {int, float},
          type(None): {type(None)}}


def _exact(item: Any) -> Optional[set]:
    """The exact element types a list of ``item`` may hold (Optional[str] too), or None."""
    if typing.get_origin(item) is typing.Union:
        parts = [_EXACT.get(h) for h in typing.get_args(item)]
        return None if None in parts else set().union(*parts)
    return _EXACT.get(item)


@functools.lru_cache(maxsize=None)
def _checker(hint: Any) -> Callable[[Any], bool]:
    """A predicate for values of type ``hint``, built once per hint (decode is a hot path)."""
    origin = typing.get_origin(hint)
    if hint is Any:
        return lambda v: True
    if origin is typing.Union:
        options = tuple(_checker(h) for h in typing.get_args(hint))
        return lambda v: any(c(v) for c in options)
    if hint is type(None):
        return lambda v: v is None
    if origin is list:
        (item,) = typing.get_args(hint) or (Any,)
        if item is Any:
            return lambda v: isinstance(v, list)
        allowed = _exact(item)
        if allowed is not None:
            return lambda v: isinstance(v, list) and (not v or set(map(type, v)) <= allowed)
        inner = _checker(item)
        return lambda v: isinstance(v, list) and all(map(inner, v))
    if origin is dict:
        return lambda v: isinstance(v, dict)
    if hint is float:
        return lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
    if hint is int:
        return lambda v: isinstance(v, int) and not isinstance(v, bool)
    if hint in (list, dict, str, bool):
        return lambda v: isinstance(v, hint)
    return lambda v: True


def message(cls):
    """Class decorator: a frozen dataclass message with field type checks on decode."""
    cls = dataclass(frozen=True)(cls)
    cls._hints = typing.get_type_hints(cls)
    cls._fields = tuple(f.name for f in dataclasses.fields(cls))
    cls._checks = tuple(_checker(cls._hints[name]) for name in cls._fields)
    return cls


# ---------------------------------------------------------------- generic replies

@message
class ErrorReply(Message):
    code: str            # bad_request | bad_token | bad_version | unknown_type | internal | ...
    message: str


@message
class OkReply(Message):
    pass


# ---------------------------------------------------------------- master: client side

# Read-your-writes. A node answers a commit as soon as it has sent ``Committed`` to the
# master (not when the master acknowledges: that was a second round trip on every put). The
# writer's reply carries the node's commit sequence number; the writer passes it back to the
# master as a fence (``after``: node id -> [segment id, seq]) with its next lookups, and the
# master answers them only once it has applied that node's Committed up to that seq (or after
# FENCE_WAIT_S, in the master). Other clients see the keys as soon as the master has the
# node's message, which the node sends before it answers the writer.


def _fence() -> dict:
    return {}


@message
class ExistsRequest(Message):
    keys: list[str]
    after: dict[str, list] = field(default_factory=_fence)


class Locations:
    """Where keys live, column-wise (cheap to build, encode and decode for 128+ keys): key i
    is held by node ``held_by[holders[i]]`` (-1: the master does not have it), with
    ``sizes[i]`` bytes; ``nodes`` maps each holder's id to its ``NodeInfo.to_dict()``. (The
    fields are declared by the messages that use this.) Checksums are not sent: a reader
    checks its copy against the checksum the holding node gives with the bytes."""

    def located(self) -> list:
        """Per key: (node_id, size), or None where the master does not have it."""
        names = self.held_by
        return [None if h < 0 else (names[h], size) for h, size in zip(self.holders, self.sizes)]


@message
class ExistsReply(Message, Locations):
    count: int           # length of the leading run of keys stored on live nodes
    # The locations of that run's keys: the client may keep them briefly for the get that
    # usually follows, saving a Locate round trip.
    held_by: list[str]
    holders: list[int]
    sizes: list[int]
    nodes: dict[str, dict]


@message
class ContainsRequest(Message):
    keys: list[str]
    after: dict[str, list] = field(default_factory=_fence)


@message
class ContainsReply(Message):
    present: list[bool]      # per key, stored on a live node (not a prefix run)


@message
class LocateRequest(Message):
    keys: list[str]
    after: dict[str, list] = field(default_factory=_fence)


@message
class LocateReply(Message, Locations):
    # Every key's location (holder -1 for a key the master does not have); see Locations.
    held_by: list[str]
    holders: list[int]
    sizes: list[int]
    nodes: dict[str, dict]


@message
class PlaceRequest(Message):
    keys: list[str]
    sizes: list[int]
    host: str                # the writer's host, for placement on its own host first


@message
class PlaceReply(Message):
    targets: list[Optional[str]]  # node id per key; None = already stored (nothing to write)
    nodes: dict[str, dict]
    # The cluster's only node, on the writer's host: for a while the writer may put into arenas
    # of it without asking (see StoreClient._put_local).
    sole: str = ""


@message
class StatsRequest(Message):
    pass


@message
class HelloRequest(Message):
    pass


@message
class HelloReply(Message):
    epoch: str
    direct_address: str      # host:port of the master's direct port; empty when it has none


@message
class StatsReply(Message):
    stats: dict


# ---------------------------------------------------------------- master: node side

@message
class RegisterRequest(Message):
    node: dict               # NodeInfo.to_dict()


@message
class RegisterReply(Message):
    epoch: str


@message
class HeartbeatRequest(Message):
    node_id: str
    stats: dict


@message
class HeartbeatReply(Message):
    epoch: str
    known: bool              # False: the master does not know this node; register again
    quotas: dict             # tenant -> bytes this node may hold for it (its share of the quota)


@message
class QuotaRequest(Message):
    tenant: str
    quota: int               # bytes across the cluster; -1 removes the quota


@message
class CommittedRequest(Message):
    node_id: str
    keys: list[str]
    sizes: list[int]
    checksums: list[int]
    seq: int = 0             # the node's commit sequence number this message completes (0: none)


@message
class EvictedRequest(Message):
    node_id: str
    keys: list[str]


# ---------------------------------------------------------------- node data plane

@message
class ReadRequest(Message):
    keys: list[str]


@message
class ReadReply(Message):
    # tcp: one payload frame per found key, in order. sizes[i] == -1 marks a missing key.
    sizes: list[int]
    checksums: list[int]


@message
class LeaseRequest(Message):
    keys: list[str]


LEASE_STREAM = -3  # LeaseReply offset: stored, but read it with ReadRequest (not staged in DRAM)


@message
class LeaseReply(Message):
    # offsets into the node's segment, the reader's for `ttl` seconds counted from when it sent
    # the Lease (the node's monotonic clock is not the reader's: it may be on another host)
    offsets: list[int]       # -1 = missing; LEASE_STREAM = read it over tcp
    sizes: list[int]
    checksums: list[int]
    ttl: float
    segment: str             # the id of the segment the offsets are in (see segment_of)


@message
class ReleaseRequest(Message):
    # A reader is done with the slots it leased, or a writer gives back slots it reserved and
    # will not fill: [key, offset] as the Lease/ReserveReply gave them. Answered with OkReply
    # (the sender need not wait for it). Once every reader of an object has released it, its
    # slot may be reused at once instead of when the lease runs out.
    keys: list[str]
    offsets: list[int]


@message
class WriteRequest(Message):
    keys: list[str]          # one payload frame per key
    checksums: list[int]


@message
class WriteReply(Message):
    ok: list[bool]
    seq: int = 0             # the node's commit sequence number (a fence for the writer's lookups)


@message
class ReserveRequest(Message):
    keys: list[str]
    sizes: list[int]
    # False: only free space, now (no eviction, no waiting for room): a writer reserving
    # before the master has placed the keys must not make room it may not use
    evict: bool = True


RESERVE_FULL = -1    # ReserveReply offset: no room for it (or over quota / too large)
RESERVE_STORED = -2  # stored already, durably as the node's policy says: nothing to write
RESERVE_BUSY = -4    # another writer is storing it right now: not acknowledged to this one


@message
class ReserveReply(Message):
    offsets: list[int]       # >= 0 = a slot; or RESERVE_FULL / RESERVE_STORED / RESERVE_BUSY
    ttl: float               # commit within this many seconds of sending the Reserve
    segment: str             # the id of the segment the offsets are in (see segment_of)


@message
class CommitRequest(Message):
    keys: list[str]
    checksums: list[int]
    # the slot each key was reserved at: a commit that outlived its reservation, while another
    # writer reserved the same key elsewhere, commits nothing (it would commit the other
    # writer's slot, unwritten or half-written)
    offsets: list[int]
    # With an arena (an id from ArenaReply), the offsets are places the writer chose in that
    # arena itself, in ascending order from where its last commit ended, ``sizes`` long (each
    # taking its size rounded up to SLOT_ALIGN); the space skipped between them goes back.
    arena: int = 0
    sizes: list[int] = field(default_factory=list)
    # With an arena commit: also lend a new arena of up to this many bytes (as ArenaRequest),
    # once the commit is done; the reply's ``lent`` has it. Saves the writer a message.
    lend: int = 0


# An arena is a region of a node's free DRAM lent to one writer, which places the objects of
# its next puts in it itself and names their offsets in its Commit: a put needs no Reserve
# round trip. The lender keeps the region while commits keep coming (each renews it); unused
# for reserve_s, it goes back to the node's free space.
SLOT_ALIGN = 256     # objects start on this boundary and take their size rounded up to it


@message
class ArenaRequest(Message):
    size: int                # bytes wanted (the node may lend less); 0: none
    give_back: int = 0       # an arena this writer is done with (its unused rest is freed)


@message
class ArenaReply(Message):
    arena: int               # its id (0: none lent: no room)
    offset: int
    size: int
    ttl: float               # write and commit within this many seconds of sending the request;
                             # each commit into it renews that from when it was sent
    segment: str


@message
class CommitReply(Message):
    ok: list[bool]
    seq: int = 0             # as WriteReply.seq
    lent: list = field(default_factory=list)    # ArenaReply's fields when the commit asked to ``lend``


@message
class ClearRequest(Message):
    prefix: str              # "" clears everything


@message
class ClearReply(Message):
    removed: int


@message
class NodeStatsRequest(Message):
    pass


# ---------------------------------------------------------------- shared records

@dataclass
class NodeInfo:
    """What a node tells the master about itself, and what clients need to reach it."""
    node_id: str
    address: str             # tcp://host:port of its data plane
    host: str                # machine identity (hostname + boot id) for same-host shm
    shm_path: str            # the DRAM segment file, mappable by same-host clients
    capacity: int
    prefault: bool = False   # the segment is resident: clients may map it pre-populated
    # Mooncake Transfer Engine (empty when the node runs none): the TE segment name clients
    # address, the node-process address of the segment's first byte (offsets are added to it),
    # and the TE protocol (tcp | rdma). Older nodes omit these; from_dict fills the defaults.
    te_address: str = ""
    te_base: int = 0
    te_protocol: str = ""
    # host:port of the node's stream port (transport/stream.py); empty for a node without one
    data_address: str = ""
    # host:port where the node takes its requests over plain TCP (rpc.py); empty: none
    direct_address: str = ""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "NodeInfo":
        """The record, with every field type-checked (it comes from the network)."""
        hints = _node_hints()
        for f in dataclasses.fields(cls):
            if f.name in d and not _matches(d[f.name], hints[f.name]):
                raise ProtocolError(f"node record: {f.name} must be {hints[f.name].__name__}, "
                                    f"got {type(d[f.name]).__name__}")
        if isinstance(d.get("capacity"), int) and d["capacity"] < 0:
            raise ProtocolError("node record: capacity must be >= 0")
        try:
            return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d})
        except (KeyError, TypeError) as exc:
            raise ProtocolError(f"bad node record: {exc}") from None


def segment_of(node: NodeInfo) -> str:
    """The id of the DRAM segment a node record describes (new with every node process).
    Lease and Reserve replies name theirs: a client holding an older record of a node that
    restarted at the same address must not use the new segment's offsets with the old
    segment's mapping (or Transfer Engine address)."""
    return node.shm_path.rsplit("-", 1)[-1]


@functools.lru_cache(maxsize=1)
def _node_hints() -> dict:
    return typing.get_type_hints(NodeInfo)


# ---------------------------------------------------------------- encode / decode

def encode(msg: Message, req_id: int = 0, token: str = "", payload: Optional[list] = None) -> list:
    """Frames for ``msg``: the msgpack header, then the payload buffers untouched."""
    values = [getattr(msg, name) for name in msg._fields]
    header = msgpack.packb([VERSION, msg.TYPE, req_id, token, values], use_bin_type=True)
    return [header] + list(payload or ())


def decode_header(frame) -> tuple[str, int, str, list]:
    """(type_name, req_id, token, values) of a header frame, checking version and shape."""
    buf = frame.buffer if hasattr(frame, "buffer") else frame
    if len(buf) > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {len(buf)} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        doc = msgpack.unpackb(buf, raw=False, strict_map_key=False, max_array_len=MAX_KEYS,
                              max_map_len=MAX_KEYS, max_str_len=MAX_HEADER_BYTES,
                              max_bin_len=MAX_HEADER_BYTES)
    except Exception as exc:
        raise ProtocolError(f"header is not valid msgpack: {exc}") from None
    if not isinstance(doc, list) or len(doc) != 5:
        raise ProtocolError("header must be [version, type, request_id, token, fields]")
    version, type_name, req_id, token, values = doc
    if version != VERSION:
        raise ProtocolError(f"protocol version {version!r} is not supported (this side speaks {VERSION})",
                            code="bad_version")
    if not isinstance(type_name, str) or not isinstance(req_id, int) or not isinstance(token, str) \
            or not isinstance(values, list):
        raise ProtocolError("header fields have wrong types")
    return type_name, req_id, token, values


def build(type_name: str, values: list) -> Message:
    """The message object for a decoded header; checks the type name and field types."""
    cls = _REGISTRY.get(type_name)
    if cls is None:
        raise ProtocolError(f"unknown message type {type_name!r}", code="unknown_type")
    if len(values) != len(cls._fields):
        raise ProtocolError(f"{type_name}: expected {len(cls._fields)} fields "
                            f"({', '.join(cls._fields)}), got {len(values)}")
    for name, value, check in zip(cls._fields, values, cls._checks):
        if not check(value):
            raise ProtocolError(f"{type_name}.{name}: expected {cls._hints[name]}, got {type(value).__name__}")
        if name == "keys" and value and max(map(len, value)) > MAX_KEY_BYTES:
            raise ProtocolError(f"{type_name}.keys: a key is longer than {MAX_KEY_BYTES} characters")
        if name == "checksums" and value and (min(value) < 0 or max(value) > _U64):
            raise ProtocolError(f"{type_name}.checksums: values must lie in 0..2^64-1")
    return cls(*values)


def decode(frames: list) -> tuple[Message, int, str, list]:
    """(message, req_id, token, payload frames) from a multipart message without identity."""
    if not frames:
        raise ProtocolError("empty message")
    type_name, req_id, token, values = decode_header(frames[0])
    return build(type_name, values), req_id, token, list(frames[1:])


def raise_if_error(msg: Message) -> Message:
    """Turn an ErrorReply into RemoteError; pass any other message through."""
    if isinstance(msg, ErrorReply):
        raise RemoteError(msg.code, msg.message)
    return msg


def _matches(value: Any, hint: Any) -> bool:
    return _checker(hint)(value)
