"""The live tensors rank 0 wrote since its other ranks last took them (:mod:`~lightning_nodeox.host.ranks`).

A round's set as its sync applied it, the tensors an overlap fold or a delayed snapshot wrote, or every tensor:
at the start (the join's lead sends them all), after a fetched model and after the live model went back to θ_r.
Every tensor is a set like any other here: all the indices, written out.
"""

from __future__ import annotations

from collections.abc import Iterable


class ChangeLog:
    """The indices of the live tensors written since the last :meth:`take`; it starts with all of them."""

    def __init__(self, count: int) -> None:
        """``count``: the host's exchanged tensors."""
        self._every = range(count)
        self._written: set[int] = set(self._every)

    def wrote(self, indices: Iterable[int]) -> None:
        """Tensors ``indices`` of the live model were written."""
        self._written.update(indices)

    def wrote_all(self) -> None:
        """Every live tensor was written (a fetched model, the live model reset to θ_r)."""
        self._written = set(self._every)

    def take(self) -> tuple[int, ...]:
        """The tensors written since the last call (ascending); the record starts over. Only the training thread
        writes live tensors (an overlapped exchange writes ``base``), so this needs no lock."""
        written, self._written = self._written, set()
        return tuple(sorted(written))
