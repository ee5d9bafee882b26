"""Two live SGLang servers on CPU (tests/live) with one hicache-mc store as their L3: a prefix
one server computed reaches the other through the store, byte for byte; the servers keep
answering when the store dies, and use it again once it is back; hicache-mc's plugin hooks run
in the scheduler process; a router can read their KV events, load reports and metrics."""
from __future__ import annotations

import threading
from typing import NamedTuple

import msgspec
import pytest
import zmq
from sglang.srt.disaggregation.kv_events import BlockStored, KVEventBatch

import live
from procs import Store

# A module's servers take one to three minutes to start on a busy 2-core machine; the fixture
# runs inside the first test's timeout.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]
PAGE = live.ServerOptions().page_size
PROMPT = 640                 # tokens: 40 pages, as the run
TAIL = 8                     # prompt logprobs compared from PROMPT - TAIL: past any cached page


class Pair(NamedTuple):
    store: Store
    a: live.SGLangServer
    b: live.SGLangServer


@pytest.fixture(scope="module")
def pair(tiny_model, tmp_path_factory):
    store = Store(tmp_path_factory.mktemp("store")).start()
    try:
        with live.start_servers(tiny_model, store.master, tmp_path_factory.mktemp("servers"),
                                names=("a", "b"),
                                options=live.ServerOptions(kv_events=True, metrics=True)) as (a, b):
            yield Pair(store, a, b)
    finally:
        store.stop()


def keys(store: Store) -> int:
    return store.cluster.stats()["keys"]


def computed(server: live.SGLangServer, ids: list[int]) -> live.Generation:
    """``ids`` prefilled by ``server`` from scratch (nothing cached anywhere yet)."""
    out = server.generate(ids, max_new_tokens=8, logprob_start_len=len(ids) - TAIL)
    assert out.cached_tokens == 0, out.meta
    return out


def stored(store: Store, before: int, ids: list[int]) -> None:
    """Wait until the store holds every full page of ``ids`` (a K and a V object each)."""
    store.cluster.wait_keys(before + 2 * ((len(ids) - 1) // PAGE), timeout_s=120, at_least=True)


def same_answer(x: live.Generation, y: live.Generation) -> None:
    assert x.output_ids == y.output_ids
    assert x.input_logprobs == y.input_logprobs          # exact: same bytes, same arithmetic
    assert x.output_logprobs == y.output_logprobs


def test_second_server_takes_the_prefix_from_the_l3(pair):
    """Server b answers a's prompt with the prefix loaded from the store (cached_tokens from
    storage, HiCacheMC), and its logprobs equal a's fresh prefill exactly."""
    ids = live.prompt_ids(PROMPT, seed=1)
    before = keys(pair.store)
    first = computed(pair.a, ids)
    stored(pair.store, before, ids)
    second = pair.b.generate(ids, max_new_tokens=8, logprob_start_len=len(ids) - TAIL)
    assert second.storage_backend == "HiCacheMC", second.meta
    assert second.storage_tokens == second.cached_tokens, second.meta    # nothing from b's L1/L2
    assert second.storage_tokens % PAGE == 0 and second.storage_tokens >= PROMPT - 2 * PAGE
    same_answer(first, second)


def test_plugin_hooks_run_in_the_scheduler(pair):
    """hicache-mc's hooks applied in the scheduler process: SGLang's factory built HiCacheMC
    for the name hicache_mc (its closed list has no such name) and the controller took the
    zero-copy page path (SGLang picks it by name); SGLang's hook registry logged no failure."""
    for server in (pair.a, pair.b):
        log = server.log_path.read_text(errors="replace")
        assert "hicache_mc: MHA pool, layout page_first_direct" in log, server.log()
        assert "hicache_mc: SGLang's page path: zero-copy" in log, server.log()
        assert "Failed to apply hooks" not in log, server.log()


def replayed(server: live.SGLangServer, timeout_s: float = 30.0) -> list:
    """Every KV event ``server`` still buffers, through its replay endpoint (SGLang's protocol:
    ``[b"", start seq]`` from a DEALER; batches, then an empty payload)."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.kv_events.replay)
    decode, events = msgspec.msgpack.Decoder(KVEventBatch), []
    try:
        sock.send_multipart([b"", (0).to_bytes(8, "big")])
        while sock.poll(int(timeout_s * 1000)):
            frames = sock.recv_multipart()
            if not frames[-1]:
                return events
            events += decode.decode(frames[-1]).events
        raise TimeoutError(f"{server.name}: replay did not end in {timeout_s} s")
    finally:
        sock.close()


def test_kv_events_and_load_reports(pair):
    """What a router reads from each server (the Conductor's end-to-end tests use these): the
    KV events of a request (its pages' tokens in BlockStored), the load report and metrics."""
    ids = live.prompt_ids(4 * PAGE, seed=4)
    pair.a.generate(ids, max_new_tokens=2)
    pages = {tuple(e.token_ids[j:j + e.block_size]) for e in replayed(pair.a)
             if isinstance(e, BlockStored) for j in range(0, len(e.token_ids), e.block_size)}
    assert all(tuple(ids[i:i + PAGE]) in pages for i in range(0, len(ids), PAGE))
    loads = pair.a.loads()["loads"]
    assert loads and loads[0]["max_total_num_tokens"] > 0, loads
    assert "sglang:prefill_effective_tokens_total" in pair.a.metrics()


class Traffic:
    """Short prompts sent to one server, one after another, until stopped."""

    def __init__(self, server: live.SGLangServer):
        self.server, self.answered, self.errors = server, 0, []
        self.changed, self.stopped = threading.Condition(), threading.Event()
        self.thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        for seed in range(1000, 2000):
            if self.stopped.is_set():
                return
            try:
                self.server.generate(live.prompt_ids(3 * PAGE, seed), max_new_tokens=2)
                outcome = None
            except Exception as exc:     # collected for the test to assert on
                outcome = exc
            with self.changed:
                if outcome is None:
                    self.answered += 1
                else:
                    self.errors.append(outcome)
                self.changed.notify_all()

    def wait_answered(self, n: int, timeout_s: float = 300.0) -> None:
        with self.changed:
            assert self.changed.wait_for(lambda: self.answered >= n or self.errors, timeout_s)
        assert not self.errors, self.errors

    def __enter__(self) -> "Traffic":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopped.set()
        self.thread.join()


def test_store_killed_mid_run(pair):
    """The store dies while b is serving: every request still gets its answer (a miss, then a
    recompute equal to a's), and once a store runs again at the address both servers use it."""
    ids = live.prompt_ids(PROMPT, seed=2)
    before = keys(pair.store)
    first = computed(pair.a, ids)
    stored(pair.store, before, ids)
    try:
        with Traffic(pair.b) as traffic:
            traffic.wait_answered(1)
            pair.store.kill()
            second = pair.b.generate(ids, max_new_tokens=8, logprob_start_len=len(ids) - TAIL)
            traffic.wait_answered(traffic.answered + 2)     # requests sent after the kill
    finally:
        pair.store.start()                                 # an empty store, same address
    assert second.storage_tokens == 0 and second.cached_tokens == 0, second.meta
    same_answer(first, second)
    _uses_the_store_again(pair)


def _uses_the_store_again(pair: Pair, attempts: int = 30) -> None:
    """b writes to the restarted store once its client reconnects (a circuit stays open for a
    while after failures), and a then loads what b wrote."""
    for seed in range(3000, 3000 + attempts):
        ids = live.prompt_ids(24 * PAGE, seed)      # above SGLang's prefetch threshold (256)
        before = keys(pair.store)
        pair.b.generate(ids, max_new_tokens=2)
        try:
            pair.store.cluster.wait_keys(before + 2 * ((len(ids) - 1) // PAGE), timeout_s=10,
                                         at_least=True)
        except TimeoutError:
            continue                    # this write was dropped while the circuit was open
        again = pair.a.generate(ids, max_new_tokens=2)
        if again.storage_tokens > 0:
            assert again.storage_backend == "HiCacheMC", again.meta
            return
    pytest.fail(f"no page went through the restarted store in {attempts} attempts")
