"""Which of a host's exchanged tensors move in a round: frozen parameters stay out of its deltas.

At each round boundary a host's *moving set* is its buffers (floating and raw: BatchNorm statistics, counters) and
the parameters that require grad now or did at the previous boundary, so a parameter frozen during a round still
sends that round's change once. A parameter that does not move is never sent: it stays equal to the round's base on
every host while nothing but its optimizer writes it (checked by the model hash at join, of a fetched model and once
the run completes). A frozen parameter that code writes anyway (an EMA teacher updated under ``no_grad``) is found
at the first boundary, or at one where the set changed, by comparing the frozen parameters with the base once: it
moves from then on, with a warning naming it. One written only later is named when the run ends. When the set changes
(``BackboneFinetuning`` unfreezing the backbone at an epoch), the exchange follows at the next boundary. The
coordinator decides each round's set: the union of the sets its deltas carried; every host applies that round's
sync, so hosts stay bit-identical whatever they sent, and a host whose own set differs is told (:class:`SetNotice`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

log = logging.getLogger(__name__)


class MovingSet:
    """Tracks ``requires_grad`` of a host's exchanged tensors (None: a buffer, which always moves), and the frozen
    parameters found written anyway (an EMA teacher), which move from then on."""

    def __init__(self, parameters: Sequence[torch.nn.Parameter | None]) -> None:
        self.parameters = list(parameters)
        self._was = self._flags()
        self._watched: tuple[bool, ...] | None = None  # the flags when frozen parameters were last checked
        self.written: set[int] = set()

    def _flags(self) -> tuple[bool, ...]:
        return tuple(p is None or p.requires_grad for p in self.parameters)

    def to_watch(self) -> list[int]:
        """The frozen parameters to compare with the round's base now: all of them at the first boundary and at a
        boundary where the flags changed; none at the others (a fixed set costs nothing per round)."""
        now = self._flags()
        if now == self._watched:
            return []
        self._watched = now
        return [i for i, moves in enumerate(now) if not moves and i not in self.written]

    def at_boundary(self) -> tuple[int, ...]:
        """The indices that move in the round closing now (ascending): a buffer, a parameter that requires
        grad now or did at the previous boundary, or a frozen one found written."""
        now = self._flags()
        moving = tuple(i for i, (a, b) in enumerate(zip(now, self._was)) if a or b or i in self.written)
        self._was = now
        return moving


class SetNotice:
    """Tells, once per change, when the set of tensors a round exchanged is not the one this host sent."""

    def __init__(self, host_names: Sequence[str]) -> None:
        self.names = host_names
        self._told: tuple[tuple[int, ...], tuple[int, ...]] | None = None

    def compare(self, own: tuple[int, ...], round_set: tuple[int, ...], round_: int,
                moves: tuple[int, ...] | None = None) -> None:
        """``own``: the tensors this host sent; ``moves``: those that move on it (default: ``own``; with fragments,
        a round that takes more of them, as the final round does, is as it should be)."""
        if own == round_set:
            self._told = None
            return
        mine, theirs = set(own), set(round_set)
        extra = tuple(sorted(theirs - mine - set(moves or ())))
        missing = tuple(sorted(mine - theirs))
        if not extra and not missing or (extra, missing) == self._told:
            return
        self._told = (extra, missing)
        parts = []
        if extra:
            parts.append(f"{len(extra)} tensor(s) another host trained and this host did not send (e.g. "
                         f"{self.names[extra[0]]!r})")
        if missing:
            parts.append(f"{len(missing)} tensor(s) this host sent that the round did not take (e.g. "
                         f"{self.names[missing[0]]!r})")
        log.warning("nodeox: round %d exchanged another set of tensors than this host sent: %s. Every host applies "
                    "the round's set and stays equal; freeze and unfreeze alike on every host (BackboneFinetuning "
                    "by epoch does) so that they train the same tensors", round_, "; ".join(parts))
