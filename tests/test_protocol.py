import ast
import inspect
import tracemalloc

import msgpack
import msgspec
import pytest
import zmq

from hicache_mc import protocol as P
from hicache_mc.errors import ProtocolError, RemoteError

REC = P.NodeInfo("n1", "tcp://127.0.0.1:1", "h", "/dev/shm/seg-ab12", 10).to_dict()
KEYS = ["ns/" + "0" * 64 + "/k", "ns/" + "1" * 64 + "/v"]

EVERY_MESSAGE = [
    P.ErrorReply("bad_request", "x"), P.OkReply(),
    P.ExistsRequest(KEYS), P.ExistsRequest(KEYS, {"n1": ("ab12", 7)}),
    P.ExistsReply(2, ["n1"], [0, 0], [5, 1], {"n1": REC}),
    P.ContainsRequest(KEYS, {"n1": ("ab12", 0)}), P.ContainsReply([True, False]),
    P.SnapshotRequest("ns@t"), P.SnapshotReply("ep", 3, b"\x01" * 32, {"n1": ("ab12", 7)}, 7371, 0.5),
    P.LocateRequest(KEYS), P.LocateReply(["n1"], [0, -1], [5, 0], {"n1": REC}),
    P.PlaceRequest(KEYS, [10, 20], "host"), P.PlaceReply([None, "n1", ""], {"n1": REC}),
    P.PlaceRequest(KEYS, [10, 20], "host", KEYS[0], 1, 2, ["n2"]),
    P.PlaceReply([None, "n1"], {"n1": REC, "n2": REC}, [["n2"], []]),
    P.LocateRequest(KEYS, {}, "host", ["n2"]),
    P.StatsRequest(), P.StatsReply({"epoch": "e", "nodes": [{**REC, "age_s": 0.5}], "keys": 3,
                                    "tenants": {"t": {"used": 1, "quota": None}}}),
    P.RegisterRequest(REC), P.RegisterReply("e"),
    P.HeartbeatRequest("n1", {"used": 5, "capacity": 10, "tenants": {"a": 5}, "f": 0.5}),
    P.HeartbeatReply("e", True, {"t": 5}), P.QuotaRequest("t", -1),
    P.CommittedRequest("n1", KEYS, [1, 2], [0, (1 << 64) - 1], 3), P.EvictedRequest("n1", KEYS, 4),
    P.LeaseRequest(KEYS), P.LeaseReply([0, -1], [3, -1], [7, 0], 1.5, "ab12"),
    P.ReleaseRequest(KEYS, [0, 256], [True, False]), P.ReserveRequest(KEYS, [3, 4]),
    P.ReserveReply([0, P.RESERVE_FULL], 2.0, "ab12"), P.CommitRequest(KEYS, [1, 2], [0, 256]),
    P.CommitReply([True, False], 9), P.ClearRequest("ns/"), P.ClearReply(3), P.NodeStatsRequest(),
]


def frame(*body) -> bytes:
    return msgpack.packb(list(body))


def refused(data, code="bad_request", match=None, req_id=None) -> ProtocolError:
    with pytest.raises(ProtocolError, match=match) as e:
        P.decode(data, request=b"Reply" not in bytes(data)[:64])
    assert e.value.code == code, e.value
    if req_id is not None:
        assert e.value.req_id == req_id
    return e.value


def test_every_message_round_trips():
    assert {type(m) for m in EVERY_MESSAGE} == set(P._REGISTRY.values())
    for i, m in enumerate(EVERY_MESSAGE):
        out = P.decode(P.encode(m, i), request=type(m).__name__.endswith("Request"))
        assert out == (m, i) and out.msg == m and out.req_id == i
        assert type(out.msg) is type(m)


def test_one_frame_of_plain_msgpack_without_token_or_pickle():
    data = P.encode(P.ExistsRequest(["k"]), 5)
    assert isinstance(data, bytes)
    assert msgpack.unpackb(data) == [P.VERSION, 5, ["ExistsRequest", ["k"], {}, "", []]]
    imported = {n.name for node in ast.walk(ast.parse(inspect.getsource(P)))
                if isinstance(node, (ast.Import, ast.ImportFrom)) for n in node.names}
    assert not imported & {"pickle", "marshal", "dill", "cloudpickle"}
    assert P.decode(P.encode(P.ExistsRequest(["k"], {"n": ["s", 1]}))).msg.after == {"n": ("s", 1)}


def test_servers_decode_requests_only_and_clients_replies_only():
    # a reply's free-form stats never reach a server's decoder, however deep or long
    bomb = frame(P.VERSION, 6, ["StatsReply", {"x": [[]] * 100_000, "y": [[[[[[[]]]]]]]}])
    with pytest.raises(ProtocolError) as e:
        P.decode(bomb, request=True)
    assert e.value.code == "unknown_type" and e.value.req_id == 6
    with pytest.raises(ProtocolError) as e:
        P.decode(P.encode(P.StatsRequest(), 7), request=False)
    assert e.value.code == "unknown_type" and e.value.req_id == 7
    deep = (b"\x93" + bytes([P.VERSION]) + b"\x01\x92\xaaStatsReply\x81\xa1x" + b"\x91" * 100_000
            + b"\xc0")
    with pytest.raises(ProtocolError):          # not a RecursionError
        P.decode(deep, request=False)


def test_decode_takes_bytes_memoryviews_and_zmq_frames():
    data = P.encode(P.LeaseRequest(["k"]), 3)
    for f in (data, memoryview(data), bytearray(data), zmq.Frame(data)):
        assert P.decode(f) == (P.LeaseRequest(["k"]), 3)


def test_messages_are_frozen_and_compare_by_value():
    m = P.ExistsRequest(["a"])
    assert m == P.ExistsRequest(["a"], {}) and m != P.ExistsRequest(["b"])
    assert P.OkReply() != P.StatsRequest()
    with pytest.raises(AttributeError):
        m.keys = ["b"]


def test_version_type_and_shape_errors():
    refused(frame(P.VERSION + 1, 4, ["OkReply"]), "bad_version", f"version {P.VERSION + 1}", req_id=4)
    # the version is checked first: whatever follows it
    refused(frame(P.VERSION - 1, 6, ["NoSuchRequest", [1], "x"]), "bad_version", req_id=6)
    refused(frame(P.VERSION + 1, 6, "junk"), "bad_version", req_id=6)
    refused(frame(P.VERSION, 7, ["NoSuchRequest"]), "unknown_type", "NoSuchRequest", req_id=7)
    refused(frame(P.VERSION, 7, [3, 1]), "bad_request", "message type", req_id=7)
    refused(frame(P.VERSION, 8, ["ExistsRequest"]), match=r"ExistsRequest: expected fields "
            r"\(keys, after, near, avoid\), got 0", req_id=8)
    refused(frame(P.VERSION, 8, ["ExistsRequest", [], {}, "", [], []]), match="got 5 values", req_id=8)
    refused(frame(P.VERSION, 9), match="length 3", req_id=9)
    refused(frame(P.VERSION, 9, ["OkReply"], 1), match="length 3", req_id=9)
    refused(frame("8", 9, ["OkReply"]), match="version: expected int", req_id=9)
    refused(frame(P.VERSION, "9", ["OkReply"]), match="request_id: expected int", req_id=0)
    refused(frame(P.VERSION, 1 << 40, "x"), req_id=1 << 40)
    refused(msgpack.packb({"a": 1}), req_id=0)
    for junk in (b"", b"\xc1", b"\x93" + bytes([P.VERSION]), P.encode(P.OkReply(), 2)[:-1]):
        refused(junk, match="not valid msgpack")
    refused(P.encode(P.OkReply(), 2)[:-1], req_id=2)   # truncated: its request id still read
    refused(P.encode(P.OkReply(), 2) + b"\x00", match="not valid msgpack", req_id=2)


def test_field_type_errors_name_the_field():
    for body, where in [
        (["ExistsRequest", ["k", 1]], r"ExistsRequest\.keys\[1\]: expected str, got int"),
        (["ExistsRequest", "k"], r"ExistsRequest\.keys: expected array, got str"),
        (["ExistsRequest", [], {"n": ["seg"]}], r"ExistsRequest\.after\[\.\.\.\]"),
        (["ExistsRequest", [], {"n": ["seg", -1]}], r"ExistsRequest\.after.*>= 0"),
        (["ExistsRequest", [], [["n", "seg", 1]]], r"ExistsRequest\.after: expected object"),
        (["PlaceRequest", ["k"], [1], 5], r"PlaceRequest\.host: expected str, got int"),
        (["PlaceRequest", ["k"], [1.5], "h"], r"PlaceRequest\.sizes\[0\]: expected int"),
        (["PlaceRequest", ["k"], [1], "h", "", 1, 9], r"PlaceRequest\.replicas: .*<= 8"),
        (["PlaceRequest", ["k"], [1], "h", "", 1, 0], r"PlaceRequest\.replicas: .*>= 1"),
        (["PlaceRequest", ["k"], [1], "h", "p" * 1025], r"PlaceRequest\.parent: .*<= 1024"),
        (["CommittedRequest", "n", ["k"], [1], ["x"]], r"CommittedRequest\.checksums\[0\]"),
        (["CommittedRequest", "n", ["k"], [1], [1], True], r"CommittedRequest\.seq: expected int"),
        (["HeartbeatRequest", "n", {"used": [1]}], r"HeartbeatRequest\.stats\[\.\.\.\]"),
        (["HeartbeatRequest", "n", {"tenants": {"t": "x"}}], r"HeartbeatRequest\.stats"),
        (["HeartbeatRequest", "n", {"tenants": {"t": {"u": 1}}}], r"HeartbeatRequest\.stats"),
        (["RegisterRequest", {"capacity": None}], r"RegisterRequest\.node\[\.\.\.\]"),
        (["RegisterRequest", {1: "x"}], r"RegisterRequest\.node"),
        (["LeaseReply", [0], [1], [1], "soon", "s"], r"LeaseReply\.ttl: expected float"),
        (["CommitReply", [True], -1], r"CommitReply\.seq: expected int >= 0"),
    ]:
        refused(frame(P.VERSION, 11, body), match=where, req_id=11)


def test_limits_on_keys_checksums_and_lengths():
    ok = "k" * P.MAX_KEY_BYTES
    assert P.decode(P.encode(P.ExistsRequest([ok]))).msg.keys == [ok]
    refused(P.encode(P.ExistsRequest(["a", ok + "k"]), 3),
            match=rf"ExistsRequest\.keys\[1\]: expected str of length <= {P.MAX_KEY_BYTES}",
            req_id=3)
    refused(P.encode(P.ClearRequest(ok + "k")), match=r"ClearRequest\.prefix")
    refused(P.encode(P.CommitRequest(["k"], [-1], [0])), match=r"CommitRequest\.checksums\[0\]")
    refused(P.encode(P.LeaseReply([0], [1], [-5], 1.0, "s")), match=r"LeaseReply\.checksums")
    top = P.CommittedRequest("n", ["k"], [1], [(1 << 64) - 1])
    assert P.decode(P.encode(top)).msg == top
    with pytest.raises(OverflowError):   # nothing above u64 gets on the wire
        P.encode(P.CommittedRequest("n", ["k"], [1], [1 << 64]))
    keys = [f"{i:x}" for i in range(P.MAX_KEYS)]
    assert P.decode(P.encode(P.ExistsRequest(keys))).msg.keys == keys
    refused(P.encode(P.ExistsRequest(keys + ["x"])),
            match=rf"ExistsRequest\.keys: expected array of length <= {P.MAX_KEYS}")
    refused(P.encode(P.ReserveRequest(["k"], [0] * (P.MAX_KEYS + 1))), match=r"\.sizes")
    fence = {str(i): ("s", 1) for i in range(P.MAX_NODES + 1)}
    refused(P.encode(P.LocateRequest(["k"], fence)), match=r"LocateRequest\.after: .*<= 1024")
    stats = {str(i): i for i in range(P.MAX_FIELDS + 1)}
    refused(P.encode(P.HeartbeatRequest("n", stats)), match=r"HeartbeatRequest\.stats")
    tenants = {str(i): i for i in range(P.MAX_TENANTS + 1)}
    refused(P.encode(P.HeartbeatRequest("n", {"tenants": tenants})), match=r"\.stats\[\.\.\.\]")
    refused(P.encode(P.HeartbeatRequest("x" * (P.MAX_NAME + 1), {})), match=r"\.node_id")
    refused(P.encode(P.RegisterRequest({str(i): 0 for i in range(P.MAX_FIELDS + 1)})),
            match=r"RegisterRequest\.node")


def test_the_largest_inventory_chunk_is_within_the_limits():
    """A node registers with its inventory in CommittedRequests of INVENTORY_CHUNK keys: the
    largest such message (longest node id, keys, sizes, checksums) decodes."""
    from hicache_mc.node.master_link import INVENTORY_CHUNK
    n = INVENTORY_CHUNK
    msg = P.CommittedRequest("n" * P.MAX_NAME, ["k" * P.MAX_KEY_BYTES] * n, [(1 << 63) - 1] * n,
                             [(1 << 64) - 1] * n, (1 << 64) - 1)
    data = P.encode(msg, (1 << 64) - 1)
    assert n <= P.MAX_KEYS and len(data) <= P.MAX_HEADER_BYTES
    assert P.decode(data).msg == msg


def test_frame_over_the_size_limit_is_refused_unread():
    data = P.encode(P.ExistsRequest(["k" * 1000] * 20_000), 12)
    assert len(data) <= P.MAX_HEADER_BYTES
    big = msgpack.packb([P.VERSION, 12, ["ClearRequest", "x" * P.MAX_HEADER_BYTES]])
    refused(big, match="exceeds", req_id=12)


def test_request_types_bound_every_container_and_string():
    """Every field of every request (and of every reply but StatsReply) has a concrete type
    whose containers and strings all carry a maximum length: decode work is bounded by the
    schema, not by what the peer sends."""
    def walk(t, where):
        ti = msgspec.inspect
        assert not isinstance(t, ti.AnyType), f"{where}: Any"
        if isinstance(t, (ti.ListType, ti.DictType, ti.StrType, ti.BytesType)):
            assert t.max_length is not None, f"{where}: unbounded {type(t).__name__}"
        if isinstance(t, ti.ListType):
            walk(t.item_type, where + "[]")
        elif isinstance(t, ti.DictType):
            walk(t.key_type, where + "{key}")
            walk(t.value_type, where + "{}")
        elif isinstance(t, (ti.TupleType, ti.UnionType)):
            for i, part in enumerate(t.item_types if isinstance(t, ti.TupleType) else t.types):
                walk(part, f"{where}<{i}>")
        else:
            assert isinstance(t, (ti.StrType, ti.BytesType, ti.IntType, ti.FloatType, ti.BoolType,
                                  ti.NoneType)), f"{where}: {t}"
    for name, cls in P._REGISTRY.items():
        if name != "StatsReply":
            for f in msgspec.inspect.type_info(cls).fields:
                walk(f.type, f"{name}.{f.name}")


HOSTILE_ELEMENTS = 16_000_000


def _array(n: int) -> bytes:
    return b"\xdd" + n.to_bytes(4, "big")


def _map(n: int) -> bytes:
    return b"\xdf" + n.to_bytes(4, "big")


def _request(name: str, *fields: bytes) -> bytes:
    return (b"\x93" + msgpack.packb(P.VERSION) + msgpack.packb(77)
            + bytes([0x90 | (1 + len(fields))]) + msgpack.packb(name) + b"".join(fields))


def _entries(n: int, value: bytes) -> bytes:
    return b"".join(msgpack.packb(str(i)) + value for i in range(n))


E = HOSTILE_ELEMENTS
EMPTY, NODE = msgpack.packb({}), msgpack.packb("n")
LISTS = _array(120) + b"\x90" * 120     # MAX_KEYS of these: ~16M empty arrays
# Well-formed msgpack within MAX_HEADER_BYTES, each frame holding ~16M containers (or one
# container nested 16M deep) where the schema allows few or none. Built when a test asks.
HOSTILE = {
    "flat array of 16M empty arrays as keys":
        lambda: _request("ExistsRequest", _array(E) + b"\x90" * E, EMPTY),
    "MAX_KEYS arrays of 120 empty arrays as keys":
        lambda: _request("ExistsRequest", _array(P.MAX_KEYS) + LISTS * P.MAX_KEYS, EMPTY),
    "16M-deep nested arrays as keys":
        lambda: _request("ExistsRequest", b"\x91" * E + b"\x90", EMPTY),
    "fence: a map of 8M entries":
        lambda: _request("LocateRequest", b"\x90", _map(E // 2) + b"\xa0\x90" * (E // 2)),
    "fence: MAX_KEYS entries of 120 empty arrays":
        lambda: _request("ContainsRequest", b"\x90",
                         _map(P.MAX_KEYS) + _entries(P.MAX_KEYS, LISTS)),
    "stats: MAX_KEYS entries of 120 empty arrays":
        lambda: _request("HeartbeatRequest", NODE, _map(P.MAX_KEYS) + _entries(P.MAX_KEYS, LISTS)),
    "stats: a tenants map of 8M entries":
        lambda: _request("HeartbeatRequest", NODE,
                         b"\x81\xa1t" + _map(E // 2) + b"\xa0\x80" * (E // 2)),
    "stats: maps nested 5M deep":
        lambda: _request("HeartbeatRequest", NODE, b"\x81\xa1t" * 5_000_000 + b"\x80"),
    "node record: arrays nested 16M deep":
        lambda: _request("RegisterRequest", b"\x81\xa1a" + b"\x91" * E + b"\x90"),
    "16M empty arrays in place of the version": lambda: b"\x93" + _array(E) + b"\x90" * E,
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_frames_are_refused_before_decoding_their_contents(name):
    data = HOSTILE[name]()
    assert len(data) <= P.MAX_HEADER_BYTES
    tracemalloc.start()
    try:
        with pytest.raises(ProtocolError) as e:
            P.decode(data)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert e.value.code == "bad_request"
    assert "not valid msgpack" not in str(e.value)   # refused by the schema, not as garbage
    assert e.value.req_id == (0 if "version" in name else 77)
    # decoding millions of containers would take hundreds of MiB: the refusal allocated ~nothing
    assert peak < 1 << 20, f"{name}: {peak} bytes allocated"


def test_largest_nested_stats_that_passes_is_bounded():
    """The most entries the schema lets a heartbeat carry: MAX_FIELDS tenant maps of
    MAX_TENANTS entries, no more than one honest lookup of MAX_KEYS keys."""
    assert P.MAX_FIELDS * P.MAX_TENANTS <= P.MAX_KEYS
    stats = {f"s{j}": {f"t{i}": i for i in range(P.MAX_TENANTS)} for j in range(P.MAX_FIELDS)}
    assert P.decode(P.encode(P.HeartbeatRequest("n", stats))).msg.stats == stats


def test_error_reply_becomes_remote_error():
    with pytest.raises(RemoteError, match="internal"):
        P.raise_if_error(P.ErrorReply("internal", "nope"))
    assert P.raise_if_error(P.OkReply()) == P.OkReply()


def test_node_record_is_type_checked():
    info = P.NodeInfo.from_dict(REC)
    assert info == P.NodeInfo("n1", "tcp://127.0.0.1:1", "h", "/dev/shm/seg-ab12", 10)
    assert info.to_dict() == REC and "direct_address" not in REC
    assert P.segment_of(info) == "ab12"
    minimal = {k: REC[k] for k in ("node_id", "address", "host", "shm_path", "capacity")}
    assert P.NodeInfo.from_dict(minimal) == info
    for field, bad in [("capacity", "big"), ("capacity", -1), ("capacity", True), ("node_id", 3),
                       ("prefault", "yes"), ("prefault", 1), ("te_base", 1.5)]:
        with pytest.raises(ProtocolError, match=field):
            P.NodeInfo.from_dict({**REC, field: bad})
    with pytest.raises(ProtocolError, match="address"):
        P.NodeInfo.from_dict({"node_id": "n"})
    with pytest.raises(ProtocolError, match="node record"):
        P.NodeInfo.from_dict(["n"])
