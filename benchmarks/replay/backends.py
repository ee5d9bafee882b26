"""L3 stores as an instance sees them: the calls SGLang's storage backends make.

Each instance process opens its own client from a picklable spec (a dict with ``kind``):

- ``none``: no L3 (capacity zero). Nothing is stored and no call is made, so the hit rate is
  the local caches' alone; this is the honest "zero capacity", not a store that fails.
- ``hicache-mc``: ``StoreClient`` (``batch_exists`` leading run, ``batch_get_into``,
  ``batch_put_from``), the calls of ``hicache_mc.sglang.HiCacheMC``'s v1 path.
- ``mooncake``: ``MooncakeDistributedStore`` as a pure client (no segment of its own;
  ``batch_is_exist``, ``batch_get_into``, ``batch_put_from``), the calls of SGLang's
  ``MooncakeStore`` backend.
"""
from __future__ import annotations

import os
from abc import ABC, abstractmethod
from typing import Sequence

# A Mooncake pure client still needs a local buffer for its non-zero-copy paths; our reads
# and writes go through the registered staging area, so a small one is enough.
MOONCAKE_LOCAL_BUFFER = 16 << 20


class BaseL3(ABC):
    """One instance's handle on the shared L3. Failures are misses / False, never raised."""

    name = "base"
    enabled = True

    def register(self, ptr: int, nbytes: int) -> None:
        """Make ``[ptr, ptr+nbytes)`` usable as a source/destination (once, at start)."""

    @abstractmethod
    def exists(self, keys: Sequence[str]) -> int:
        """Length of the leading run of ``keys`` the store holds."""
        ...

    @abstractmethod
    def get_into(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]) -> list[bool]:
        """Copy each object into ``ptrs[i]``; False = miss."""
        ...

    @abstractmethod
    def put_from(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int],
                 parent: str = "", hot: int = 0) -> list[bool]:
        """Store each object from ``ptrs[i]``; True once readable by every instance. ``parent``:
        the key before ``keys[0]`` in its chain; ``hot``: how many keys, from the first, want
        copies (stores that know neither ignore them)."""
        ...

    def close(self) -> None:
        """Release the client."""


class NullL3(BaseL3):
    """No L3: holds nothing, calls nothing."""

    name = "none"
    enabled = False

    def exists(self, keys):
        return 0

    def get_into(self, keys, ptrs, sizes):
        return [False] * len(keys)

    def put_from(self, keys, ptrs, sizes, parent="", hot=0):
        return [False] * len(keys)


class HicacheL3(BaseL3):
    name = "hicache-mc"

    def __init__(self, master: str, transport: str = "auto", timeout_s: float = 30.0,
                 view: str = "off", replicas: int = 1, replicate_reads: bool = False):
        from hicache_mc.client import StoreClient
        self.client = StoreClient(master, transport=transport, timeout_s=timeout_s, view=view,
                                  replicas=replicas, replicate_reads=replicate_reads)

    def exists(self, keys):
        return self.client.batch_exists(keys)

    def get_into(self, keys, ptrs, sizes):
        return self.client.batch_get_into(keys, ptrs, sizes)

    def put_from(self, keys, ptrs, sizes, parent="", hot=0):
        from hicache_mc.client import Chain
        return self.client.batch_put_from(keys, ptrs, sizes, Chain(parent, hot))

    def close(self):
        self.client.close()


class MooncakeL3(BaseL3):
    name = "mooncake"

    def __init__(self, master: str):
        # glog reads its flags from the environment when the library loads: keep Mooncake's
        # ~16 INFO lines per client start out of the report (warnings and errors still show)
        os.environ.setdefault("GLOG_minloglevel", "1")
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as exc:  # pragma: no cover - depends on the machine
            raise RuntimeError("Mooncake Store is not installed: pip install "
                               "mooncake-transfer-engine-non-cuda (and apt-get install "
                               "libibverbs1)") from exc
        self.store = MooncakeDistributedStore()
        rc = self.store.setup("127.0.0.1", "P2PHANDSHAKE", 0, MOONCAKE_LOCAL_BUFFER, "tcp", "", master)
        if rc != 0:
            raise RuntimeError(f"Mooncake client setup failed: rc={rc}")

    def register(self, ptr, nbytes):
        rc = self.store.register_buffer(ptr, nbytes)
        if rc != 0:
            raise RuntimeError(f"Mooncake register_buffer failed: rc={rc}")

    def exists(self, keys):
        n = 0
        for flag in self.store.batch_is_exist(list(keys)):   # 1 / 0 / negative error
            if flag != 1:
                break
            n += 1
        return n

    def get_into(self, keys, ptrs, sizes):
        got = self.store.batch_get_into(list(keys), list(ptrs), list(sizes))  # bytes or < 0
        return [g == s for g, s in zip(got, sizes)]

    def put_from(self, keys, ptrs, sizes, parent="", hot=0):
        return [rc == 0 for rc in self.store.batch_put_from(list(keys), list(ptrs), list(sizes))]

    def close(self):
        self.store.close()


def open_l3(spec: dict) -> BaseL3:
    kind = spec["kind"]
    if kind == "none":
        return NullL3()
    if kind == "hicache-mc":
        return HicacheL3(spec["master"], spec.get("transport", "auto"), view=spec.get("view", "off"),
                         replicas=spec.get("replicas", 1),
                         replicate_reads=spec.get("replicate_reads", False))
    if kind == "mooncake":
        return MooncakeL3(spec["master"])
    raise ValueError(f"unknown L3 kind {kind!r} (none, hicache-mc, mooncake)")
