"""The figures benchmarks/sites.py reports: per-round far bytes and times, spreads and goals (no runs)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # as `python benchmarks/x.py` has it
import site_figures as sf


def rec(round_, host, phase, end):
    return {"round": round_, "host": host, "phase": phase, "start": end - 0.5, "end": end}


def test_sent_between_takes_the_last_sample_at_or_before_each_end():
    timeline = [(1.0, 100), (2.0, 250), (3.0, 700), (4.0, 710)]
    assert sf.sent_between(timeline, 1.0, 3.0) == 600
    assert sf.sent_between(timeline, 1.5, 3.5) == 600
    assert sf.sent_between(timeline, 0.0, 1.0) == 100  # nothing before the first sample
    assert sf.sent_between(timeline, 4.0, 9.0) == 0


def test_rounds_use_the_last_synthetic_host_and_leave_round_zero_out():
    records = [
        rec(0, "0", "verify", 10.0), rec(0, "site1/4", "verify", 11.0),
        rec(1, "0", "upload", 13.0), rec(1, "site1/4", "upload", 14.0),
        rec(1, "site1", "upload", 16.0),  # the relay's own upload: not a host's
        rec(1, "0", "apply", 17.5), rec(1, "site1/4", "apply", 18.0),
        rec(1, "0", "verify", 18.2), rec(1, "site1/4", "verify", 18.5),
        rec(1, "site1/coordinator", "verify", 30.0),  # forwarded, not a host
        rec(2, "0", "upload", 20.0),  # round 2 never finished: left out
    ]
    last = sf.nodeox_times(records)
    assert last[(1, "sent")] == 14.0 and last[(1, "done")] == 18.5
    windows = []

    def far(start, end):
        windows.append((start, end))
        return 1234

    assert sf.per_round(last, far) == [{"round": 1, "far_bytes": 1234, "delta_to_sync_s": 4.0, "round_s": 7.5}]
    assert windows == [(11.0, 18.5)]


def test_figures_are_medians_of_run_medians_with_their_range():
    runs = [sf.run_figures([{"far_bytes": b, "delta_to_sync_s": d, "round_s": r} for b, d, r in rounds])
            for rounds in ([(10, 1.0, 2.0), (30, 3.0, 4.0), (20, 2.0, 3.0)], [(40, 4.0, 5.0)])]
    assert runs == [{"far_bytes": 20, "delta_to_sync_s": 2.0, "round_s": 3.0},
                    {"far_bytes": 40, "delta_to_sync_s": 4.0, "round_s": 5.0}]
    fig = sf.placement_figures(runs)
    assert fig["far_bytes"] == {"median": 30, "min": 20, "max": 40, "runs": 2}
    assert fig["round_s"] == {"median": 4.0, "min": 3.0, "max": 5.0, "runs": 2}


def test_goals_met_or_not():
    def fig(far_bytes, round_s):
        return {"far_bytes": sf.spread([far_bytes]), "round_s": sf.spread([round_s])}

    goals = sf.goals({"flat": fig(400, 10.0), "relays": fig(101, 5.0), "torchft": fig(800, 4.0)})
    assert [(round(g["measured"], 3), g["met"]) for g in goals] == [
        (3.96, False),  # 400 / 101 < 4
        (2.0, True),  # 10 / 5 >= 2
        (0.8, False),  # torchft's round 4 s against relays' 5 s
        (7.921, True),  # torchft's 800 far bytes against relays' 101
    ]
    assert sf.goals({"flat": fig(400, 10.0)}) == []  # nothing to compare: no goal claimed


def test_root_payload_counts_the_root_s_own_links_only():
    records = [
        {"round": 1, "host": "site0", "phase": "upload", "bytes": 100},  # a relay's delta to the root
        {"round": 1, "host": "site0", "phase": "download", "bytes": 80},
        {"round": 1, "host": "3", "phase": "upload", "bytes": 7},  # a flat host beside the relays
        {"round": 1, "host": "site0/0", "phase": "upload", "bytes": 1000},  # inside the site: not a far link
        {"round": 1, "host": "coordinator", "phase": "receive", "bytes": 107},
        {"round": 2, "host": "site1", "phase": "upload"},  # no bytes recorded
    ]
    assert sf.root_payload(records) == {1: 187, 2: 0}
