"""A wide request in slices (master/slices.py): the merged reply is the one the whole request
would have had, with a real MasterService's handlers answering each slice."""
import pytest

from hicache_mc import protocol as P
from hicache_mc.config import MasterConfig
from hicache_mc.master import slices
from hicache_mc.master.service import MasterService

N = 3 * slices.SLICE + 7


@pytest.fixture(scope="module")
def master():
    m = MasterService(MasterConfig(port=0, metrics_port=-1, publish_port=-1))
    for i, ident in enumerate((b"a", b"b")):
        info = P.NodeInfo(f"n{i}", f"tcp://127.0.0.1:{i + 1}", "h", f"/dev/shm/x-{i}", 1 << 30)
        m.on_RegisterRequest(P.RegisterRequest(info.to_dict()), ident, 1)
    keys = [f"ns/{i}" for i in range(N)]
    # node n1 holds the keys of the first slice, n0 the rest but one key near the end
    m.on_CommittedRequest(P.CommittedRequest("n1", keys[:slices.SLICE], [1] * slices.SLICE,
                                             [0] * slices.SLICE, 1), b"b", 2)
    rest = keys[slices.SLICE:N - 5]
    m.on_CommittedRequest(P.CommittedRequest("n0", rest, list(range(len(rest))), [0] * len(rest), 1), b"a", 3)
    m.keys = keys
    yield m
    m.close()


def whole_and_sliced(m, msg):
    handler = getattr(m, "on_" + type(msg).__name__)
    work = m.call(handler, msg, b"c", 9)
    steps = 0
    while True:
        try:
            next(work)
            steps += 1
        except StopIteration as stop:
            return handler(msg, b"c", 9), stop.value, steps


def test_every_kind_merges_into_the_whole_requests_reply(master):
    keys = master.keys
    for msg in (P.LocateRequest(keys), P.ContainsRequest(keys), P.ExistsRequest(keys),
                P.ExistsRequest(keys[:slices.SLICE + 5] + ["ns/absent"] + keys[:slices.SLICE])):
        whole, sliced, steps = whole_and_sliced(master, msg)
        assert steps >= 1
        if isinstance(whole, P.ContainsReply):
            assert sliced == whole
            continue
        assert whole.located() == sliced.located() and set(sliced.nodes) == set(sliced.held_by)
        if isinstance(whole, P.ExistsReply):
            assert sliced.count == whole.count


def test_a_slice_naming_keys_of_another_tenant_refuses_the_whole(master):
    master.guard.token = "t"            # (checks need a token; the peer is a client of t1)
    master.peer = master.peer._replace(role="client", tenant="t1")
    try:
        keys = [f"ns@t1/{i}" for i in range(slices.SLICE)] + ["ns@t2/x"]
        work = master.call(master.on_LocateRequest, P.LocateRequest(keys), b"c", 9)
        with pytest.raises(Exception, match="not in tenant"):
            for _ in work:
                pass
    finally:
        master.guard.token = ""
        master.peer = master.peer._replace(role="admin", tenant="")
