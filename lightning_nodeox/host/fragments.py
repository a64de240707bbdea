"""Streaming fragments (``NodeoxStrategy(fragments=F)``, after Streaming DiLoCo, arXiv 2501.18512): the tensors that
move are cut into F fragments of about equal bytes, and each round exchanges one of them.

A fragment is a run of consecutive tensors in ``state_dict`` order (a few layers). The cut makes exactly F of them
(fewer only when fewer than F tensors move), as even as whole tensors allow: the largest fragment is as small as it
can be (the total's F-th share, or the largest tensor when that is bigger), and with that largest the smallest is
as large as it can be (both by binary search), so small tensors merge into runs rather than standing alone beside
large ones. Round r exchanges fragment ``r mod F``, so with rounds every ``local_steps / F`` steps each fragment is
exchanged every ``local_steps`` steps, staggered; a round's delta is the fragment's ``live - base``: what it trained
since its own last sync, since its base is θ as of that sync. The other fragments train on meanwhile. Every host
cuts the same fragments (the same model, the same moving set) and is in the same round, so every host sends the
same fragment; the coordinator needs nothing of this: a round's set is whatever its deltas carried
(:mod:`lightning_nodeox.host.moving`).

The model hash every sync carries is θ's whole, and every host checks it on its ``base``, which equals θ in every
tensor (the fragment just synced, and the others as of their last syncs); the live model differs from it only
by the other fragments' progress since.

The final round (training ended) carries every tensor that moves, so the run ends on one model, as without
fragments; it is the one exchange of the whole model's bytes.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from itertools import accumulate

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
        """The fragments of the tensors ``moving`` (ascending indices): ``count`` non-empty runs of consecutive
        tensors (fewer only when fewer tensors move), in order, the largest as small as whole tensors allow and
        each of about an equal share of the bytes left."""
        return self._cuts.get(moving, lambda: self._cut(moving))

    def _cut(self, moving: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
        sizes = [self.sizes[i] for i in moving]
        count = min(self.count, len(sizes))
        if count <= 1:
            return (moving,) if moving else ()
        cap = _smallest_cap(sizes, count)
        low, high = 0, cap  # the largest smallest-fragment bytes with that cap (0 always splits)
        while low < high:
            middle = (low + high + 1) // 2
            low, high = (middle, high) if _split(sizes, count, middle, cap) else (low, middle - 1)
        bounds = [0, *_split(sizes, count, low, cap), len(sizes)]
        return tuple(moving[a:b] for a, b in zip(bounds, bounds[1:]))

    def of_round(self, moving: tuple[int, ...], round_: int) -> tuple[int, ...]:
        """The tensors round ``round_`` exchanges: fragment ``round_ mod F`` of ``moving``."""
        if self.count == 1 or not moving:
            return moving
        fragments = self.cut(moving)
        return fragments[round_ % len(fragments)]


def _parts(sizes: Sequence[int], cap: int) -> int:
    """How many runs of at most ``cap`` bytes greedy filling makes of ``sizes`` (the fewest there can be)."""
    parts, filled = 1, 0
    for size in sizes:
        if filled and filled + size > cap:
            parts, filled = parts + 1, 0
        filled += size
    return parts


def _smallest_cap(sizes: Sequence[int], count: int) -> int:
    """The smallest largest-fragment bytes with which ``sizes`` make at most ``count`` runs (binary search)."""
    low, high = max(max(sizes), -(-sum(sizes) // count)), sum(sizes)
    while low < high:
        middle = (low + high) // 2
        low, high = (low, middle) if _parts(sizes, middle) <= count else (middle + 1, high)
    return low


def _split(sizes: Sequence[int], count: int, low: int, cap: int) -> list[int] | None:
    """Where ``count`` runs of consecutive ``sizes``, each of ``low`` to ``cap`` bytes, end (the last end left out),
    or None when there are none: which prefixes ``j`` runs can make, run by run, each run's start taken from a
    window of starts that slides along the prefix sums."""
    prefix = [0, *accumulate(sizes)]
    n = len(sizes)
    reached = [True] + [False] * n  # prefixes that j runs make, j = 0 so far
    starts: list[list[int]] = []
    for _ in range(count):
        start, window, made = [-1] * (n + 1), deque(), [False] * (n + 1)
        nxt = 0
        for i in range(1, n + 1):
            while nxt < i and prefix[nxt] <= prefix[i] - low:
                if reached[nxt]:
                    window.append(nxt)
                nxt += 1
            while window and prefix[window[0]] < prefix[i] - cap:
                window.popleft()
            if window:
                made[i], start[i] = True, window[0]
        reached = made
        starts.append(start)
    if not reached[n]:
        return None
    ends, i = [], n
    for start in reversed(starts[1:]):
        i = start[i]
        ends.append(i)
    return ends[::-1]
