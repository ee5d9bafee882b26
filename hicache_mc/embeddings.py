"""EmbeddingCache: multimodal encoder outputs shared through a hicache-mc store.

The same image sent to many instances is encoded once: the first one ``put``s the encoder's
output under the content hash, the others ``get`` it back instead of running the encoder. Any
Python program can use it; ``hicache_mc.sglang.embedding_store`` plugs it into SGLang.

Objects of one content hash, under a namespace that ``keys.embedding_namespace`` derives from
(model, encoder version, dtype, tenant), or a name of the caller's; either starts with ``emb-``
(a given name gets it prefixed; KV namespaces are hex, so the two never meet; same store, same
tiers, same LRU):

- ``<ns>/<hash>/meta``: a 128-byte header: magic, dtype name, shape, payload bytes;
- ``<ns>/<hash>/<dtype>/<d0>x<d1>...``: the tensor's bytes and nothing else, so a raw
  ``batch_get_into`` copies them straight into the caller's buffer.

The payload key spells out dtype and shape: a request for another dtype or shape names another
key and is a miss, so stored bytes are never read as something else. ``get`` reads the header to
learn dtype and shape. The header is written only after its payload was stored, so a header
names bytes that were stored (until evicted: then a get is a miss). Reads touch both objects,
so they age together in the nodes' LRU.
"""
from __future__ import annotations

import logging
import math
import struct
from typing import NamedTuple, Optional, Sequence, Union

import numpy as np
import torch

from .client import StoreClient
from .errors import HicacheError
from .auth import tenant_for
from .keys import embedding_namespace, tenant_of, with_tenant

log = logging.getLogger(__name__)

MAGIC = b"HMCEMB\x00\x01"        # format 1
MAX_DIMS = 8
# magic, dtype name, ndim, shape (MAX_DIMS slots), payload bytes, reserved: 128 bytes
HEADER = struct.Struct(f"<8s24sI4x{MAX_DIMS}QQ16x")
DType = Union[torch.dtype, str]


class EmbeddingMismatch(HicacheError, ValueError):
    """``get`` asked for a dtype or shape other than the stored one."""


def dtype_of(value: DType) -> torch.dtype:
    """A torch dtype from a dtype or its name (``"bfloat16"``, ``"torch.bfloat16"``)."""
    if isinstance(value, torch.dtype):
        return value
    dt = getattr(torch, str(value).removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown torch dtype {value!r}")
    return dt


def dtype_name(value: DType) -> str:
    return str(dtype_of(value)).removeprefix("torch.")


class Descriptor(NamedTuple):
    """What a payload is: its dtype and shape (its size follows)."""
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def part(self) -> str:
        """The key suffix naming this payload, e.g. ``bfloat16/576x1024``."""
        return f"{dtype_name(self.dtype)}/{'x'.join(map(str, self.shape)) or 'scalar'}"

    def pack(self) -> bytes:
        dims = list(self.shape) + [0] * (MAX_DIMS - len(self.shape))
        return HEADER.pack(MAGIC, dtype_name(self.dtype).encode(), len(self.shape), *dims,
                           self.nbytes)

    @classmethod
    def unpack(cls, raw) -> Optional["Descriptor"]:
        """The header's descriptor; None for anything that is not a well-formed header."""
        if len(raw) != HEADER.size:
            return None
        magic, name, ndim, *rest = HEADER.unpack(bytes(raw))
        dims, nbytes = rest[:MAX_DIMS], rest[MAX_DIMS]
        try:
            dtype = dtype_of(name.rstrip(b"\0").decode("ascii"))
        except (UnicodeDecodeError, ValueError):
            return None
        if magic != MAGIC or ndim > MAX_DIMS:
            return None
        desc = cls(dtype, tuple(dims[:ndim]))
        return desc if desc.nbytes == nbytes else None

    @classmethod
    def of(cls, dtype: DType, shape: Sequence[int], size: Optional[int] = None) -> "Descriptor":
        """Checked descriptor; ``size`` (bytes), when given, must agree with dtype and shape."""
        shape = tuple(int(d) for d in shape)
        if len(shape) > MAX_DIMS or any(d < 0 for d in shape):
            raise ValueError(f"shape {shape}: at most {MAX_DIMS} non-negative dimensions")
        desc = cls(dtype_of(dtype), shape)
        if desc.nbytes == 0:
            raise ValueError(f"shape {shape}: an embedding needs at least one element")
        if size is not None and size != desc.nbytes:
            raise ValueError(f"shape {shape} of {dtype_name(dtype)} is {desc.nbytes} bytes, "
                             f"but the size given is {size}")
        return desc


def check_hash(content_hash: str) -> str:
    if not isinstance(content_hash, str) or not content_hash or "/" in content_hash:
        raise ValueError(f"content hash must be a non-empty str without '/', got {content_hash!r}")
    return content_hash


class EmbeddingCache:
    """Tensors by content hash in one namespace of a hicache-mc store. Thread-safe.

    ``EmbeddingCache(master, namespace=ns)`` or ``EmbeddingCache(master, model=..., dtype=...,
    encoder_version=..., tenant=...)`` (the namespace is then derived). Pass ``client=`` to share
    a StoreClient; other keywords are ClientConfig fields. Store failures are misses / False.
    """

    def __init__(self, master: Optional[str] = None, namespace: Optional[str] = None, *,
                 model: Optional[str] = None, encoder_version: str = "",
                 dtype: Optional[DType] = None, tenant: str = "",
                 client: Optional[StoreClient] = None, **options):
        if client is not None and (master is not None or options):
            raise ValueError("give either client= or master=/client options, not both")
        self._owns_client = client is None
        self.client = client if client is not None else StoreClient(master, **options)
        try:
            self.namespace = self._namespace(namespace, model, encoder_version, dtype, tenant)
        except ValueError:
            self.close()
            raise

    def _namespace(self, namespace, model, encoder_version, dtype, tenant) -> str:
        """The cache's namespace: ``namespace`` (prefixed with ``emb-``) or one derived from the
        model; in the tenant of the client's credential when it is a client's (the store takes
        a client's keys of its own tenant only), else ``tenant``."""
        tenant = tenant_for(self.client.config.token, tenant)
        if namespace is None:
            if not model:
                raise ValueError("EmbeddingCache needs namespace=, or model= (with "
                                 "encoder_version=, dtype=, tenant=) to derive one")
            dt = dtype_name(dtype) if dtype is not None else None
            return embedding_namespace(model, encoder_version, dt, tenant)
        if not isinstance(namespace, str) or not namespace or "/" in namespace:
            raise ValueError(f"namespace {namespace!r}: a name without '/' (or let "
                             f"hicache_mc.keys.embedding_namespace derive one from model=)")
        if not namespace.startswith("emb-"):    # never a KV namespace (those are hex)
            namespace = "emb-" + namespace
        if tenant and tenant_of(namespace + "/") != tenant:
            if tenant_of(namespace + "/"):
                raise ValueError(f"namespace {namespace!r} is not in tenant {tenant!r}")
            namespace = with_tenant(namespace, tenant)
        return namespace

    # ------------------------------------------------------------------ keys

    def meta_key(self, content_hash: str) -> str:
        return f"{self.namespace}/{check_hash(content_hash)}/meta"

    def data_key(self, content_hash: str, desc: Descriptor) -> str:
        return f"{self.namespace}/{check_hash(content_hash)}/{desc.part()}"

    # ------------------------------------------------------------------ tensors

    def put(self, content_hash: str, tensor: torch.Tensor) -> bool:
        """Store ``tensor`` (any device) under ``content_hash``; True once every client sees it."""
        t = tensor.detach()
        if t.device.type != "cpu":
            t = t.to("cpu")
        t = t.contiguous()
        return self.batch_put_from([content_hash], [t.data_ptr()], [t.nbytes],
                                   dtype=t.dtype, shapes=[t.shape])[0]

    def get(self, content_hash: str, device: Union[str, torch.device] = "cpu", *,
            dtype: Optional[DType] = None, shape: Optional[Sequence[int]] = None
            ) -> Optional[torch.Tensor]:
        """The stored tensor on ``device``, or None on a miss.

        ``dtype`` / ``shape``, when given, are what the caller expects: another stored dtype or
        shape raises EmbeddingMismatch (it is never converted or reshaped).
        """
        header = np.empty(HEADER.size, np.uint8)
        if not self.client.batch_get_into([self.meta_key(content_hash)], [header.ctypes.data],
                                          [HEADER.size])[0]:
            return None
        desc = Descriptor.unpack(header)
        if desc is None:
            log.warning("embedding %s: malformed header in %s; treated as a miss",
                        content_hash, self.namespace)
            return None
        if (dtype is not None and dtype_of(dtype) != desc.dtype) or \
                (shape is not None and tuple(shape) != desc.shape):
            raise EmbeddingMismatch(
                f"embedding {content_hash}: stored as {dtype_name(desc.dtype)} {list(desc.shape)}, "
                f"requested {dtype_name(dtype) if dtype is not None else 'any dtype'} "
                f"{list(shape) if shape is not None else 'any shape'}")
        out = torch.empty(desc.shape, dtype=desc.dtype)
        if not self.client.batch_get_into([self.data_key(content_hash, desc)], [out.data_ptr()],
                                          [desc.nbytes])[0]:
            return None
        return out if torch.device(device).type == "cpu" else out.to(device)

    # ------------------------------------------------------------------ batch / raw

    def batch_exists(self, content_hashes: Sequence[str]) -> list[bool]:
        """Per hash: is a header stored? (Unlike KV pages, embeddings are not a prefix chain.)"""
        return self._exists_each([self.meta_key(h) for h in content_hashes])

    def batch_put_from(self, content_hashes: Sequence[str], ptrs: Sequence[int],
                       sizes: Sequence[int], *, dtype: DType,
                       shapes: Optional[Sequence[Sequence[int]]] = None) -> list[bool]:
        """Store ``sizes[i]`` bytes of host memory at ``ptrs[i]`` as a tensor of ``dtype`` and
        ``shapes[i]`` (default: 1-D). A size that disagrees with dtype and shape is a ValueError."""
        descs = self._descriptors(content_hashes, sizes, dtype, shapes)
        keys = [self.data_key(h, d) for h, d in zip(content_hashes, descs)]
        ok = self.client.batch_put_from(keys, ptrs, sizes)
        stored = [i for i, good in enumerate(ok) if good]
        if stored:   # headers only for stored payloads: a header always names stored bytes
            headers = np.frombuffer(b"".join(descs[i].pack() for i in stored), np.uint8)
            base = headers.ctypes.data
            meta_ok = self.client.batch_put_from(
                [self.meta_key(content_hashes[i]) for i in stored],
                [base + j * HEADER.size for j in range(len(stored))], [HEADER.size] * len(stored))
            for i, good in zip(stored, meta_ok):
                ok[i] = good
        return ok

    def batch_get_into(self, content_hashes: Sequence[str], ptrs: Sequence[int],
                       sizes: Sequence[int], *, dtype: DType,
                       shapes: Optional[Sequence[Sequence[int]]] = None) -> list[bool]:
        """Copy each stored tensor of exactly ``dtype`` and ``shapes[i]`` (default: 1-D of
        ``sizes[i]`` bytes) into ``ptrs[i]``. Any other dtype or shape is a miss (False), and the
        buffer is left alone."""
        descs = self._descriptors(content_hashes, sizes, dtype, shapes)
        n = len(descs)
        # The headers are read too: that keeps each as fresh in the LRU as its payload.
        headers = np.empty((n, HEADER.size), np.uint8)
        keys = [self.data_key(h, d) for h, d in zip(content_hashes, descs)]
        keys += [self.meta_key(h) for h in content_hashes]
        header_ptrs = [headers.ctypes.data + i * HEADER.size for i in range(n)]
        ok = self._get_each(keys, list(ptrs) + header_ptrs, list(sizes) + [HEADER.size] * n)
        for i in range(n):
            stored = Descriptor.unpack(headers[i]) if ok[n + i] and not ok[i] else None
            if stored is not None and stored != descs[i]:
                log.warning("embedding %s: stored as %s %s, requested %s %s: a miss",
                            content_hashes[i], dtype_name(stored.dtype), list(stored.shape),
                            dtype_name(descs[i].dtype), list(descs[i].shape))
        return ok[:n]

    # ------------------------------------------------------------------ admin

    def clear(self) -> int:
        """Remove this namespace's objects (headers and payloads) from every node."""
        return self.client.clear(self.namespace + "/")

    def close(self) -> None:
        if self._owns_client:
            self.client.close()

    def __enter__(self) -> "EmbeddingCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ helpers

    @staticmethod
    def _descriptors(content_hashes, sizes, dtype, shapes) -> list[Descriptor]:
        hashes, sizes = list(content_hashes), [int(s) for s in sizes]
        if len(hashes) != len(sizes) or (shapes is not None and len(shapes) != len(sizes)):
            raise ValueError(f"{len(hashes)} hashes, {len(sizes)} sizes and "
                             f"{'no' if shapes is None else len(shapes)} shapes: lengths differ")
        dt = dtype_of(dtype)
        if shapes is None:
            bad = [s for s in sizes if s % dt.itemsize]
            if bad:
                raise ValueError(f"size {bad[0]} is not a whole number of {dtype_name(dt)} "
                                 f"elements")
            shapes = [(s // dt.itemsize,) for s in sizes]
        for h in hashes:
            check_hash(h)
        return [Descriptor.of(dt, shape, size) for shape, size in zip(shapes, sizes)]

    def _exists_each(self, keys: list[str]) -> list[bool]:
        return self.client.batch_contains(keys)

    def _get_each(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[bool]:
        return self.client.batch_get_into(keys, ptrs, sizes)   # per key: holes do not end it

