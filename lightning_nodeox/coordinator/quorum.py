"""When the open round may close, once every delta in it has begun (:meth:`Rounds.maybe_close` checks the rest):
the rule of ``--merge sync`` (:class:`EveryHost`, the default) or of ``--merge async`` (:class:`Quorum`).

``async``: a round closes once ``--min-quorum`` deltas with samples are in (lowered to the hosts still in the
run), unless a missing host is *due*: its last delta was merged into the previous round (so it trains from the
open round's model, and its delta would not be late), and its past arrivals say the next one comes within the
grace window. The round waits for such a host until its delta begins, until it is overdue (a tenth of its
period past when it was expected; its period: the median of its last intervals between two deltas), or until the
window ends, whichever comes first. A host not due (slower, or stalled) is not waited for at all: its delta is
merged, late, into the round open when it arrives. Round 0 (which waits for ``--hosts`` to join) and a round
holding a final delta (the run's last) wait for every live host, as under ``sync``.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from .merging import MergeSettings

if TYPE_CHECKING:
    from .open_round import OpenRound

OVERDUE = 0.1  # of a host's period: a due host this late is no longer waited for
PERIODS = 5  # a host's period is the median of its last this many intervals (one stall does not move it)


class CloseRule(Protocol):
    def ready(self, open_round: OpenRound, now: float) -> bool:
        """Whether the round may close now (every delta in it has begun)."""

    def recheck_at(self, open_round: OpenRound, now: float) -> float | None:
        """When :meth:`ready` may turn true with no delta arriving meanwhile (None: not by the clock alone)."""

    def published(self, round_: int, starts: dict[str, float], merged: dict) -> None:
        """Round ``round_`` published with the deltas begun at ``starts`` (host -> time); ``merged``: what its
        aggregate record says of how it merged (:meth:`OpenRound.merged`)."""

    def status(self) -> dict | None:
        """What ``GET /v1/status`` shows of the rule (None: nothing)."""

    def merged(self, open_round: OpenRound, missing: list[str]) -> dict:
        """What the round's aggregate record says of how it closed (``{}``: nothing beyond its hosts)."""


class EveryHost:
    """``--merge sync``: every live host's delta (or ``--round-timeout``), and at least ``--min-hosts``."""

    def ready(self, open_round: OpenRound, now: float) -> bool:
        if open_round.count() < open_round.needed():
            return False
        everyone = not open_round.joins_awaited() and not open_round.missing()
        timeout = open_round.timeout
        return everyone or (timeout is not None and now - open_round.opened >= timeout)

    def recheck_at(self, open_round: OpenRound, now: float) -> float | None:
        return None  # --round-timeout: the coordinator's periodic check closes it

    def published(self, round_: int, starts: dict[str, float], merged: dict) -> None:
        pass

    def status(self) -> dict | None:
        return None

    def merged(self, open_round: OpenRound, missing: list[str]) -> dict:
        return {}


@dataclass
class Arrivals:
    """When a host's deltas arrive: the last one's start, the times between two (the last ``PERIODS``), the round
    its next delta starts from."""

    last: float
    intervals: list[float] = field(default_factory=list)
    next_base: int = 0

    @property
    def period(self) -> float | None:
        """The time between two of its deltas: the median of the last intervals (None: none yet)."""
        return statistics.median(self.intervals) if self.intervals else None

    def arrived(self, start: float, round_: int) -> None:
        """Its delta of round ``round_ - 1``'s close began at ``start``."""
        self.intervals = [*self.intervals, start - self.last][-PERIODS:]
        self.last, self.next_base = start, round_

    def expected(self) -> float | None:
        period = self.period
        return None if period is None else self.last + period


class Quorum:
    """``--merge async``: a quorum, and the hosts due within the grace window (see the module's rules)."""

    def __init__(self, settings: MergeSettings) -> None:
        self.settings = settings
        self.every = EveryHost()
        self.hosts: dict[str, Arrivals] = {}
        self.last: dict = {}  # the last round's merge: its round, quorum, late hosts, stale deltas
        self.late_deltas = 0  # late deltas merged over the run (since this coordinator started)

    def grace(self) -> float:
        """The window's length: ``--grace``, or half the median period of the hosts (0 while none is known)."""
        if self.settings.grace is not None:
            return self.settings.grace
        periods = [a.period for a in self.hosts.values() if a.period is not None]
        return 0.5 * statistics.median(periods) if periods else 0.0

    def quorum(self, open_round: OpenRound) -> int:
        return max(1, min(self.settings.min_quorum or 1, open_round.in_run()))

    def quorum_at(self, open_round: OpenRound) -> float | None:
        """When the open round's quorum was reached (None: not yet)."""
        starts = sorted(open_round.starts().values())
        k = self.quorum(open_round)
        return starts[k - 1] if len(starts) >= k else None

    def due(self, open_round: OpenRound, now: float, until: float) -> dict[str, float]:
        """The missing hosts waited for (host -> when it is overdue): due by ``until``, not overdue by ``now``."""
        due = {}
        for host in open_round.missing():
            a = self.hosts.get(host)
            expected = a.expected() if a is not None else None
            if expected is None or a.next_base != open_round.round:
                continue
            overdue = expected + OVERDUE * a.period
            if expected <= until and now < overdue:
                due[host] = overdue
        return due

    def ready(self, open_round: OpenRound, now: float) -> bool:
        if open_round.final or open_round.joins_awaited():
            return self.every.ready(open_round, now)
        at = self.quorum_at(open_round)
        if at is None or not open_round.missing():  # (a quorum lowered to the hosts still in the run)
            return self.every.ready(open_round, now)
        end = at + self.grace()
        return now >= end or not self.due(open_round, now, end)

    def recheck_at(self, open_round: OpenRound, now: float) -> float | None:
        if open_round.final or open_round.joins_awaited():
            return None
        at = self.quorum_at(open_round)
        if at is None:
            return None
        end = at + self.grace()
        due = self.due(open_round, now, end)
        return min([end, *due.values()]) if due else None

    def merged(self, open_round: OpenRound, missing: list[str]) -> dict:
        return open_round.merged(self.quorum(open_round), missing)

    def status(self) -> dict:
        s = self.settings
        return {"mode": s.mode, "min_quorum": s.min_quorum, "grace_s": self.grace(), "max_staleness": s.max_staleness,
                "staleness_rule": s.staleness_rule, "late_deltas": self.late_deltas, "last": self.last}

    def published(self, round_: int, starts: dict[str, float], merged: dict) -> None:
        self.last = {"round": round_, **merged}
        self.late_deltas += len(merged.get("stale", {}))
        for host, start in starts.items():
            a = self.hosts.get(host)
            if a is None:
                self.hosts[host] = Arrivals(start, next_base=round_ + 1)
            else:
                a.arrived(start, round_ + 1)


def close_rule(settings: MergeSettings) -> CloseRule:
    """The rule of ``settings``' mode."""
    return Quorum(settings) if settings.is_async else EveryHost()
