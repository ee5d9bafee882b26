"""The residency view's compact key set (client/digests.py) against a Python set model."""
import os
import random

import numpy as np
import pytest

import hicache_mc.client.digests as D
from hicache_mc.client.digests import DigestSet, prefixes


def _digests(n: int) -> bytes:
    return os.urandom(16 * n)


def _as_digests(values) -> bytes:
    return b"".join(int(x).to_bytes(8, "little") * 2 for x in values)


@pytest.mark.parametrize("fold_at", [4, 1 << 15])   # fold into the array often, or never
def test_updates_and_lookups_match_a_set(monkeypatch, fold_at):
    monkeypatch.setattr(D, "FOLD_AT", fold_at)
    rng = random.Random(fold_at)
    first = _digests(200)
    view, model = DigestSet(first), set(prefixes(first).tolist())
    for _ in range(300):
        added = _digests(rng.randint(0, 6))
        removed = _as_digests(rng.sample(sorted(model), 2)) + _digests(rng.randint(0, 1))   # (absent)
        view.apply(added, removed)
        model -= set(prefixes(removed).tolist())
        model |= set(prefixes(added).tolist())
        absent = prefixes(_digests(3))
        q = np.array(rng.sample(sorted(model), 5) + absent.tolist() + rng.sample(sorted(model), 2),
                     dtype=np.uint64)
        found = view.contains(q)
        assert found == [x in model for x in q.tolist()]
        assert view.leading(q) == 5 and view.leading(q[:5]) == 5 and view.leading(q[5:]) == 0


def test_a_key_removed_then_stored_again_is_present():
    d = _digests(1)
    view = DigestSet(d)
    view.apply(b"", d)
    assert view.contains(prefixes(d)) == [False]
    view.apply(d, b"")
    assert view.contains(prefixes(d)) == [True] and view.leading(prefixes(d)) == 1


def test_keys_are_cut_into_runs_of_one_namespace():
    from hicache_mc.client.view import MAX_NAMESPACES, _runs
    a, b = [f"a@t/{i}" for i in range(3)], [f"ab@t/{i}" for i in range(2)]
    assert _runs(a) == [a]
    assert _runs(a + b + a[:1]) == [a, b, a[:1]]
    many = [f"n{i}/k" for i in range(MAX_NAMESPACES + 1)]
    assert _runs(many) == [[]]


def test_own_writes_are_answered_for_a_while_then_forgotten(monkeypatch):
    """A client's own writes count as stored for 5-10 s, also when it writes nothing more."""
    import numpy as np

    from hicache_mc import residency as R
    from hicache_mc.client import own_writes as V
    from hicache_mc.client.digests import prefixes
    now = [1000.0]
    monkeypatch.setattr(V.time, "monotonic", lambda: now[0])
    own = V.OwnWrites()
    keys = ["ns@t/a/k", "ns@t/b/k"]
    q = prefixes(R.digests(keys + ["ns@t/c/k"]))
    own.add(keys)
    assert own.add_to(np.zeros(3, bool), q).tolist() == [True, True, False]
    now[0] += V.OWN_TTL_S / 2 + 0.1             # no write since: still answered ...
    assert own.add_to(np.zeros(3, bool), q).tolist() == [True, True, False]
    now[0] += V.OWN_TTL_S / 2                   # ... until its generation's time is up
    assert own.add_to(np.zeros(3, bool), q).tolist() == [False, False, False]
    own.add(keys[:1])
    now[0] += V.OWN_TTL_S / 2 + 0.1
    own.add(keys[1:])                           # a new generation; the first still answers
    assert own.add_to(np.zeros(3, bool), q).tolist() == [True, True, False]
    own.forget(R.digests(keys[1:]))             # removed from the store: no longer answered
    assert own.add_to(np.zeros(3, bool), q).tolist() == [True, False, False]
    own.clear()
    assert own.add_to(np.zeros(3, bool), q).tolist() == [False, False, False]


def test_a_chain_ends_at_its_first_page_missing_any_part():
    """exists_pages counts the pages, from the first, whose every part the view holds, from
    the page hashes alone, whichever part of a page is missing."""
    import hashlib
    import time

    from hicache_mc import residency as R
    from hicache_mc.client.view import ResidencyView, Space
    from hicache_mc.keys import batch_page_keys
    ns = "0123456789abcdef"
    hashes = [hashlib.sha256(b"chain %d" % i).hexdigest() for i in range(6)]
    keys = batch_page_keys(ns, hashes, ("k", "v"))      # page-major: page i's k, then its v
    view = ResidencyView(None, "tcp://127.0.0.1:1", "", 1.0)
    for lacking, pages in ((None, 6), (2 * 4 + 1, 4), (2 * 3, 3), (1, 0), (2 * 5, 5)):
        stored = [k for i, k in enumerate(keys) if i != lacking]
        view.spaces[ns] = Space(ns, keys=DigestSet(R.digests(stored)), synced=True, need=False,
                                heard=time.monotonic() + 60)
        assert view.exists_pages(ns, hashes, ("k", "v")) == pages, lacking
        assert view.exists_pages(ns, hashes, ("v", "k")) == pages, lacking
        assert view.exists(keys) == (len(keys) if lacking is None else lacking), lacking
