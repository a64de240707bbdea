"""Overlap's tensors: the snapshot a round sends while training goes on, and the fold of its sync into the live
model (the rounds themselves are :mod:`~lightning_nodeox.host.overlap`'s).

At the boundary the tensors the round sends are copied aside (with fragments, one fragment: the snapshot holds
those alone). The sync goes into ``base``; a tensor it changed that this host did not send has its θ_r set aside
too. The fold then makes the live model θ_{r+1} plus the progress made since the snapshot
(``live += base - snapshot``); a fetched model in ``base`` is folded in whole.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch


class Snapshot:
    """The snapshot of the round in flight (``tensors``: per tensor, None where not kept; None before the first)
    and its fold."""

    def __init__(self, live: list[torch.Tensor], base: list[torch.Tensor], raw: Iterable[int]) -> None:
        """``raw``: the integer and boolean tensors, which the fold gives θ_{r+1}'s values."""
        self.live = live
        self.base = base
        self.raw = set(raw)
        self.tensors: list[torch.Tensor | None] | None = None
        self._snapped: set[int] = set()  # the snapshot's tensors of the round in flight
        self._fold_all = False  # base was replaced by a fetched model since the snapshot

    def take(self, sent: Sequence[int], *, restart_from_base: bool) -> None:
        """Copy the tensors ``sent`` aside (the others' copies are dropped); ``restart_from_base`` (delayed
        overlap): the live model's then go back to θ_r."""
        if self.tensors is None:
            self.tensors = [None] * len(self.live)
        keep = set(sent)
        for i, kept in enumerate(self.tensors):
            if kept is not None and i not in keep:
                self.tensors[i] = None
        self._snapped, self._fold_all = keep, False
        with torch.no_grad():
            for i in sent:
                self._snap(i, self.live[i])
                if restart_from_base:
                    self.live[i].copy_(self.base[i])

    def _snap(self, i: int, source: torch.Tensor) -> None:
        if self.tensors[i] is None:
            self.tensors[i] = source.detach().clone()
        else:
            self.tensors[i].copy_(source)

    def to_base(self) -> None:
        """The snapshot becomes θ_r (delayed overlap, once the delta is encoded): the fold then adds the progress
        made since the live model went back to θ_r."""
        with torch.no_grad():
            for i in self._snapped:
                self.tensors[i].copy_(self.base[i])

    def set_aside(self, synced: Iterable[int]) -> None:
        """Before a sync into base: the θ_r of the tensors ``synced`` that this host did not send is set aside
        for the fold (unless a fetched model is folded in whole, or no snapshot was ever taken)."""
        if self._fold_all or self.tensors is None:
            return
        with torch.no_grad():
            for i in synced:
                if i not in self._snapped:
                    self._snap(i, self.base[i])
                    self._snapped.add(i)

    def fetched(self, *, into_live: bool) -> None:
        """A fetched model replaced base: folded in whole unless it went into the live model too."""
        self._fold_all = not into_live

    def folding(self) -> Sequence[int]:
        """The live tensors :meth:`fold` writes."""
        return range(len(self.live)) if self._fold_all else sorted(self._snapped)

    def fold(self) -> None:
        """The live model becomes θ_{r+1} plus the local progress made since the snapshot, on the training device,
        between two training steps, for the tensors set aside (the others did not move: they take θ_{r+1},
        which only a fetched model changes). A raw tensor takes θ_{r+1}'s values (what it counted since the
        snapshot is dropped)."""
        with torch.no_grad():
            for i in self.folding():
                t, b = self.live[i], self.base[i]
                if i in self.raw or i not in self._snapped:
                    t.copy_(b)
                    continue
                s = self.tensors[i]
                s.sub_(b).neg_()  # the snapshot buffer is free now: reuse it for base - snapshot
                t.add_(s.to(t.dtype))
        self._snapped, self._fold_all = set(), False
