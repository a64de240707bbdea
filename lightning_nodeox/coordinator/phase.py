"""The round's phase: one state with its transitions in one place.

- ``OPEN``: deltas come in; θ does not change, so a full-model download may start.
- ``CLOSING``: the round's close changes θ: no download starts (those in flight keep what they have not sent).
- ``UPSTREAM``: a site relay's close waits for its upstream's round (it may take a WAN round); θ does not change
  meanwhile, so downloads may start, until the upstream's sync is about to change it (back to ``CLOSING``).
- ``HELD``: θ changes outside a close (a relay taking its upstream's model): no download starts.
- ``STOPPED``: the coordinator stops: no round starts closing. Asked while a round closes, it takes effect once that
  round has published.
"""

from __future__ import annotations

from enum import Enum


class Phase(Enum):
    OPEN = "open"
    CLOSING = "closing"
    UPSTREAM = "closing upstream"
    HELD = "held"
    STOPPED = "stopped"


class PhaseError(RuntimeError):
    """A transition the round's phase does not have (a bug)."""


class RoundPhase:
    """The phase of the open round (:class:`Phase`), changed only by the transitions below."""

    def __init__(self) -> None:
        self.phase = Phase.OPEN
        self._stop_asked = False  # asked while closing: STOPPED once the close ends

    def __repr__(self) -> str:
        return f"RoundPhase({self.phase.value})"

    @property
    def closing(self) -> bool:
        return self.phase in (Phase.CLOSING, Phase.UPSTREAM)

    @property
    def stable(self) -> bool:
        """No close or adoption changes θ now: a full-model download may start."""
        return self.phase in (Phase.OPEN, Phase.UPSTREAM, Phase.STOPPED)

    @property
    def may_close(self) -> bool:
        return self.phase in (Phase.OPEN, Phase.HELD)

    def begin_close(self) -> None:
        self._move({Phase.OPEN, Phase.HELD}, Phase.CLOSING)

    def steady(self) -> None:
        """The close waits upstream; θ stays as it is until :meth:`hold`."""
        self._move({Phase.CLOSING}, Phase.UPSTREAM)

    def hold(self) -> bool:
        """θ is about to change outside the close's own step; returns whether it was stable until now."""
        if self.phase is Phase.UPSTREAM:
            self.phase = Phase.CLOSING
            return True
        if self.phase is Phase.OPEN:
            self.phase = Phase.HELD
            return True
        return False

    def release(self) -> None:
        """θ changed outside a close (:meth:`hold` while open) and is stable again."""
        if self.phase is Phase.HELD:
            self.phase = Phase.OPEN

    def end_close(self) -> None:
        """The close has published (or failed: it is tried again)."""
        self._move({Phase.CLOSING, Phase.UPSTREAM}, Phase.STOPPED if self._stop_asked else Phase.OPEN)

    def stop(self) -> None:
        """No round starts closing from now on."""
        if self.closing:
            self._stop_asked = True
        else:
            self.phase = Phase.STOPPED

    def _move(self, sources: set[Phase], target: Phase) -> None:
        if self.phase not in sources:
            raise PhaseError(f"the round cannot go from {self.phase.value} to {target.value}")
        self.phase = target
