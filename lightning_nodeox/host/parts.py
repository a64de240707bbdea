"""Which of a host's tensors travel: the delta's set at each round boundary (the tensors that move,
:mod:`~lightning_nodeox.host.moving`, or the round's fragment of them, :mod:`~lightning_nodeox.host.fragments`),
and the set each sync names, both as a :class:`Part` with its message layout.

Each set has its own message layout, cached (and a delta's its reused message), so a fixed set allocates nothing
per round, and a set that changes back finds its own.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from ..core.recent import Recent
from ..core.codecs.settings import CodecSettings
from ..core.specs import TensorSpec, positions_in
from ..core.wire import Message, MessageLayout
from .fragments import Fragments
from .moving import MovingSet, SetNotice

log = logging.getLogger(__name__)

CACHED_SETS = 4  # message layouts kept, one per set of tensors (a set that changes back finds its own)


class Part:
    """Some of a host's tensors (indices, ascending), as one message carries them: the codec's values per
    position, the positions of raw tensors, and (a delta's set) the reused message."""

    def __init__(self, indices: tuple[int, ...], specs: Sequence[TensorSpec], layout: MessageLayout | None = None,
                 message: Message | None = None) -> None:
        self.indices = indices
        self.coded = [specs[i].coded for i in indices]
        self.raw = [j for j, i in enumerate(indices) if specs[i].raw]
        self.layout = layout
        self.message = message


class Parts:
    """The delta's :class:`Part` (:attr:`part`, set at each round boundary) and the parts syncs name, cached."""

    def __init__(self, names: list[str], specs: Sequence[TensorSpec],
                 parameters: Sequence[torch.nn.Parameter | None], fragments: int) -> None:
        """``parameters``: each tensor's parameter (its ``requires_grad`` says whether it moves) or None;
        ``fragments``: a round exchanges one of that many fragments of the tensors that move."""
        self.names = names
        self.specs = specs
        self.moving: MovingSet = MovingSet(parameters)
        self.fragments = Fragments(fragments, [s.nbytes for s in specs])
        self.moves: tuple[int, ...] = ()  # the tensors that move, as of the last boundary
        self.notice = SetNotice(names)
        self._index = {n: i for i, n in enumerate(names)}
        self.settings: CodecSettings | None = None
        self._pin_memory = False
        self.part: Part | None = None  # the tensors this host's delta carries
        self._cached = CACHED_SETS + fragments  # each fragment's set, and the final round's whole one
        self._parts: Recent[tuple[int, ...], Part] = Recent(self._cached)  # by this host's indices
        self._sync_parts: Recent[tuple, Part] = Recent(self._cached)  # by the specs a sync names

    def allocate(self, settings: CodecSettings, *, pin_memory: bool) -> None:
        """The run's codec: the delta's layouts are made for it from now on (``pin_memory``: its messages pinned,
        on a GPU)."""
        self.settings = settings
        self._pin_memory = pin_memory
        self._parts = Recent(self._cached)

    def boundary(self, round_: int | None) -> Part:
        """The tensors that move in the round closing now become the delta's: all of them or (with fragments,
        unless ``round_`` is None) round ``round_``'s fragment of them."""
        self.moves = self.moving.at_boundary()
        return self.take_part(round_)

    def take_part(self, round_: int | None) -> Part:
        """The delta's tensors become round ``round_``'s fragment of those that moved at the last boundary (None:
        all of them), e.g. for an empty delta sent into another round than the boundary's."""
        indices = self.moves if round_ is None else self.fragments.of_round(self.moves, round_)
        self.part = self._parts.get(indices, lambda: self._delta_part(indices))
        return self.part

    @property
    def fragment_count(self) -> int:
        """The fragments the tensors that move make (1 without fragments)."""
        return len(self.fragments.cut(self.moves)) if self.fragments.count > 1 and self.moves else 1

    def _delta_part(self, indices: tuple[int, ...]) -> Part:
        layout = MessageLayout.of(tuple(self.specs[i] for i in indices), self.settings)
        if self.fragments.count == 1 and (self.part is not None or len(indices) < len(self.specs)):
            log.info("nodeox: this host's delta now carries %d of the model's %d tensors (%.3g MB a round)%s",
                     len(indices), len(self.specs), layout.total / 1e6,
                     "" if len(indices) == len(self.specs) else ": frozen parameters do not travel")
        return Part(indices, self.specs, layout, Message.allocate(layout, pin_memory=self._pin_memory))

    def sync_part(self, sync: Message) -> Part:
        """The tensors a sync carries, as this host's indices; a PayloadError when they are not this model's."""
        specs = sync.meta.tensors
        return self._sync_parts.get(specs, lambda: Part(positions_in(self.specs, specs, "sync", self._index),
                                                        self.specs))

    def compare(self, synced: Part, round_: int) -> None:
        """Tell (once per change) when round ``round_``'s sync carries another set than this host's delta."""
        self.notice.compare(self.part.indices, synced.indices, round_, moves=self.moves)

    def watch_frozen(self, live: list[torch.Tensor], base: list[torch.Tensor]) -> None:
        """At the first boundary and where the set changed: frozen parameters that code wrote since the base (an
        EMA teacher) move from now on, as they did before frozen parameters stayed home."""
        written = [i for i in self.moving.to_watch() if not torch.equal(live[i], base[i])]
        if written:
            self.moving.written.update(written)
            log.warning("nodeox: %d frozen parameter(s) (requires_grad=False) changed during the round, e.g. %r (an "
                        "EMA teacher?): they are exchanged every round from now on, averaged like the rest. To say "
                        "so up front, keep such weights as buffers (register_buffer)", len(written),
                        self.names[written[0]])

    def frozen_changed(self, live: list[torch.Tensor], base: list[torch.Tensor]) -> list[str]:
        """The frozen parameters whose live value is not ``base``'s (θ of the last round): code wrote them, and no
        round sent it."""
        return [self.names[i] for i, p in enumerate(self.moving.parameters)
                if p is not None and not p.requires_grad and i not in self.moving.written
                and not torch.equal(live[i], base[i])]

    def log_fragments(self) -> None:
        """Say how the tensors that move are cut into fragments (at join), and when there are fewer than asked."""
        if self.fragments.count == 1:
            return
        cut = self.fragments.cut(self.moves)
        log.info("nodeox: %d fragments of %s MB, one exchanged a round (the final round exchanges them all)",
                 len(cut), "/".join(f"{sum(self.specs[i].nbytes for i in f) / 1e6:.3g}" for f in cut))
        if len(cut) < self.fragments.count:
            log.warning("nodeox: fragments=%d asked, but only %d tensors move, one a fragment: each fragment is "
                        "exchanged every %d rounds, more often than local_steps asks; lower fragments to %d to keep "
                        "local_steps", self.fragments.count, len(cut), len(cut), len(cut))
