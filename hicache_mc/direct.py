"""GPU-direct KV transfer: pages of a device KV pool to and from the store, no host-pool hop.

Primitives (``KVDirect``):

- ``save(page_hashes, page_ids)``: pack the device pages into a staging buffer with the Triton
  kernel (``hicache_mc.kernels``), then ``batch_put_from`` each page part under the SGLang
  adapter's keys; True per page once every part is stored (see ``StoreClient.batch_put_from``).
- ``load(page_hashes, page_ids)``: ``batch_exists`` for the leading run of stored pages,
  ``batch_get_into`` the staging buffer, unpack into the device pages; returns how many
  leading pages were loaded (SGLang's prefix semantics: a hole ends the run).
- ``close()``: drops the staging buffers; the ``StoreClient`` belongs to the caller.

Objects are keyed and laid out exactly as ``hicache_mc.sglang`` stores a host-pool page of the
same layout: ``<namespace>/<page hash>/<part>``, parts ``k``, ``v`` (MHA) or ``kv`` (MLA), each
part the bytes of that page's host-pool part. So a page saved here is a hit for an SGLang
instance with a host pool of that layout, and the other way round, when both use the same
``KVNamespace`` (``kv_namespace`` builds it as the adapter does).

Staging: with a CPU pool the kernel packs straight into the buffer the transport reads. With a
CUDA pool it packs into device staging and copies to pinned host staging (a gather into device
memory then one contiguous copy beats writing scattered runs into pinned memory: 81 % against
53 % of memcpy on an H100 PCIe, sglang-hicache-contract.md section 12); ``device_staging=True``
skips the host copy for a transport that reads GPU memory (Mooncake with GPUDirect RDMA), and
needs a client with ``register_buffer``. The buffer the transport touches is registered once.
"""
from __future__ import annotations

import threading
from typing import Optional, Sequence

import torch

from .keys import KVNamespace, batch_page_keys

STAGING_PAGES = 32   # pages per store round trip: 256 MiB of Llama-3-8B pages (8 MiB each)


def kv_namespace(model: str, store_dtype: torch.dtype, layout: str, page_size: int,
                 layers: int, *, start_layer: int = 0, is_mla: bool = False, tp_size: int = 1,
                 tp_rank: int = 0, pp_rank: int = 0, attn_cp_rank: int = 0,
                 attn_cp_size: int = 1, tenant: str = "", kv_cache_dtype: str = "") -> KVNamespace:
    """The namespace ``hicache_mc.sglang`` derives for a host pool holding these pages.

    ``store_dtype`` is the pool's storage dtype (SGLang stores fp8 KV as ``torch.uint8``);
    ``kv_cache_dtype`` is the adapter's setting of that name (e.g. ``fp8_e4m3``), if set.
    ``layers`` is the number of layers in the pool (a pipeline stage's share).
    """
    kv_dtype = str(store_dtype) + (f":{kv_cache_dtype}" if kv_cache_dtype else "")
    return KVNamespace(model=model, kv_dtype=kv_dtype, layout=layout, page_size=page_size,
                       start_layer=start_layer, end_layer=start_layer + layers - 1,
                       tp_size=tp_size, tp_rank=tp_rank, is_mla=is_mla, pp_rank=pp_rank,
                       attn_cp_rank=attn_cp_rank, attn_cp_size=attn_cp_size, tenant=tenant)


class KVDirect:
    """Moves pages between one device KV pool and the store; thread-safe (one staging lock)."""

    def __init__(self, client, buffers: Sequence[Sequence[torch.Tensor]], namespace: KVNamespace,
                 *, staging_pages: int = STAGING_PAGES, device_staging: bool = False):
        from .kernels import pool_geometry    # lazily: triton and torch are an optional extra
        self.client = client
        self.buffers = tuple(tuple(part) for part in buffers)
        self.geo = geo = pool_geometry(self.buffers, namespace.page_size)
        _check_namespace(namespace, geo)
        self.ns, self.layout = namespace, namespace.layout
        self.namespace = namespace.digest()
        self.parts = namespace.parts()
        self.part_bytes = geo.blob_numel * torch.empty((), dtype=geo.dtype).element_size()
        if staging_pages < 1:
            raise ValueError(f"staging_pages must be >= 1, got {staging_pages}")
        shape = (staging_pages, geo.parts, geo.blob_numel)
        on_gpu = geo.device.type == "cuda"
        register = getattr(client, "register_buffer", None)
        if device_staging and not on_gpu:
            raise ValueError("device_staging is for a CUDA pool: this pool is on "
                             f"{geo.device}, whose pages are already in host memory")
        self.stage = torch.empty(shape, dtype=geo.dtype, device=geo.device)
        self.host = (torch.empty(shape, dtype=geo.dtype, pin_memory=True)
                     if on_gpu and not device_staging else self.stage)
        registered = register is not None and register(
            self.host.data_ptr(), self.host.numel() * self.host.element_size())
        if device_staging and not registered:
            raise ValueError("device_staging needs a transport that reads device memory (the "
                             "Mooncake transport with a CUDA build of the TE): registration failed")
        self._lock = threading.Lock()

    def keys(self, page_hashes: Sequence[str]) -> list[str]:
        """Store keys of these pages, page-major: ``[p0/k, p0/v, p1/k, ...]``."""
        return batch_page_keys(self.namespace, list(page_hashes), self.parts)

    def save(self, page_hashes: Sequence[str], page_ids) -> list[bool]:
        """Store device pages ``page_ids`` under ``page_hashes``; True per page fully stored."""
        ids = self._ids(page_hashes, page_ids)
        out: list[bool] = []
        step = self.stage.shape[0]
        with self._lock:
            for first in range(0, len(ids), step):
                out += self._save_round(page_hashes[first:first + step], ids[first:first + step])
        return out

    def load(self, page_hashes: Sequence[str], page_ids) -> int:
        """Load the leading run of stored pages into device pages ``page_ids``; returns how many."""
        ids = self._ids(page_hashes, page_ids)
        if not len(ids):
            return 0
        stored = self.client.batch_exists(self.keys(page_hashes)) // len(self.parts)
        done, step = 0, self.stage.shape[0]
        with self._lock:
            while done < stored:
                m = min(step, stored - done)
                got = self._load_round(page_hashes[done:done + m], ids[done:done + m])
                done += got
                if got < m:
                    break
        return done

    def close(self) -> None:
        """Release the staging memory (the client is the caller's to close)."""
        self.stage = self.host = None

    # ------------------------------------------------------------------ internals

    def _ids(self, page_hashes, page_ids) -> torch.Tensor:
        ids = torch.as_tensor(page_ids, dtype=torch.int64).reshape(-1)
        if len(page_hashes) != ids.numel():
            raise ValueError(f"{len(page_hashes)} page hashes for {ids.numel()} page ids")
        if self.stage is None:
            raise RuntimeError("KVDirect is closed")
        return ids

    def _objects(self, m: int) -> tuple[list[int], list[int]]:
        """Pointers and sizes of the first ``m`` staged pages, page-major like the keys."""
        ptrs = [self.host[j, q].data_ptr() for j in range(m) for q in range(self.geo.parts)]
        return ptrs, [self.part_bytes] * len(ptrs)

    def _save_round(self, hashes, ids) -> list[bool]:
        from .kernels import pack_pages
        m = ids.numel()
        pack_pages(self.buffers, ids.to(self.geo.device), self.geo.page_size, self.layout,
                   out=self.stage[:m])
        if self.host is not self.stage:
            self.host[:m].copy_(self.stage[:m], non_blocking=True)
        _sync(self.geo.device)
        ok = self.client.batch_put_from(self.keys(hashes), *self._objects(m))
        n = len(self.parts)
        return [all(ok[j * n:(j + 1) * n]) for j in range(m)]

    def _load_round(self, hashes, ids) -> int:
        """Get ``len(ids)`` pages; unpack the leading run whose parts all arrived."""
        from .kernels import unpack_pages
        m = ids.numel()
        ok = self.client.batch_get_into(self.keys(hashes), *self._objects(m))
        n, got = len(self.parts), 0
        while got < m and all(ok[got * n:(got + 1) * n]):
            got += 1
        if got:
            if self.host is not self.stage:
                self.stage[:got].copy_(self.host[:got], non_blocking=True)
            unpack_pages(self.stage[:got], self.buffers, ids[:got].to(self.geo.device),
                         self.geo.page_size, self.layout)
            _sync(self.geo.device)    # the next round overwrites the host staging
        return got


def _check_namespace(ns: KVNamespace, geo) -> None:
    from .kernels import LAYOUTS, MLA_LAYOUTS
    if ns.is_mla != (geo.parts == 1):
        raise ValueError(f"namespace is_mla={ns.is_mla} but the pool has {geo.parts} part(s)")
    allowed = MLA_LAYOUTS if ns.is_mla else LAYOUTS
    if ns.layout not in allowed:
        raise ValueError(f"layout {ns.layout!r} cannot be packed; use one of {allowed}")
    if ns.kv_dtype.split(":")[0] != str(geo.dtype):
        raise ValueError(f"namespace kv_dtype {ns.kv_dtype!r} does not match the pool's "
                         f"{geo.dtype} (its pages would never match a host pool's)")
    if ns.end_layer != -1 and ns.end_layer - ns.start_layer + 1 != geo.layers:
        raise ValueError(f"namespace layers {ns.start_layer}..{ns.end_layer} but the pool "
                         f"has {geo.layers} layers")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
