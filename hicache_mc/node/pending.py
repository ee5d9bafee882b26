"""PendingWrite: a client's commit on its way to disk (``sync``) and to the master."""
from __future__ import annotations


class PendingWrite:
    """A client's write on its way to disk (``sync``) and to the master."""

    def __init__(self, ident: bytes, req_id: int, request_keys: list[str]):
        self.ident, self.req_id = ident, req_id
        self.ok = [False] * len(request_keys)
        self.where: list[int] = []           # request position of each stored key
        self.keys: list[str] = []
        self.sizes: list[int] = []
        self.sums: list[int] = []

    def add(self, i: int, key: str, size: int, checksum: int) -> None:
        self.ok[i] = True
        self.where.append(i)
        self.keys.append(key)
        self.sizes.append(size)
        self.sums.append(checksum)

    def drop(self, keys: set) -> None:
        keep = [j for j, k in enumerate(self.keys) if k not in keys]
        for j, k in enumerate(self.keys):
            if k in keys:
                self.ok[self.where[j]] = False
        self.where = [self.where[j] for j in keep]
        self.keys = [self.keys[j] for j in keep]
        self.sizes = [self.sizes[j] for j in keep]
        self.sums = [self.sums[j] for j in keep]
