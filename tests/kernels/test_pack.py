"""pack_pages / unpack_pages against the torch reference, bit for bit.

Every case runs in the Triton interpreter on CPU (a GPU when present); sizes stay at a few
hundred KB and tens of programs, so the whole matrix takes well under a minute.
"""
from __future__ import annotations

import itertools

import pytest
import torch
from kernel_cases import clone_pool, full, make_pool, poisoned, random_bytes, same_bytes

from hicache_mc.kernels import (LAYOUTS, MLA_LAYOUTS, pack_pages, pack_pages_ref, unpack_pages,
                                unpack_pages_ref)

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn]
# (name, parts, L, H, D): a regular MHA shape, the odd one (3 heads of dim 80, 5 layers), a
# narrow one whose rows are not a multiple of 8 bytes (forces 1/2/4-byte words), and MLA.
SHAPES = [("mha", 2, 4, 2, 64), ("mha-odd", 2, 5, 3, 80), ("mha-narrow", 2, 3, 3, 5),
          ("mla", 1, 5, 1, 72)]
PAGE_SIZES = [1, 16, 64]
PAGES = [5, 0, 3, 2]            # out of order, with gaps; the pool holds 6 whole pages


def _cases():
    for (name, parts, L, H, D), dtype, ps in itertools.product(SHAPES, DTYPES, PAGE_SIZES):
        for layout in (MLA_LAYOUTS if parts == 1 else LAYOUTS):
            if layout == "layer_first" and (ps != 16 or dtype != torch.bfloat16):
                continue   # an alias of page_first_direct's order: one case is enough
            yield pytest.param(parts, L, H, D, dtype, ps, layout,
                               id=f"{name}-{layout}-{str(dtype)[6:]}-ps{ps}")


@pytest.mark.parametrize("parts,L,H,D,dtype,ps,layout", list(_cases()))
def test_pack_unpack_match_reference(parts, L, H, D, dtype, ps, layout, device):
    gen = torch.Generator().manual_seed(ps * 1000 + L)
    pool = make_pool(parts, L, H, D, dtype, ps, 6, device, gen)
    idx = torch.tensor(PAGES, device=device)

    out = poisoned((len(PAGES), parts, L * ps * H * D), dtype, device)
    assert pack_pages(pool, idx, ps, layout, out=out) is out
    want = pack_pages_ref(pool, PAGES, ps, layout)
    assert same_bytes(out, want)

    blobs = random_bytes(out.shape, dtype, device, gen)
    got, ref = clone_pool(pool), clone_pool(pool)
    unpack_pages(blobs, got, idx, ps, layout)
    unpack_pages_ref(blobs, ref, PAGES, ps, layout)
    for g, r in zip(itertools.chain(*got), itertools.chain(*ref)):
        assert same_bytes(full(g), full(r))


@pytest.mark.parametrize("layout", LAYOUTS[:3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e5m2])
def test_round_trip_touches_only_listed_pages(layout, dtype, device):
    """pack then unpack into a poisoned pool restores exactly the listed pages; padding between
    strided rows (a fused K/V allocation) and every other page keep their bytes."""
    gen = torch.Generator().manual_seed(7)
    ps, pages = 16, [4, 1, 2]
    pool = make_pool(2, 5, 3, 80, dtype, ps, 6, device, gen, pad_heads=1)
    blobs = pack_pages(pool, pages, ps, layout)
    target = clone_pool(pool)
    for t, p in itertools.product(itertools.chain(*target), pages):
        full(t).view(torch.uint8)[p * ps:(p + 1) * ps] = 0xFF        # poison, padding included
    before = clone_pool(target)
    unpack_pages(blobs, target, pages, ps, layout)
    touched = torch.zeros(pool[0][0].shape[0], dtype=torch.bool, device=device)
    for p in pages:
        touched[p * ps:(p + 1) * ps] = True
    for src, got, old in zip(*(itertools.chain(*p) for p in (pool, target, before))):
        got_b, src_b, old_b = (x.view(torch.uint8) for x in (got, src, old))
        assert torch.equal(got_b[touched], src_b[touched])
        assert torch.equal(full(got).view(torch.uint8)[~touched],
                           full(old).view(torch.uint8)[~touched])
        assert torch.equal(full(got).view(torch.uint8)[:, 3:], full(old).view(torch.uint8)[:, 3:])


def test_layer_range_and_strided_out(device):
    """A pipeline stage's layer range, into blobs that sit inside a larger staging buffer."""
    gen = torch.Generator().manual_seed(3)
    ps, L, H, D, dtype = 16, 6, 2, 64, torch.float16
    pool = make_pool(2, L, H, D, dtype, ps, 6, device, gen)
    layers = range(2, 5)
    E = len(layers) * ps * H * D
    staging = poisoned((3, 2, E + 64), dtype, device)          # pages 128 B apart
    out = staging[:, :, :E]
    pack_pages(pool, [1, 5, 0], ps, "page_head", layers=layers, out=out)
    assert same_bytes(out, pack_pages_ref(pool, [1, 5, 0], ps, "page_head", layers=layers))
    assert (staging[:, :, E:].view(torch.uint8) == 0xFF).all()

    target = clone_pool(pool)
    unpack_pages(out, target, [3, 4, 2], ps, "page_head", layers=layers)
    ref = clone_pool(pool)
    unpack_pages_ref(out, ref, [3, 4, 2], ps, "page_head", layers=layers)
    for g, r in zip(itertools.chain(*target), itertools.chain(*ref)):
        assert same_bytes(g, r)
    for l in (0, 1, 5):                                        # outside the range: untouched
        assert same_bytes(target[0][l], pool[0][l]) and same_bytes(target[1][l], pool[1][l])


def test_empty_page_list(device):
    gen = torch.Generator().manual_seed(1)
    pool = make_pool(2, 2, 2, 64, torch.float16, 16, 2, device, gen)
    out = pack_pages(pool, torch.empty(0, dtype=torch.int64), 16, "page_first")
    assert out.shape == (0, 2, 2 * 16 * 2 * 64)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("layout", LAYOUTS[:3])
def test_llama_shaped_pages_on_gpu(layout):
    """Full-size pages (Llama-3-8B: 32 layers, 8 heads of 128, bf16, page 64) on the device."""
    gen = torch.Generator().manual_seed(5)
    pool = make_pool(2, 32, 8, 128, torch.bfloat16, 64, 24, "cuda", gen)
    pages = torch.randperm(24, generator=gen)[:16]
    out = poisoned((16, 2, 32 * 64 * 8 * 128), torch.bfloat16, "cuda")
    pack_pages(pool, pages.cuda(), 64, layout, out=out)
    assert same_bytes(out, pack_pages_ref(pool, pages, 64, layout))
    target = clone_pool(pool)
    for t in itertools.chain(*target):
        t.view(torch.uint8).fill_(0xFF)
    unpack_pages(out, target, pages.cuda(), 64, layout)
    slots = (pages[:, None] * 64 + torch.arange(64)).reshape(-1).cuda()
    for src, got in zip(itertools.chain(*pool), itertools.chain(*target)):
        assert same_bytes(got[slots], src[slots])
