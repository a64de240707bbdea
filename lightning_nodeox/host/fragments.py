"""Streaming fragments (``NodeoxStrategy(fragments=F)``, after Streaming DiLoCo, arXiv 2501.18512): the tensors that
move are cut into F fragments of about equal bytes, and each round exchanges one of them.

A fragment is a run of consecutive tensors in ``state_dict`` order (a few layers), cut where the running byte
count passes k/F of the total (a tensor goes to the fragment its middle falls in). Round r exchanges fragment
``r mod F``, so with rounds every ``local_steps / F`` steps each fragment is exchanged every ``local_steps`` steps,
staggered; a round's delta is the fragment's ``live - base``: what it trained since its own last sync, since its
base is θ as of that sync. The other fragments train on meanwhile. Every host cuts the same fragments (the same
model, the same moving set) and is in the same round, so every host sends the same fragment; the coordinator needs
nothing of this: a round's set is whatever its deltas carried (:mod:`lightning_nodeox.host.moving`).

The model hash every sync carries is θ's whole, and every host checks it on its ``base``, which equals θ in every
tensor (the fragment just synced, and the others as of their last syncs); the live model differs from it only
by the other fragments' progress since.

The final round (training ended) carries every tensor that moves, so the run ends on one model, as without
fragments; it is the one exchange of the whole model's bytes.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..core.recent import Recent


class Fragments:
    """The fragments of a model's tensors (``sizes``: each tensor's bytes) cut into ``count``, per moving set."""

    def __init__(self, count: int, sizes: Sequence[int]) -> None:
        if count < 1:
            raise ValueError(f"fragments must be at least 1, got {count}")
        self.count = count
        self.sizes = list(sizes)
        self._cuts: Recent[tuple[int, ...], tuple[tuple[int, ...], ...]] = Recent(4)

    def cut(self, moving: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
        """The fragments of the tensors ``moving`` (ascending indices): at most ``count`` non-empty runs of
        consecutive tensors of about equal bytes, in order (fewer when there are fewer tensors than fragments, or
        one tensor holds more than a fragment's share)."""
        return self._cuts.get(moving, lambda: self._cut(moving))

    def _cut(self, moving: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
        total = sum(self.sizes[i] for i in moving) or 1
        groups: list[list[int]] = [[] for _ in range(self.count)]
        done = 0
        for i in moving:
            size = self.sizes[i]
            middle = done + size / 2
            groups[min(self.count - 1, int(middle * self.count / total))].append(i)
            done += size
        return tuple(tuple(g) for g in groups if g)

    def of_round(self, moving: tuple[int, ...], round_: int) -> tuple[int, ...]:
        """The tensors round ``round_`` exchanges: fragment ``round_ mod F`` of ``moving``."""
        if self.count == 1 or not moving:
            return moving
        fragments = self.cut(moving)
        return fragments[round_ % len(fragments)]
