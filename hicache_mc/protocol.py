"""Wire protocol: typed messages, one msgpack frame each, validated by schema on decode.

A message on the wire is one ZeroMQ frame::

    msgpack([VERSION, request_id, [TypeName, field values in declaration order...]])

Messages are msgspec structs (``array_like``, tagged with their class name). ``decode`` checks
the whole frame against the schema in C: every container and string of a request has a
maximum length, checked before its elements are read, so the work a frame can cause is bounded
by the schema (see the limits below). No pickle anywhere. ROUTER sockets see the peer identity as an
extra leading frame, which the services strip before ``decode``. Peers are authenticated by
ZeroMQ (ZAP/CURVE), not by the messages.

Every request class is named ``<Verb>Request`` and is answered by ``<Verb>Reply`` or by
``ErrorReply`` (bad input, unknown type, wrong version, server-side failure).
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Annotated, Any, NamedTuple, Optional, Union

import msgspec
from msgspec import Meta

from .errors import ProtocolError, RemoteError
from .frame_errors import peek, split
from .limits import (  # noqa: F401  (the limits are part of the protocol)
    MAX_KEYS, MAX_KEY_BYTES, MAX_HEADER_BYTES, MAX_NAME, MAX_TEXT, MAX_NODES, MAX_FIELDS,
    MAX_TENANTS, MAX_REPLICAS, Key, Name, Text, U64, Keys, Ints, Bools, Checksums, NodeIds, Fence,
    NodeRecord, NodeRecords, TenantBytes, NodeStats, Replicas, Copies)

VERSION = 11  # bump whenever a message's fields or meaning change


class Message(msgspec.Struct, frozen=True, array_like=True, tag=True, forbid_unknown_fields=True):
    """Base of every wire message: on the wire ``[TypeName, field values...]``."""


# ---------------------------------------------------------------- generic replies

class ErrorReply(Message):
    code: Name           # bad_request | bad_version | unknown_type | internal | ...
    message: Text


class OkReply(Message):
    pass


# ---------------------------------------------------------------- master: client side

# Read-your-writes. A node answers a commit once it has sent ``Committed`` to the master, with
# its report sequence number; the writer passes that back as a fence (``after``: node id ->
# [segment id, seq]) with its next lookups, which the master answers only once it has applied
# that node's reports up to that seq (or after FENCE_WAIT_S, in the master). Other clients
# see the keys once the master has the node's message, sent before the node answers the writer.


# Lookups that answer locations (Exists, Locate) name the reader's host (``near``: a key with
# copies is answered with the copy on that host first) and the nodes it cannot reach now
# (``avoid``: its circuit for them is open), whose copies it is not sent to.

class ExistsRequest(Message):
    keys: Keys
    after: Fence = {}
    near: Name = ""
    avoid: NodeIds = []


class Locations:
    """Where keys live, column-wise (cheap to build, encode and decode for 128+ keys): key i
    is held by node ``held_by[holders[i]]`` (-1: the master does not have it), with
    ``sizes[i]`` bytes; ``nodes`` maps each holder's id to its ``NodeInfo.to_dict()``. (The
    fields are declared by the messages that use this.) Checksums are not sent: a reader
    checks its copy against the checksum the holding node gives with the bytes."""
    __slots__ = ()

    def located(self) -> list:
        """Per key: (node_id, size), or None where the master does not have it."""
        names = self.held_by
        return [None if h < 0 else (names[h], size) for h, size in zip(self.holders, self.sizes)]


class ExistsReply(Message, Locations):
    count: int           # length of the leading run of keys stored on live nodes
    # The locations of that run's keys: the client may keep them briefly for the get that
    # usually follows, saving a Locate round trip.
    held_by: NodeIds
    holders: Ints
    sizes: Ints
    nodes: NodeRecords


class ContainsRequest(Message):
    keys: Keys
    after: Fence = {}


class ContainsReply(Message):
    present: Bools   # per key, stored on a live node (not a prefix run)


class LocateRequest(Message):
    keys: Keys
    after: Fence = {}
    near: Name = ""
    avoid: NodeIds = []


class LocateReply(Message, Locations):
    # Every key's location (holder -1 for a key the master does not have); see Locations.
    held_by: NodeIds
    holders: Ints
    sizes: Ints
    nodes: NodeRecords


class PlaceRequest(Message):
    keys: Keys
    sizes: Ints
    host: Name               # the writer's host, for placement on its own host first
    # The keys are consecutive pages of one prefix chain, as SGLang writes them: the master
    # keeps a chain on one node, so a node's loss cuts only its own chains. ``parent``: the
    # key before keys[0] in the chain ("" = its first, or not known): the keys follow it,
    # unless other chains have branched off it (then they start a chain of their own).
    parent: Key = ""
    hot: U64 = 0             # the first ``hot`` keys want ``replicas`` copies, the rest one
    replicas: Replicas = 1
    avoid: NodeIds = []      # nodes the writer cannot reach now (its circuit is open)


class PlaceReply(Message):
    # node id per key; None = already stored (nothing to write); "" = no live node
    targets: Annotated[list[Optional[Name]], Meta(max_length=MAX_KEYS)]
    nodes: NodeRecords
    # per key (or []: none anywhere), further nodes to write a copy of it to; a key already
    # stored (target None) may still want copies
    copies: Copies = []


class StatsRequest(Message):
    pass


class StatsReply(Message):
    # the master's or a node's stats, nested (lists of node records, per-tenant maps); a reply
    # comes from a server the client chose, so its values are not typed further
    stats: Annotated[dict[str, Any], Meta(max_length=MAX_FIELDS)]


# Residency (master/publisher.py, client/view.py): a client asks for the keys of a namespace
# (as their xxh3-128 digests, 16 bytes each, end to end), then follows the master's changes of it
# on the publisher port, from ``seq`` on.

class SnapshotRequest(Message):
    namespace: Key


class SnapshotReply(Message):
    epoch: Name              # the master's incarnation: updates of another epoch do not follow
    seq: U64                 # the namespace's last update sequence number the digests include
    digests: Annotated[bytes, Meta(max_length=MAX_HEADER_BYTES)]
    nodes: Fence             # each live node's reports applied: node id -> [segment, seq]
    port: int                # the publisher's port (on the master's host)
    beat_s: float            # the publisher sends each subscribed namespace a beat this often


# ---------------------------------------------------------------- master: node side

class RegisterRequest(Message):
    node: NodeRecord         # NodeInfo.to_dict()


class RegisterReply(Message):
    epoch: Name


class HeartbeatRequest(Message):
    node_id: Name
    stats: NodeStats


class HeartbeatReply(Message):
    epoch: Name
    known: bool              # False: the master does not know this node; register again
    quotas: TenantBytes      # tenant -> bytes this node may hold for it (its share of the quota)


class QuotaRequest(Message):
    tenant: Name
    quota: int               # bytes across the cluster; -1 removes the quota


class CommittedRequest(Message):
    node_id: Name
    keys: Keys
    sizes: Ints
    checksums: Checksums
    seq: U64 = 0             # the node's report sequence number (0: its inventory, unnumbered)


class EvictedRequest(Message):
    node_id: Name
    keys: Keys
    # numbered in the same sequence as CommittedRequest: the master applies a node's reports
    # in that order only, so an eviction never undoes a later commit of the same key
    seq: U64 = 0
    cleared: bool = False    # removed by a ClearRequest, not evicted (counted apart)


# ---------------------------------------------------------------- node data plane

class LeaseRequest(Message):
    keys: Keys


LEASE_MISSING = -1   # LeaseReply offset: the node does not hold the key
# LeaseReply offset: stored on SSD only, and DRAM has no room to stage it while this batch's
# other objects are leased: ask again once they are released
LEASE_LATER = -3


class LeaseReply(Message):
    # offsets into the node's segment, the reader's for `ttl` seconds counted from when it sent
    # the Lease (the node's monotonic clock is not the reader's: it may be on another host)
    offsets: Ints            # -1 = missing; or LEASE_LATER
    sizes: Ints
    checksums: Checksums
    ttl: float
    segment: Name            # the id of the segment the offsets are in (see segment_of)


class ReleaseRequest(Message):
    # A reader is done with the slots it leased, or a writer gives back slots it reserved and
    # will not fill: [key, offset] as the Lease/ReserveReply gave them. Answered with OkReply
    # (the sender need not wait for it). Once every reader of an object has released it, its
    # slot may be reused at once instead of when the lease runs out.
    keys: Keys
    offsets: Ints
    # per key (or empty): the reader's copy, made under the lease, did not match the checksum.
    # The node hashes each such object still at that offset and drops it (telling the master
    # before it answers) when it does not match either: a re-put then stores it again.
    damaged: Bools = []


class ReserveRequest(Message):
    keys: Keys
    sizes: Ints


RESERVE_FULL = -1    # ReserveReply offset: no room for it (or over quota / too large)
RESERVE_STORED = -2  # stored already, durably as the node's policy says: nothing to write
RESERVE_BUSY = -4    # another writer is storing it right now: not acknowledged to this one


class ReserveReply(Message):
    offsets: Ints            # >= 0 = a slot; or RESERVE_FULL / RESERVE_STORED / RESERVE_BUSY
    ttl: float               # commit within this many seconds of sending the Reserve
    segment: Name            # the id of the segment the offsets are in (see segment_of)


class CommitRequest(Message):
    keys: Keys
    checksums: Checksums
    # the slot each key was reserved at: a commit that outlived its reservation, while another
    # writer reserved the same key elsewhere, commits nothing (it would commit the other
    # writer's slot, unwritten or half-written)
    offsets: Ints


class CommitReply(Message):
    ok: Bools
    seq: U64 = 0             # the node's report sequence number (a fence for the writer's lookups)


class ClearRequest(Message):
    prefix: Key              # "" clears everything


class ClearReply(Message):
    removed: int


class NodeStatsRequest(Message):
    pass


_REGISTRY: dict[str, type[Message]] = {cls.__name__: cls for cls in Message.__subclasses__()}


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
    # and the TE protocol (tcp | rdma). Nodes without one omit these; from_dict fills the defaults.
    te_address: str = ""
    te_base: int = 0
    te_protocol: str = ""
    # host:port of the node's stream port (transport/stream.py); empty for a node without one
    data_address: str = ""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "NodeInfo":
        """The record, with every field type-checked (it comes from the network)."""
        try:
            info = msgspec.convert(d, cls)
        except msgspec.ValidationError as exc:
            text, path = split(exc)
            raise ProtocolError(f"node record: {path.lstrip('.') + ': ' if path else ''}{text}") \
                from None
        if info.capacity < 0:
            raise ProtocolError("node record: capacity must be >= 0")
        return info


def segment_of(node: NodeInfo) -> str:
    """The id of the DRAM segment a node record describes (new with every node process).
    Lease and Reserve replies name theirs: a client holding an older record of a node that
    restarted at the same address must not use the new segment's offsets with the old
    segment's mapping (or Transfer Engine address)."""
    return node.shm_path.rsplit("-", 1)[-1]


# ---------------------------------------------------------------- encode / decode

class Decoded(NamedTuple):
    msg: Message
    req_id: int          # the sender's; a reply carries the request's


_ENCODER = msgspec.msgpack.Encoder()
# Servers decode requests only (every field bounded); clients replies only (a StatsReply holds
# free-form stats, from a server the client chose to ask).
_REQUEST_TYPES = tuple(c for name, c in _REGISTRY.items() if name.endswith("Request"))
_REPLY_TYPES = tuple(c for c in _REGISTRY.values() if c not in _REQUEST_TYPES)
_REQUESTS = msgspec.msgpack.Decoder(tuple[int, int, Union[_REQUEST_TYPES]])
_REPLIES = msgspec.msgpack.Decoder(tuple[int, int, Union[_REPLY_TYPES]])


def encode(msg: Message, req_id: int = 0) -> bytes:
    """The frame for ``msg``: msgpack ``[VERSION, req_id, [TypeName, fields...]]``."""
    return _ENCODER.encode((VERSION, req_id, msg))


def decode(frame, request: bool = True) -> Decoded:
    """The message and request id of a frame (bytes, memoryview or zmq.Frame): a request
    (a server's side), or with ``request=False`` a reply (a client's side).

    Raises ProtocolError with ``code`` bad_version, unknown_type or bad_request, and
    ``req_id`` set where the frame's request id could be read (else 0)."""
    buf = frame.buffer if hasattr(frame, "buffer") else frame
    if len(buf) > MAX_HEADER_BYTES:
        raise ProtocolError(f"frame of {len(buf)} bytes exceeds {MAX_HEADER_BYTES}",
                            req_id=peek(buf)[1])
    try:
        version, req_id, msg = (_REQUESTS if request else _REPLIES).decode(buf)
    except msgspec.DecodeError as exc:
        raise _refusal(buf, exc) from None
    except Exception as exc:    # e.g. RecursionError: never out of decode as anything else
        raise ProtocolError(f"undecodable frame: {type(exc).__name__}", req_id=peek(buf)[1]) from None
    if version != VERSION:
        raise _bad_version(version, req_id)
    return Decoded(msg, req_id)


def raise_if_error(msg: Message) -> Message:
    """Turn an ErrorReply into RemoteError; pass any other message through."""
    if isinstance(msg, ErrorReply):
        raise RemoteError(msg.code, msg.message)
    return msg


def _bad_version(version: int, req_id: int) -> ProtocolError:
    return ProtocolError(f"protocol version {version} is not supported (this side speaks "
                         f"{VERSION})", code="bad_version", req_id=req_id)


_FIELD = re.compile(r"\[2\]\[(\d+)\](.*)")   # [2][i]: the message's i-th element


def _refusal(buf, exc: msgspec.DecodeError) -> ProtocolError:
    """The ProtocolError for a frame msgspec refused, with its code and request id."""
    version, req_id, name, length = peek(buf)
    if version is not None and version != VERSION:
        return _bad_version(version, req_id)
    if not isinstance(exc, msgspec.ValidationError):
        return ProtocolError(f"frame is not valid msgpack: {exc}", req_id=req_id)
    text, path = split(exc)
    if path == "[2][0]" and text.startswith("invalid value"):
        return ProtocolError(f"unknown message type {name[:64]!r}" if name else
                             f"unknown message type ({text})", code="unknown_type", req_id=req_id)
    cls, field = _REGISTRY.get(name), _FIELD.fullmatch(path)
    fields = cls.__struct_fields__ if cls is not None else ()
    if cls is not None and path == "[2]" and "length" in text:
        text = f"expected fields ({', '.join(fields)}), got {length - 1} values"
        where = name
    elif field and 1 <= int(field[1]) <= len(fields):
        where = f"{name}.{fields[int(field[1]) - 1]}{field[2]}"
    else:
        where = {"[0]": "version", "[1]": "request_id", "[2][0]": "message type"}.get(path) \
            or f"frame{' at ' + path if path else ''} ([version, request_id, [type, fields...]])"
    return ProtocolError(f"{where}: {text}", req_id=req_id)
