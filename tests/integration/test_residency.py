"""The residency view (client/view.py) against a real master and node: it answers lookups
locally once in sync, follows puts, clears, node expiry and a master restart, resyncs after a
lost update, keeps read-your-writes, and never holds a caller past its deadline."""
import itertools
import signal
import time

import pytest

from hicache_mc.client import StoreClient
from procs import Cluster

BEAT = 0.2
STALE = max(3 * BEAT, 1.0)      # a view silent this long stops answering (client/view.py)
NS = "0123456789abcdef@t"


def key(name: str, ns: str = NS) -> str:
    return f"{ns}/{name}/k"


def wait(cond, timeout_s: float = 10.0, what: str = "condition") -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > end:
            raise TimeoutError(what)
        time.sleep(0.01)


def synced(c: StoreClient, ns: str = NS) -> bool:
    sp = c.view.spaces.get(ns)
    return sp is not None and sp.synced


def follow(c: StoreClient, ns: str = NS) -> None:
    c.follow(ns)
    wait(lambda: synced(c, ns), what="view in sync")


def exists_calls(c: StoreClient) -> int:
    return c.stats()["cluster"]["exists_calls"]


def one_node(tmp_path, **env) -> Cluster:
    """A started master (with ``env``) and one node."""
    c = Cluster(tmp_path)
    c.env.update(env)
    c.start_master()
    c.add_node("64MiB")
    c.wait_nodes(1)
    return c


def view_cluster(tmp_path) -> Cluster:
    """A started master publishing a beat every ``BEAT`` and one node."""
    c = Cluster(tmp_path, heartbeat_s=0.2, liveness=3)
    c.env["HICACHE_MC_MASTER_PUBLISH_BEAT_S"] = str(BEAT)
    c.start_master()
    c.add_node("64MiB")
    c.wait_nodes(1)
    return c


@pytest.fixture
def cluster(tmp_path):
    """A cluster of its own, for a test that pauses, kills or restarts a process."""
    c = view_cluster(tmp_path)
    yield c
    c.stop()


@pytest.fixture(scope="module")
def shared_cluster(tmp_path_factory):
    """One cluster for the tests that leave its processes alone; each keeps to its ``ns``."""
    c = view_cluster(tmp_path_factory.mktemp("views"))
    yield c
    c.stop()


_spaces = itertools.count(1)


@pytest.fixture
def ns() -> str:
    """A namespace no other test of the module uses (same shape as ``NS``)."""
    return f"{next(_spaces):016x}@t"


def test_view_answers_its_hits_and_the_master_its_misses(shared_cluster, ns):
    with StoreClient(shared_cluster.master) as w, \
            StoreClient(shared_cluster.master, view="on") as r:
        assert w.put(key("a", ns), b"x")
        follow(r, ns)
        before = exists_calls(w)
        answers = r.view.counters["view_answers"]
        assert w.put(key("b", ns), b"y")
        wait(lambda: r.contains_cached([key("a", ns), key("b", ns)]) == [True, True],
             what="put seen")
        assert r.batch_exists([key("a", ns), key("b", ns)]) == 2
        assert r.batch_contains([key("b", ns), key("a", ns)]) == [True, True]
        assert exists_calls(w) == before            # hits: the view alone
        assert r.batch_exists([key("a", ns), key("zz", ns), key("b", ns)]) == 1
        assert r.batch_contains([key("b", ns), key("zz", ns), key("a", ns)]) == [True, False, True]
        assert exists_calls(w) == before + 2        # a miss: the master's word
        assert w.clear(ns + "/") == 2
        wait(lambda: r.contains_cached([key("a", ns), key("b", ns)]) == [False, False],
             what="clear seen")
        assert r.batch_exists([key("a", ns)]) == 0
        assert r.batch_contains([key("a", ns), key("b", ns)]) == [False, False]
        assert r.view.counters["view_answers"] >= answers + 6


def test_contains_cached_answers_from_the_view_or_not_at_all(cluster):
    with StoreClient(cluster.master) as w, StoreClient(cluster.master, view="on") as r, \
            StoreClient(cluster.master, view="off") as off:
        assert w.put(key("cc"), b"x")
        assert off.contains_cached([key("cc")]) is None         # no view: no answer
        before = exists_calls(w), w.stats()["cluster"]["locate_calls"]
        assert r.contains_cached([key("cc"), key("nope")]) is None    # not in sync yet
        follow(r)
        wait(lambda: r.contains_cached([key("cc"), key("nope")]) == [True, False],
             what="put seen")
        cluster.master_proc.pause()                            # a silent master: out of sync
        try:
            wait(lambda: r.contains_cached([key("cc")]) is None, what="view gave up")
        finally:
            cluster.master_proc.kill(signal.SIGCONT)
        assert (exists_calls(w), w.stats()["cluster"]["locate_calls"]) == before


def test_a_chain_of_sglang_pages_is_answered_from_its_page_hashes(shared_cluster, ns):
    """A client that wrote none of the keys answers a chain of SGLang pages (SHA-256 page
    hashes, k and v parts) from the hashes alone: the digests it derives from them are the
    ones the master derived from the keys it indexed. A chain with a hash that is no page hash
    is answered from its keys."""
    import hashlib
    hashes = [hashlib.sha256(b"page %d" % i).hexdigest() for i in range(4)]
    with StoreClient(shared_cluster.master) as w, \
            StoreClient(shared_cluster.master, view="on") as r:
        for h in hashes[:3]:
            assert w.put(f"{ns}/{h}/k", b"k") and w.put(f"{ns}/{h}/v", b"v")
        assert w.put(f"{ns}/{hashes[3]}/k", b"k")          # page 3 has no v: the run ends
        follow(r, ns)
        before, answers = exists_calls(w), r.view.counters["view_answers"]
        assert r.batch_exists_pages(ns, hashes, ("k",)) == 4
        assert exists_calls(w) == before                    # a whole chain: the view alone
        assert r.batch_exists_pages(ns, hashes, ("k", "v")) == 3
        assert r.batch_exists_pages(ns, hashes[1:], ("v",)) == 2
        assert r.view.counters["view_answers"] == answers + 3
        before += 2                                         # where each ends: the master's word
        assert exists_calls(w) == before
        odd = hashes[:2] + ["not a page hash"]
        assert w.put(f"{ns}/not a page hash/k", b"k") and w.put(f"{ns}/not a page hash/v", b"v")
        fallbacks = r.view.counters["view_fallbacks"]
        wait(lambda: r.contains_cached([f"{ns}/not a page hash/v"]) == [True], what="odd page seen")
        assert r.batch_exists_pages(ns, odd, ("k", "v")) == 3
        assert r.view.counters["view_fallbacks"] > fallbacks and exists_calls(w) == before


def test_a_writer_reads_its_own_writes_while_its_view_lags(shared_cluster, ns):
    """With the view thread held, the view is in sync but has not seen the writer's commit:
    the view answers it from the writer's own recent writes, without asking the master."""
    with StoreClient(shared_cluster.master, view="on") as c:
        assert c.put(key("own0", ns), b"x")
        follow(c, ns)
        view = c.view
        held = []
        real = view._apply
        view._apply = lambda sp, u: held.append((sp, u))     # updates arrive, are not applied
        try:
            assert c.put(key("own1", ns), b"y")
            answers = view.counters["view_answers"]
            assert c.batch_exists([key("own0", ns), key("own1", ns)]) == 2
            assert c.batch_contains([key("own1", ns), key("other", ns)]) == [True, False]
            assert view.counters["view_answers"] == answers + 2
        finally:
            view._apply = real


def test_a_writers_own_write_removed_by_another_client_leaves_its_answers(shared_cluster, ns):
    """The writer's own writes count as stored for 5-10 s, but not past the update that
    removes them: once its view applies another client's clear, its probe misses."""
    with StoreClient(shared_cluster.master, view="on") as w, \
            StoreClient(shared_cluster.master) as other:
        assert w.put(key("gone", ns), b"x")
        follow(w, ns)
        assert w.batch_exists([key("gone", ns)]) == 1
        assert other.clear(ns + "/") == 1
        wait(lambda: w.batch_exists([key("gone", ns)]) == 0, timeout_s=3.0,
             what="the writer's probe of its cleared write")


def test_another_clients_commit_on_its_way_to_the_view_is_no_miss(shared_cluster, ns):
    """Another client's commit that the view has not applied yet (the update on its way: the
    view hears the master but applies nothing, as one whose thread is starved of CPU) is
    found all the same: the view answers its hits, the master the keys the view misses."""
    import hashlib
    pages = [hashlib.sha256(b"lag %d" % i).hexdigest() for i in range(3)]
    with StoreClient(shared_cluster.master) as w, \
            StoreClient(shared_cluster.master, view="on") as r:
        assert w.put(key("lag0", ns), b"x")
        follow(r, ns)
        view = r.view
        real = view._apply
        view._apply = lambda sp, u: setattr(sp, "heard", time.monotonic())   # heard, not applied
        try:
            assert w.put(key("lag1", ns), b"y")
            for h in pages:
                assert w.put(f"{ns}/{h}/k", b"k") and w.put(f"{ns}/{h}/v", b"v")
            answers, fallbacks = view.counters["view_answers"], view.counters["view_fallbacks"]
            asked = view.counters["view_misses_asked"]
            assert r.batch_exists([key("lag0", ns), key("lag1", ns), key("none", ns)]) == 2
            assert r.batch_contains([key("lag1", ns), key("none", ns), key("lag0", ns)]) == \
                [True, False, True]
            assert r.batch_exists_pages(ns, pages, ("k", "v")) == len(pages)
            # the view answered each call (it was in sync), the master only what it missed
            assert view.counters["view_answers"] == answers + 3
            assert view.counters["view_fallbacks"] == fallbacks
            assert view.counters["view_misses_asked"] == asked + 3
            assert r.contains_cached([key("lag1", ns)]) == [False]     # the view alone: behind
        finally:
            view._apply = real


def test_a_put_of_a_key_already_stored_counts_as_the_writers_own(shared_cluster, ns):
    """A put whose keys another client stored writes nothing and gets no commit; it counts as
    this writer's own write all the same, so its view (here: its thread held) answers it."""
    with StoreClient(shared_cluster.master) as w1, \
            StoreClient(shared_cluster.master, view="on") as w2:
        follow(w2, ns)
        view = w2.view
        real = view._apply
        view._apply = lambda sp, u: None        # w2's view sees nothing from now on
        try:
            assert w1.put(key("dup", ns), b"x")
            assert w2.put(key("dup", ns), b"x")     # deduplicated: True without a write
            answers = view.counters["view_answers"]
            assert w2.batch_exists([key("dup", ns)]) == 1
            assert view.counters["view_answers"] == answers + 1
        finally:
            view._apply = real


def test_a_lost_update_is_a_gap_and_the_view_resyncs(shared_cluster, ns):
    with StoreClient(shared_cluster.master) as w, \
            StoreClient(shared_cluster.master, view="on") as r:
        follow(r, ns)
        view = r.view
        real, dropped = view._apply, []

        def lose_first_update(sp, u):
            if not u.beat and not dropped:
                dropped.append(u.seq)       # as if ZeroMQ dropped it (HWM) on the way
                return
            real(sp, u)
        view._apply = lose_first_update
        snapshots = view.counters["view_snapshots"]
        assert w.put(key("lost", ns), b"x")
        wait(lambda: view.counters["view_gaps"] >= 1, what="gap seen")
        wait(lambda: view.counters["view_snapshots"] > snapshots and synced(r, ns), what="resynced")
        answers = view.counters["view_answers"]
        assert r.batch_exists([key("lost", ns)]) == 1       # the new snapshot holds it
        assert view.counters["view_answers"] == answers + 1
        assert dropped


def test_an_expired_node_takes_its_keys_out_of_the_view(cluster):
    with StoreClient(cluster.master) as w, \
            StoreClient(cluster.master, view="on", timeout_s=1.0) as r:
        assert w.put(key("e1"), b"x") and w.put(key("e2"), b"y")
        follow(r)
        assert r.batch_exists([key("e1"), key("e2")]) == 2
        cluster.nodes[0].kill()
        cluster.wait_nodes(0)
        answers = r.view.counters["view_answers"]
        wait(lambda: r.batch_contains([key("e1"), key("e2")]) == [False, False], what="expiry seen")
        assert r.view.counters["view_answers"] > answers


def test_master_restart_resyncs_and_a_dead_master_never_holds_a_caller(cluster):
    with StoreClient(cluster.master) as w, \
            StoreClient(cluster.master, view="on", timeout_s=1.0, circuit_failures=100) as r:
        assert w.put(key("m1"), b"x")
        follow(r)
        old_epoch = r.view.spaces[NS].epoch
        cluster.master_proc.kill()
        time.sleep(STALE + 0.3)             # (the dropped connection told it sooner)
        t0 = time.monotonic()
        assert r.batch_exists([key("m1")]) == 0     # not from the stale view: the master is down
        assert time.monotonic() - t0 < 1.0 + 0.5
        cluster.start_master()
        cluster.wait_nodes(1)
        cluster.wait_keys(1)                # the node's inventory
        wait(lambda: synced(r) and r.view.spaces[NS].epoch != old_epoch, timeout_s=20,
             what="resynced with the new master")
        answers = r.view.counters["view_answers"]
        assert r.batch_exists([key("m1"), key("m2")]) == 1
        assert r.view.counters["view_answers"] == answers + 1


def test_view_off_asks_the_master(shared_cluster, ns):
    with StoreClient(shared_cluster.master, view="off") as c:
        assert c.view is None
        assert c.put(key("o", ns), b"x")
        before = exists_calls(c)
        assert c.batch_exists([key("o", ns)]) == 1
        assert exists_calls(c) == before + 1


def test_a_stalled_view_thread_sends_lookups_to_the_master(shared_cluster, ns):
    """The view thread stops reading (a stalled subscriber) while the namespace is cleared:
    after 3 silent beats lookups go to the master, which no longer has the key."""
    import threading
    with StoreClient(shared_cluster.master) as w, \
            StoreClient(shared_cluster.master, view="on") as r:
        assert w.put(key("s1", ns), b"x")
        follow(r, ns)
        view, gate = r.view, threading.Event()
        real = view._drain
        view._drain = gate.wait             # the thread blocks at its next read
        try:
            time.sleep(0.1)
            assert w.clear(ns + "/") == 1
            time.sleep(STALE + 0.3)
            fallbacks = view.counters["view_fallbacks"]
            assert r.batch_exists([key("s1", ns)]) == 0
            assert view.counters["view_fallbacks"] == fallbacks + 1
        finally:
            view._drain = real
            gate.set()
        wait(lambda: synced(r, ns), what="back in sync")
        assert r.batch_exists([key("s1", ns)]) == 0


def test_a_client_that_clears_sees_its_clear_at_once(shared_cluster, ns):
    """A clear carries no fence: the clearing client's view answers only after a new snapshot."""
    with StoreClient(shared_cluster.master, view="on") as c:
        for i in range(20):
            assert c.put(key(f"c{i}", ns), b"x")
            follow(c, ns)
            assert c.batch_exists([key(f"c{i}", ns)]) == 1
            assert c.clear(ns + "/") == 1
            assert c.batch_exists([key(f"c{i}", ns)]) == 0


def test_a_master_that_publishes_nothing_still_answers(tmp_path):
    """publish_port -1: no snapshot to be had; every lookup goes to the master, correctly."""
    c = one_node(tmp_path, HICACHE_MC_MASTER_PUBLISH_PORT="-1")
    try:
        with StoreClient(c.master, view="on") as r:
            assert r.put(key("np"), b"x")
            r.follow(NS)
            wait(lambda: r.view.spaces.get(NS) is not None and r.view.spaces[NS].failures >= 1,
                 what="snapshot refused")
            assert not synced(r)
            assert r.batch_exists([key("np"), key("nq")]) == 1
            assert r.batch_contains([key("nq"), key("np")]) == [False, True]
            assert r.view.counters["view_answers"] == 0
    finally:
        c.stop()


def test_a_master_that_exits_is_noticed_at_once_not_after_three_beats(tmp_path):
    """Beats every 5 s: silence would take 15 s to notice; the dropped connection takes less."""
    c = one_node(tmp_path, HICACHE_MC_MASTER_PUBLISH_BEAT_S="5")
    try:
        with StoreClient(c.master, view="on", timeout_s=1.0) as r:
            assert r.put(key("x1"), b"x")
            follow(r)
            c.master_proc.kill()
            wait(lambda: not synced(r), timeout_s=2.0, what="view out of sync")
            assert r.batch_exists([key("x1")]) == 0         # asked the master: it is gone
    finally:
        c.stop()
