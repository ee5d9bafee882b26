"""Packed blobs equal, byte for byte, what SGLang's real host pool holds for the same page.

SGLang's device-to-host copy ops (``sgl_kernel.kvcacheio``) do not exist on CPU, so the host
pool is filled here by plain tensor assignment along the dimensions SGLang names in
``init_kv_buffer`` (e.g. page_head's ``kv_buffer[k/v, page, head, token, layer, dim]``); that
statement of the layout is independent of both the kernel and ``reference.py``. The blobs are
then compared with the bytes behind ``get_page_buffer_meta`` (what a zero-copy backend stores
under a page's keys) and with ``get_data_page`` (the generic backends' flat page).
"""
from __future__ import annotations

import ctypes
import os
import sys

import pytest
import torch

from hicache_mc.kernels import pack_pages, unpack_pages

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="SGLang's pools are built on CPU; kernels run on CPU "
                                       "only in the Triton interpreter")
STUBS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "stubs")
PS, LAYERS, DEV_PAGES = 16, 5, [3, 1, 2]


def _sglang():
    """Import SGLang's pools on CPU behind the torchvision stub (cpu-toolchain.md section 3)."""
    pytest.importorskip("sglang")
    import transformers.utils.import_utils as iu
    iu.is_torchvision_available()            # cached False before the stub becomes visible
    if STUBS not in sys.path:
        sys.path.insert(0, STUBS)
    from sglang.srt.mem_cache import memory_pool
    from sglang.srt.mem_cache.pool_host import mha, mla
    return memory_pool, mha, mla


def _fill_random(layer_tensors, gen):
    for t in layer_tensors:
        t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape,
                                                dtype=torch.uint8, generator=gen))


def _mha(layout, dtype):
    memory_pool, mha, _ = _sglang()
    dev = memory_pool.MHATokenToKVPool(
        size=64, page_size=PS, dtype=dtype, head_num=3, head_dim=80, layer_num=LAYERS,
        device="cpu", enable_memory_saver=False, start_layer=0, end_layer=LAYERS - 1)
    host = mha.MHATokenToKVPoolHost(
        dev.get_device_pool_infos()[0].buffer_info, 2.0, 0, PS, layout, pin_memory=False,
        device="cpu", device_capacity_tokens=dev.size, start_layer=0, end_layer=LAYERS - 1,
        write_back_staging=getattr(dev, "hicache_write_back_staging", None))
    return (dev.k_buffer, dev.v_buffer), host


def _mla(layout, dtype):
    memory_pool, _, mla = _sglang()
    dev = memory_pool.MLATokenToKVPool(
        size=64, page_size=PS, dtype=dtype, kv_lora_rank=64, qk_rope_head_dim=16,
        layer_num=LAYERS, device="cpu", enable_memory_saver=False, start_layer=0,
        end_layer=LAYERS - 1)
    host = mla.MLATokenToKVPoolHost(
        dev.get_device_pool_infos()[0].buffer_info, 2.0, 0, PS, layout, pin_memory=False,
        device="cpu", device_capacity_tokens=dev.size, start_layer=0, end_layer=LAYERS - 1,
        target_layer_num=LAYERS)
    return (dev.kv_buffer,), host


def _backup(host, buffers, layout, host_slot, dev_page):
    """Copy one device page into the host pool along SGLang's named kv_buffer dimensions."""
    t0, hp = host_slot, host_slot // PS
    mla = len(buffers) == 1
    for q, part in enumerate(buffers):
        kv = host.kv_buffer if mla else host.kv_buffer[q]
        for l, layer in enumerate(part):
            for t in range(PS):
                row = layer[dev_page * PS + t]                      # (H, D)
                if layout == "layer_first":       # (L, S, H, D)
                    kv[l, t0 + t] = row
                elif layout == "page_first":      # (S, L, H, D)
                    kv[t0 + t, l] = row
                elif layout == "page_first_direct":   # (P, L, ps, H, D)
                    kv[hp, l, t] = row
                else:                             # page_head: (P, H, ps, L, D)
                    kv[hp, :, t, l] = row


def _part_bytes(host, host_slots, parts):
    """Per page and part, the bytes behind get_page_buffer_meta (layer_first: chunks joined)."""
    ptrs, sizes = host.get_page_buffer_meta(host_slots)
    per_page = len(ptrs) // (len(host_slots) // PS)
    out = []
    for p in range(0, len(ptrs), per_page):
        page_ptrs, page_sizes = ptrs[p:p + per_page], sizes[p:p + per_page]
        out.append([b"".join(ctypes.string_at(a, n) for a, n in
                             zip(page_ptrs[q::parts], page_sizes[q::parts]))
                    for q in range(parts)])
    return out


CASES = [("mha", lay) for lay in ("page_first", "page_first_direct", "page_head", "layer_first")]
CASES += [("mla", lay) for lay in ("page_first", "page_first_direct", "layer_first")]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
@pytest.mark.parametrize("kind,layout", CASES, ids=[f"{k}-{lay}" for k, lay in CASES])
def test_blobs_equal_sglang_host_pages(kind, layout, dtype):
    buffers, host = (_mha if kind == "mha" else _mla)(layout, dtype)
    gen = torch.Generator().manual_seed(11)
    for part in buffers:
        _fill_random(part, gen)
    host_slots = host.alloc(len(DEV_PAGES) * PS)
    for i, page in enumerate(DEV_PAGES):
        _backup(host, buffers, layout, int(host_slots[i * PS]), page)

    blobs = pack_pages(buffers, DEV_PAGES, PS, layout)
    assert blobs.dtype == host.kv_buffer.dtype          # fp8 pools store (and move) uint8
    zero_copy = _part_bytes(host, host_slots, len(buffers))
    for i in range(len(DEV_PAGES)):
        slot = int(host_slots[i * PS])
        flat = host.get_data_page(slot, flat=True)
        assert torch.equal(blobs[i].reshape(-1).view(torch.uint8), flat.view(torch.uint8))
        for q in range(len(buffers)):
            assert blobs[i, q].view(torch.uint8).numpy().tobytes() == zero_copy[i][q]

    # ... and the other way round: host pages unpack into a device pool as the same bytes.
    restored = tuple([torch.zeros_like(t) for t in part] for part in buffers)
    flats = torch.stack([host.get_data_page(int(host_slots[i * PS]), flat=True)
                         for i in range(len(DEV_PAGES))])
    unpack_pages(flats.view(blobs.shape), restored, DEV_PAGES, PS, layout)
    for src, got in zip(sum(map(list, buffers), []), sum(map(list, restored), [])):
        for page in DEV_PAGES:
            rows = slice(page * PS, (page + 1) * PS)
            assert torch.equal(got[rows].view(torch.uint8), src[rows].view(torch.uint8))
