"""The close rule of ``--merge async`` (coordinator/quorum.py) on a round described by hand: the quorum, the host
due within the grace window (waited for), the host not due (slower, stalled or behind: not waited for), the
window's end, and the rounds that wait for every host as ``sync`` does."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from lightning_nodeox.coordinator.merging import MergeSettings
from lightning_nodeox.coordinator.quorum import EveryHost, Quorum


@dataclass
class Round:
    """An open round as the rule sees it (coordinator/open_round.OpenRound)."""

    round: int = 5
    sent: dict[str, float] = field(default_factory=dict)  # host -> when its delta began
    hosts: tuple[str, ...] = ("a", "b", "c", "d")
    opened: float = 100.0
    final: bool = False
    timeout: float | None = None
    awaited: int = 0

    def count(self) -> int:
        return len(self.sent)

    def starts(self) -> dict[str, float]:
        return dict(self.sent)

    def in_run(self) -> int:
        return len(self.hosts)

    def needed(self) -> int:
        return 1

    def missing(self) -> list[str]:
        return [h for h in self.hosts if h not in self.sent]

    def joins_awaited(self) -> int:
        return self.awaited


def rule(grace: float | None = 2.0) -> Quorum:
    """A quorum of 3 whose hosts delivered every 10 s, the last time at 100 s into round 4: d is due at 110 s."""
    q = Quorum(MergeSettings("async", min_quorum=3, grace=grace))
    for r, t in ((3, 90.0), (4, 100.0)):
        q.published(r, {h: t for h in "abcd"}, {})
    return q


def test_below_the_quorum_the_round_waits() -> None:
    assert not rule().ready(Round(sent={"a": 109.0, "b": 109.5}), now=120.0)


def test_a_host_due_within_the_window_is_waited_for_until_it_is_overdue_or_the_window_ends() -> None:
    q, r = rule(grace=5.0), Round(sent={"a": 109.0, "b": 109.2, "c": 109.5})  # quorum at 109.5, window to 114.5
    assert not q.ready(r, now=109.6)
    assert q.recheck_at(r, now=109.6) == pytest.approx(111.0)  # d expected at 110, overdue a tenth period later
    assert q.ready(r, now=111.0)
    assert rule(grace=1.0).ready(r, now=110.6)  # a window shorter than d's overdue time: its end closes the round
    stalled_once = rule(grace=5.0)
    stalled_once.published(5, {"a": 110.0, "b": 110.0, "c": 110.0, "d": 140.0}, {})  # d stalled once for 30 s
    stalled_once.published(6, {"a": 140.0, "b": 140.0, "c": 140.0, "d": 150.0}, {})
    assert stalled_once.hosts["d"].period == 10.0  # the median: one stall does not move it


def test_a_host_not_due_is_not_waited_for() -> None:
    sent = {"a": 109.0, "b": 109.2, "c": 109.5}
    slow = rule()
    slow.published(5, {"a": 110.0, "b": 110.0, "c": 110.0}, {})  # d's last delta is of round 4: it trains from round 5
    assert slow.ready(Round(round=6, sent=sent), now=109.6)  # d is behind (its next delta is late anyway)
    stalled = rule()
    assert stalled.ready(Round(sent=sent), now=111.5)  # d was due at 110: overdue since 111
    fresh = Quorum(MergeSettings("async", min_quorum=3, grace=5.0))
    assert fresh.ready(Round(sent=sent), now=109.6)  # nothing known of d


def test_the_default_grace_is_half_the_median_period() -> None:
    assert rule(grace=None).grace() == pytest.approx(5.0)
    assert Quorum(MergeSettings("async", min_quorum=3)).grace() == 0.0


def test_round_0_and_a_final_round_wait_for_every_host() -> None:
    sent = {"a": 109.0, "b": 109.2, "c": 109.5}
    assert not rule(grace=0.0).ready(Round(sent=sent, final=True), now=200.0)
    assert not rule(grace=0.0).ready(Round(sent=sent, awaited=1), now=200.0)
    assert rule(grace=0.0).ready(Round(sent={**sent, "d": 150.0}, final=True), now=200.0)
    assert not EveryHost().ready(Round(sent=sent), now=200.0)
    assert EveryHost().ready(Round(sent=sent, timeout=50.0), now=200.0)


@pytest.mark.parametrize("settings, says", [
    ({"mode": "async"}, "--merge async needs --min-quorum K"),
    ({"mode": "async", "min_quorum": 0}, "--min-quorum must be at least 1"),
    ({"mode": "async", "min_quorum": 2, "grace": -1.0}, "--grace must be seconds"),
    ({"mode": "async", "min_quorum": 2, "max_staleness": 0}, "--max-staleness must be at least 1 round"),
    ({"mode": "later"}, "--merge 'later' is not known"),
    ({"staleness_rule": "newest"}, "--staleness-rule 'newest' is not known"),
])
def test_bad_merge_settings_are_refused_naming_the_fix(settings: dict, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        MergeSettings(**settings)


def test_the_command_line_refuses_async_flags_without_async_and_a_quorum_above_the_hosts(tmp_path) -> None:
    import subprocess
    import sys

    def said(*flags: str) -> str:
        done = subprocess.run([sys.executable, "-m", "lightning_nodeox", "coordinator", "--hosts", "2", "--run-dir",
                               str(tmp_path), *flags], capture_output=True, text=True, timeout=60)
        assert done.returncode != 0 and "Traceback" not in done.stderr
        return done.stderr.strip()

    assert said("--min-quorum", "1") == "nodeox: --min-quorum goes with --merge async; add --merge async (or drop it)"
    assert said("--merge", "async", "--min-quorum", "3") == "nodeox: --min-quorum must be at most --hosts (2), got 3"
