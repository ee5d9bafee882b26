"""The launchers reject bad input with errors that say what is wrong, before any launch."""
from __future__ import annotations

import threading

import pytest
import torch
from kernel_cases import make_pool, poisoned, same_bytes

from hicache_mc.kernels import pack_pages, pack_pages_ref, unpack_pages

PS = 16


@pytest.fixture
def pool(device):
    return make_pool(2, 3, 2, 64, torch.float16, PS, 4, device, torch.Generator().manual_seed(0))


def _out(device, n=2, parts=2, numel=3 * PS * 2 * 64, dtype=torch.float16):
    return poisoned((n, parts, numel), dtype, device)


def test_bad_layout(pool):
    with pytest.raises(ValueError, match="layout must be one of"):
        pack_pages(pool, [0], PS, "page_last")


def test_mla_has_no_page_head(device):
    mla = make_pool(1, 2, 1, 72, torch.bfloat16, PS, 2, device, torch.Generator())
    with pytest.raises(ValueError, match="MLA host pools have no 'page_head'"):
        pack_pages(mla, [0], PS, "page_head")


def test_mla_needs_one_head(device):
    bad = make_pool(1, 2, 2, 64, torch.bfloat16, PS, 2, device, torch.Generator())
    with pytest.raises(ValueError, match=r"MLA layers must be \(slots, 1, C\)"):
        pack_pages(bad, [0], PS, "page_first")


def test_mismatched_layers(pool):
    with pytest.raises(ValueError, match="same non-zero number of layers"):
        pack_pages((pool[0], pool[1][:2]), [0], PS, "page_first")
    with pytest.raises(ValueError, match=r"buffers\[1\]\[2\] has shape"):
        pack_pages((pool[0], pool[1][:2] + [pool[1][2][:-1]]), [0], PS, "page_first")
    with pytest.raises(TypeError, match=r"buffers\[1\]\[0\] is torch.bfloat16"):
        pack_pages((pool[0], [pool[1][0].bfloat16()] + pool[1][1:]), [0], PS, "page_first")


def test_rows_must_be_contiguous(pool):
    transposed = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in pool[1]]
    with pytest.raises(ValueError, match=r"contiguous \(H, D\) rows"):
        pack_pages((pool[0], transposed), [0], PS, "page_first")


def test_unsupported_dtype(device):
    f64 = make_pool(2, 1, 1, 8, torch.float64, PS, 2, device, torch.Generator())
    with pytest.raises(TypeError, match="unsupported KV dtype torch.float64"):
        pack_pages(f64, [0], PS, "page_first")


def test_page_index_range_and_repeats(pool):
    with pytest.raises(ValueError, match=r"page index out of range: \[0, 4\] not within \[0, 4\)"):
        pack_pages(pool, [0, 4], PS, "page_first")          # page 4 is the partial tail
    with pytest.raises(ValueError, match="page index out of range"):
        pack_pages(pool, [-1], PS, "page_first")
    with pytest.raises(ValueError, match="1-D int32/int64"):
        pack_pages(pool, torch.zeros(2, 1, dtype=torch.int64), PS, "page_first")
    blobs = pack_pages(pool, [1, 1], PS, "page_first")     # repeats are fine for a gather ...
    with pytest.raises(ValueError, match="repeat a page"):  # ... not for a scatter
        unpack_pages(blobs, pool, [1, 1], PS, "page_first")


def test_bad_out(pool, device):
    with pytest.raises(ValueError, match=r"out must have shape \(2, 2, 6144\)"):
        pack_pages(pool, [0, 1], PS, "page_first", out=_out(device, numel=100))
    with pytest.raises(TypeError, match="out is torch.bfloat16"):
        pack_pages(pool, [0, 1], PS, "page_first", out=_out(device, dtype=torch.bfloat16))
    strided = _out(device, numel=2 * 3 * PS * 2 * 64)[:, :, ::2]
    with pytest.raises(ValueError, match="contiguous within a blob"):
        pack_pages(pool, [0, 1], PS, "page_first", out=strided)
    with pytest.raises(ValueError, match=r"blobs must have shape \(1, 2, 6144\)"):
        unpack_pages(_out(device), pool, [0], PS, "page_first")


def test_bad_layers_and_page_size(pool):
    with pytest.raises(ValueError, match="layers must be a non-empty selection of 0..2"):
        pack_pages(pool, [0], PS, "page_first", layers=range(2, 4))
    with pytest.raises(ValueError, match="page_size must be a positive int"):
        pack_pages(pool, [0], 0, "page_first")
    with pytest.raises(ValueError, match="fewer than one page"):
        pack_pages(pool, [0], 1024, "page_first")


def test_concurrent_launches(pool, device):
    """HiCache calls from several threads; under the interpreter the launch lock serializes."""
    want = pack_pages_ref(pool, [3, 0], PS, "page_head")
    errors, results = [], []

    def worker():
        try:
            for _ in range(2):
                results.append(pack_pages(pool, [3, 0], PS, "page_head"))
        except Exception as exc:  # noqa: BLE001 - collected and asserted below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(results) == 8 and all(same_bytes(r, want) for r in results)
