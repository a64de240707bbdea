"""The row digests of a host's ``base`` (θ_r), from which its model hash is combined.

A sync's apply digests the rows of the tensors it changes while they are in cache (:meth:`BaseDigests.fresh`);
the others' digests are kept from the round that last changed them (they are ``base``'s, which nothing else
writes), so the model hash of a sync's result digests only what the sync changed. A fetched model forgets them all.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ..core.hashing import RowHasher, combine
from ..core.pool import WorkerPool


class BaseDigests:
    """Each tensor of ``base``'s row digests (None: not known), and those an apply left to finish."""

    def __init__(self, names: list[str], base: list[torch.Tensor], pool: WorkerPool) -> None:
        self.names = names
        self.base = base
        self.pool = pool
        self._kept: list[RowHasher | None] = [None] * len(base)
        self._undigested: list[RowHasher] = []

    def forget(self, indices: Iterable[int]) -> None:
        """Tensors ``indices`` of base are about to change: until :meth:`digest`, an apply cut short leaves no
        stale digest behind."""
        for i in indices:
            self._kept[i] = None

    def forget_all(self) -> None:
        """Base holds another model (a fetched one)."""
        self._kept = [None] * len(self.base)

    def base_hash(self) -> str:
        """The hash of ``base``, digesting only the tensors whose digests are not kept."""
        missing = [i for i, d in enumerate(self._kept) if d is None]
        for i in missing:
            self._kept[i] = RowHasher(self.base[i])
        self.pool.run([t for i in missing for t in self._kept[i].tasks()])
        return combine(list(zip(self.names, self.base)), self._kept)

    def fresh(self, indices: Iterable[int]) -> list[RowHasher]:
        """Hashers for tensors ``indices`` of base, fed as a sync is applied to them (base: the target's bytes
        once applied, and kept)."""
        return [RowHasher(self.base[i]) for i in indices]

    def after_apply(self, indices: tuple[int, ...], fresh: list[RowHasher], unfused: set[int]) -> list[RowHasher]:
        """The row hashers of θ_{r+1}: ``fresh`` for the tensors the sync changed (``indices``; those at positions
        ``unfused`` the apply could not digest, :meth:`digest` does), the kept ones of the others."""
        self._undigested = [h for j, h in enumerate(fresh) if j in unfused]
        hashers = list(self._kept)
        for i, h in zip(indices, fresh):
            hashers[i] = h
        for i, d in enumerate(hashers):
            if d is None:
                hashers[i] = d = RowHasher(self.base[i])
                self._undigested.append(d)
        return hashers

    def digest(self, hashers: list[RowHasher]) -> str:
        """The model hash from :meth:`after_apply`'s hashers (digesting the rows the apply could not); they are
        kept as base's digests."""
        pending, self._undigested = self._undigested, []
        self.pool.run([t for h in pending for t in h.tasks()])
        self._kept = list(hashers)
        return combine(list(zip(self.names, self.base)), hashers)
