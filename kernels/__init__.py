"""Triton pack/unpack kernels for SGLang paged KV layouts (installed as hicache_mc.kernels).

``pack_pages`` gathers pages of a layer-first device KV pool into contiguous page blobs in the
byte order of one of SGLang's host layouts; ``unpack_pages`` scatters them back. The torch
references live in ``reference``; layouts and formulas in ``layouts`` and ``README.md``.
Importing this package imports triton and torch (the ``kernels`` extra).
"""
from .layouts import LAYOUTS, MLA_LAYOUTS, PoolGeometry, pool_geometry
from .pack import pack_pages, unpack_pages
from .reference import pack_pages_ref, unpack_pages_ref

__all__ = ["LAYOUTS", "MLA_LAYOUTS", "PoolGeometry", "pool_geometry", "pack_pages",
           "unpack_pages", "pack_pages_ref", "unpack_pages_ref"]
