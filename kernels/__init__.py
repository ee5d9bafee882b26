"""Triton pack/unpack kernels for SGLang paged KV layouts (installed as hicache_mc.kernels)."""
