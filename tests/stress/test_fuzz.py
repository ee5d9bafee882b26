"""Bad input: random and mutated frames to the master's and the nodes' ZeroMQ ports
(hypothesis).

The property, for every frame set: the server answers (an ``ErrorReply`` or the reply of the
request), stays up, and keeps serving a valid client; its peak memory stays put. Strategies:

- ``raw``: random bytes in 1-4 frames;
- ``shaped``: a msgpack header of the right shape with arbitrary versions, ids, types and
  field values, sometimes followed by extra frames;
- ``typed``: a request of a real type whose fields have the declared types but hostile values
  (sizes of 2^60 and -1, empty and long keys, lists of unequal length);
- ``mutated``: valid encoded requests with bytes flipped, cut, inserted or repeated.

The short profile replays the same derandomized examples every run; the long one draws new
ones. The cluster runs without a token, so every frame reaches the decoder (with one, a peer
without it never gets past ZeroMQ's handshake: tests/security). Membership messages
(Register/Heartbeat) are not drawn: a peer that registers a well-formed fake node is by design
a member (access control is the token's job); a wrongly typed one is a bug, reproduced in
``test_bad_sizes.py`` with the other findings.
"""
from __future__ import annotations

import typing

import msgpack
import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hicache_mc import protocol as P
from harness import record, stress_cluster, valid_client_works, vm_hwm
from procs import Cluster

MiB = 1 << 20
REPLY_TIMEOUT_S = 8.0        # a node's Commit may wait for the disk (durability sync)
HWM_GROWTH_LIMIT = 48 * MiB  # no fuzz frame is over ~1 MiB: the peak must not grow like a leak

REQUESTS = sorted(n for n in P._REGISTRY if n.endswith("Request"))
REPLIES = sorted(n for n in P._REGISTRY if not n.endswith("Request"))
# Requests each server serves (a well-formed membership message can legitimately re-route
# data: see the module docstring); typed requests go to a server that serves them, mostly.
NODE_TYPES = ["LeaseRequest", "ReleaseRequest", "ReserveRequest", "CommitRequest", "ClearRequest",
              "NodeStatsRequest"]
MASTER_TYPES = ["ExistsRequest", "LocateRequest", "PlaceRequest", "StatsRequest", "CommittedRequest",
                "EvictedRequest"]


class Target:
    """One server port under fuzz, with a long-lived DEALER (one request at a time)."""

    def __init__(self, name: str, address: str, proc):
        self.name, self.address, self.proc = name, address, proc
        self.ctx = zmq.Context.instance()
        self.sock = None
        self.codes: dict[str, int] = {}
        self.internal: list[str] = []
        self.sent = 0

    def _socket(self):
        if self.sock is None:
            self.sock = self.ctx.socket(zmq.DEALER)
            self.sock.setsockopt(zmq.LINGER, 0)
            self.sock.connect(self.address)
        return self.sock

    def send(self, frames: list[bytes]) -> P.Message:
        """Send a frame set; the server must answer with a well-formed message."""
        sock = self._socket()
        sock.send_multipart(frames)
        self.sent += 1
        if not sock.poll(int(REPLY_TIMEOUT_S * 1000)):
            sock.close()
            self.sock = None
            assert self.proc.alive, f"{self.name} died on {frames!r:.300}"
            raise AssertionError(f"{self.name} did not answer {frames!r:.300}")
        msg = P.decode(sock.recv(), request=False).msg                  # a bad reply raises here
        code = msg.code if isinstance(msg, P.ErrorReply) else type(msg).__name__
        self.codes[code] = self.codes.get(code, 0) + 1
        if isinstance(msg, P.ErrorReply) and msg.code == "internal":
            self.internal.append(f"{frames[0][:200]!r} -> {msg.message}")
        return msg

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()


@pytest.fixture(scope="module")
def fuzz_cluster(tmp_path_factory):
    """A master, a DRAM node and an SSD node (sync), shared by every fuzz test of the module."""
    tmp = tmp_path_factory.mktemp("fuzz")
    c: Cluster = stress_cluster(tmp)
    c.start_master()
    c.add_node(dram="64MiB")
    c.add_node(dram="64MiB", args=("--ssd", "128MiB", "--ssd-dir", str(tmp / "ssd"), "--durability", "sync"))
    c.wait_nodes(2)
    yield c
    c.stop()


def targets(c: Cluster) -> list[Target]:
    """The three servers' ZeroMQ ports."""
    return [Target("master", c.master, c.master_proc),
            Target("node", c.nodes[0].address, c.nodes[0]),
            Target("ssd-node", c.nodes[1].address, c.nodes[1])]


# ------------------------------------------------------------------ strategies

scalars = (st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 64) - 1) | st.floats()
           | st.text(max_size=24) | st.binary(max_size=24))
values = st.recursive(scalars, lambda kids: st.lists(kids, max_size=4)
                      | st.dictionaries(st.text(max_size=8), kids, max_size=4), max_leaves=16)
extra = st.lists(st.binary(max_size=512), max_size=2)

raw = st.lists(st.binary(max_size=256), min_size=1, max_size=4)


@st.composite
def shaped(draw):
    version = draw(st.sampled_from([P.VERSION, P.VERSION, 0, 7, -1]) | values)
    type_name = draw(st.sampled_from(REQUESTS + REPLIES) | st.text(max_size=20))
    req_id = draw(st.integers(-(1 << 63), (1 << 64) - 1) | values)
    body = [type_name] + draw(st.lists(values, max_size=6))
    head = [version, req_id, body][: draw(st.integers(2, 4))]
    frames = [msgpack.packb(head, use_bin_type=True)]
    return frames + draw(extra) if draw(st.sampled_from([False] * 4 + [True])) else frames


HOSTILE_INTS = st.sampled_from([0, 1, -1, -2, -3, 255, 1 << 31, (1 << 32) + 1, 1 << 40, 1 << 60,
                                (1 << 63) - 1, -(1 << 63), (1 << 64) - 1]) | st.integers(-(1 << 63), (1 << 64) - 1)
KEYS = st.text(max_size=40) | st.sampled_from(["", "/", "a" * 1000, "\x00", "é/ø/☃", "fuzz/k"])


def hostile(hint, n=None):
    """Values of a field's declared type, chosen to hurt; top-level lists of length ``n`` if given."""
    origin = typing.get_origin(hint)
    if origin is typing.Annotated:      # the length limits: hostile values go past them too
        return hostile(typing.get_args(hint)[0], n)
    if origin is tuple:
        return st.tuples(*[hostile(h) for h in typing.get_args(hint)])
    if origin is typing.Union:
        return st.one_of([hostile(h) for h in typing.get_args(hint)])
    if hint is type(None):
        return st.none()
    if origin is list:
        (item,) = typing.get_args(hint) or (typing.Any,)
        return st.lists(hostile(item), min_size=n or 0, max_size=6 if n is None else n)
    if origin is dict:
        key, item = typing.get_args(hint)
        return st.dictionaries(hostile(key), hostile(item), max_size=5)
    if hint is dict or hint is typing.Any:
        return values
    if hint is int:
        return HOSTILE_INTS
    if hint is float:
        return st.floats() | HOSTILE_INTS
    if hint is str:
        return KEYS
    if hint is bool:
        return st.booleans()
    return values


@st.composite
def typed(draw):
    """(frames, target index or None): index 0 is the master, 1 and 2 the nodes."""
    name = draw(st.sampled_from(MASTER_TYPES + NODE_TYPES))
    cls = P._REGISTRY[name]
    # half the time the lists agree in length, so the hostile values reach the handlers
    # instead of the length checks
    n = draw(st.none() | st.integers(0, 4))
    hints = typing.get_type_hints(cls, include_extras=True)
    fields = [draw(hostile(hints[f.name], n)) for f in msgspec.structs.fields(cls)]
    where = 0 if name in MASTER_TYPES else draw(st.sampled_from([1, 2]))
    if draw(st.sampled_from([False] * 9 + [True])):
        where = None           # now and then to any server
    return [P.encode(cls(*fields), draw(st.integers(0, (1 << 63) - 1)))], where


def corpus() -> list[list[bytes]]:
    keys = ["fuzz/a", "fuzz/b"]
    msgs = [P.ExistsRequest(keys, {"n": ("seg", 3)}), P.LocateRequest(keys),
            P.PlaceRequest(keys, [10, 20], "h"), P.StatsRequest(), P.LeaseRequest(keys),
            P.ReleaseRequest(keys, [4096, 4352]), P.ReserveRequest(keys, [10, 20]),
            P.CommitRequest(keys, [1, 2], [0, 256]), P.NodeStatsRequest(), P.ClearRequest("fuzz/"),
            P.CommittedRequest("nobody", keys, [1, 2], [3, 4]), P.EvictedRequest("nobody", keys)]
    return [[P.encode(m, 7)] for m in msgs]


CORPUS = corpus()


@st.composite
def mutated(draw):
    frames = [bytearray(f) for f in draw(st.sampled_from(CORPUS))]
    for _ in range(draw(st.integers(1, 6))):
        i = draw(st.integers(0, len(frames) - 1))
        f = frames[i]
        op = draw(st.sampled_from(["flip", "cut", "insert", "repeat", "set"]))
        at = draw(st.integers(0, max(0, len(f) - 1)))
        if op == "flip" and f:
            f[at] ^= 1 << draw(st.integers(0, 7))
        elif op == "cut":
            del f[at:]
        elif op == "insert":
            f[at:at] = draw(st.binary(min_size=1, max_size=8))
        elif op == "repeat":
            f[at:at] = f[at: at + draw(st.integers(1, 16))] * draw(st.integers(1, 4))
        elif op == "set" and f:
            f[at] = draw(st.sampled_from([0x00, 0x7F, 0x80, 0xC0, 0xC1, 0xDC, 0xDD, 0xDE, 0xDF, 0xFF]))
    if draw(st.booleans()):
        frames.append(bytearray(draw(st.binary(max_size=64))))
    return [bytes(f) for f in frames if f] or [b""]


STRATEGIES = {"raw": raw, "shaped": shaped(), "typed": typed(), "mutated": mutated()}


# ------------------------------------------------------------------ the fuzz test

@pytest.mark.timeout(1800)
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_fuzz_frames(fuzz_cluster, profile, strategy):
    c = fuzz_cluster
    tgts = targets(c)
    hwm0 = {t.name: vm_hwm(t.proc.p.pid) for t in tgts}

    @settings(max_examples=profile.fuzz_examples, deadline=None, database=None,
              derandomize=profile.name == "short", suppress_health_check=list(HealthCheck))
    @given(frames=STRATEGIES[strategy], which=st.integers(0, len(tgts) - 1))
    def one(frames, which):
        if strategy == "typed":
            frames, where = frames
            which = which if where is None else where
        tgts[which].send(frames)

    try:
        one()
    finally:
        for t in tgts:
            t.close()
    for t in tgts:
        assert t.proc.alive, f"{t.name} died:\n{c.logs()}"
        grew = vm_hwm(t.proc.p.pid) - hwm0[t.name]
        assert grew < HWM_GROWTH_LIMIT, f"{t.name}: peak memory grew {grew >> 20} MiB"
    print(f"\n[{profile.name}] fuzz {strategy}: " + "; ".join(f"{t.name} {t.sent} sent {t.codes}" for t in tgts))
    for t in tgts:
        assert not t.internal, f"{t.name} failed inside a handler: {t.internal[:5]}"
    valid_client_works(c, strategy, within_s=c.heartbeat_s * c.liveness + 2)
    record(f"fuzz_{strategy}", {t.name: {"sent": t.sent, "replies": t.codes,
                                        "peak_rss_growth_mib": round((vm_hwm(t.proc.p.pid) - hwm0[t.name]) / MiB, 1)}
                                for t in tgts},
           command="HICACHE_MC_STRESS_LONG=1 .venv/bin/pytest tests/stress -m slow")
