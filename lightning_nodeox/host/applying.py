"""A sync applied piece by piece as it arrives: θ_{r+1} = θ_r + dequantized sync, into ``base`` and a target (the
live model, or ``base`` alone while training overlaps), each piece's rows digested while they are in cache where
the chunks allow. Raw tensors take the sync's values, in base and the target alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..core.codec import apply_sync
from ..core.hashing import RowHasher
from ..core.pool import WorkerPool
from ..core.specs import TensorSpec
from ..core.wire import Message
from .parts import Part
from .staging import Staging, as_bytes


@dataclass
class Applying:
    """A sync being applied piece by piece (:meth:`HostTensors.apply_begin`)."""

    sync: Message
    part: Part
    target: list[torch.Tensor]
    fresh: list[RowHasher]  # the row hashers of the part's tensors of base, fed as they are applied
    applied: int = 0  # pieces applied

    def unfused(self, chunk: int) -> set[int]:
        """The positions whose rows the apply could not digest: raw tensors, and chunks a hasher cannot take."""
        raw = set(self.part.raw)
        return {j for j, h in enumerate(self.fresh) if j in raw or not h.fusable(chunk)}


class PieceApply:
    """Applies a sync's pieces to ``base`` (and a target) on the codec's device, through the sync's staging."""

    def __init__(self, specs: Sequence[TensorSpec], base: list[torch.Tensor], pool: WorkerPool,
                 staging: Staging) -> None:
        self.specs = specs
        self.base = base
        self.pool = pool
        self.staging = staging

    def piece(self, applying: Applying, k: int) -> None:
        """Apply piece ``k`` of the sync (in place in its buffer, checked)."""
        sync, part, target, fresh = applying.sync, applying.part, applying.target, applying.fresh
        piece = sync.layout.pieces[k]
        staging = self.staging
        staging.stage_sync(sync, piece)
        chunk = self.pool.chunk

        def work(kn, j: int, start: int, stop: int) -> None:
            i = part.indices[j]
            fused = fresh[j] if fresh[j].fusable(chunk) else None
            apply_sync(kn, *staging.region(sync, j, staging.sync), self.base[i].view(-1), target[i].view(-1),
                       start=start, stop=stop, hasher=fused)

        tensors = range(piece.first, piece.stop)
        with torch.no_grad():
            self.pool.over(tensors, part.coded.__getitem__, work)
            for j in part.raw:  # raw tensors: the sync's values, for base and the target alike
                if piece.first <= j < piece.stop:
                    i = part.indices[j]
                    values = staging.region(sync, j, staging.sync)[0][: self.specs[i].nbytes]
                    as_bytes(self.base[i]).copy_(values)
                    if target is not self.base:
                        as_bytes(target[i]).copy_(values)
        applying.applied = k + 1
