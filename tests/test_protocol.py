import msgpack
import pytest

from hicache_mc import protocol as P
from hicache_mc.errors import ProtocolError, RemoteError


def roundtrip(msg, payload=None):
    frames = P.encode(msg, 42, "tok", payload)
    out, rid, token, rest = P.decode(frames)
    assert (rid, token) == (42, "tok")
    return out, rest


def test_every_message_round_trips():
    msgs = [P.ExistsRequest(["a", "b"]), P.ExistsReply(2, ["n"], [0, 0], [5, 1], {"n": {}}),
            P.LocateReply(["n"], [0, -1], [5, 0], {"n": {}}),
            P.PlaceRequest(["k"], [10], "host"), P.PlaceReply([None, "n1", ""], {}),
            P.LeaseReply([0, -1], [3, -1], [7, 0], 1.5, "ab12cd34"), P.WriteReply([True, False]),
            P.HeartbeatReply("e", True, {"t": 5}), P.ErrorReply("bad_request", "x"), P.OkReply()]
    for m in msgs:
        assert roundtrip(m)[0] == m


def test_payload_frames_pass_through_untouched():
    data = bytearray(b"\x00\xff" * 1000)
    out, rest = roundtrip(P.WriteRequest(["k"], [1]), [memoryview(data)])
    assert bytes(rest[0]) == bytes(data)


def test_version_type_and_shape_errors():
    with pytest.raises(ProtocolError) as e:
        P.decode([msgpack.packb([P.VERSION + 1, "OkReply", 1, "", []])])
    assert e.value.code == "bad_version"
    with pytest.raises(ProtocolError) as e:
        P.decode([msgpack.packb([P.VERSION, "NoSuchRequest", 1, "", []])])
    assert e.value.code == "unknown_type"
    with pytest.raises(ProtocolError, match="ExistsRequest.keys"):
        P.decode([msgpack.packb([P.VERSION, "ExistsRequest", 1, "", [[1, 2], {}]])])
    with pytest.raises(ProtocolError, match="expected 2 fields"):
        P.decode([msgpack.packb([P.VERSION, "ExistsRequest", 1, "", [[], {}, []]])])
    with pytest.raises(ProtocolError):
        P.decode([])


def test_no_pickle_in_the_wire_format():
    frames = P.encode(P.ExistsRequest(["k"]))
    assert msgpack.unpackb(frames[0]) == [P.VERSION, "ExistsRequest", 0, "", [["k"], {}]]


def test_error_reply_becomes_remote_error():
    with pytest.raises(RemoteError, match="bad_token"):
        P.raise_if_error(P.ErrorReply("bad_token", "nope"))


def test_limits_on_keys_and_checksums():
    with pytest.raises(ProtocolError, match="longer than"):
        P.decode(P.encode(P.ExistsRequest(["k" * (P.MAX_KEY_BYTES + 1)])))
    with pytest.raises(ProtocolError, match="checksums"):
        P.decode(P.encode(P.WriteRequest(["k"], [-1])))
    with pytest.raises(ProtocolError, match="not valid msgpack"):
        P.decode([msgpack.packb([P.VERSION, "ExistsRequest", 1, "", [["k"] * (P.MAX_KEYS + 1)]])])
    assert len(P.decode(P.encode(P.ExistsRequest(["k"] * P.MAX_KEYS)))[0].keys) == P.MAX_KEYS


def test_node_record_is_type_checked():
    good = P.NodeInfo("n", "tcp://127.0.0.1:1", "h", "/x", 10).to_dict()
    assert P.NodeInfo.from_dict(good).capacity == 10
    for field, bad in [("capacity", "big"), ("capacity", -1), ("node_id", 3), ("prefault", "yes")]:
        with pytest.raises(ProtocolError, match=field):
            P.NodeInfo.from_dict({**good, field: bad})
