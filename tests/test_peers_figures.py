"""The figures benchmarks/peers.py reports: nodeox's phases and payload, rounds from per-process times, bytes
per host, and the goals against torchft (no runs)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # as `python benchmarks/x.py` has it
import peers
import peers_figures as pf
import site_figures as sf
from netns import Counters, Loopback


def rec(round_, host, phase, start, end, **extra):
    return {"round": round_, "host": host, "phase": phase, "start": start, "end": end, **extra}


def test_phases_are_the_slowest_host_s_median_over_rounds_without_round_zero():
    records = [
        rec(0, "0", "encode", 0.0, 9.0),  # round 0: left out
        rec(1, "0", "encode", 10.0, 10.5), rec(1, "1", "encode", 10.0, 10.8),
        rec(2, "0", "encode", 20.0, 20.2), rec(2, "1", "encode", 20.0, 20.1),
        rec(3, "0", "encode", 30.0, 30.4), rec(3, "1", "encode", 30.0, 30.3),
        rec(1, "0", "upload", 11.0, 11.5), rec(1, "0", "upload", 12.0, 12.25, empty=True),  # one host's two: summed
        rec(1, "1", "upload", 11.0, 11.6),
        rec(1, "coordinator", "aggregate", 12.0, 12.3), rec(2, "coordinator", "aggregate", 22.0, 22.5),
        rec(1, "coordinator", "sync_prepare", 12.3, 13.0),
        rec(1, "coordinator", "encode", 0.0, 99.0),  # not a coordinator phase
        rec(1, "0", "aggregate", 0.0, 99.0),  # not a host phase
        rec(1, "site0/0", "verify", 0.0, 99.0),  # forwarded by a relay: not one of this run's hosts
        rec(1, "0", "rss", 0.0, 99.0),
    ]
    phases = pf.slowest_phases(records)
    assert list(phases) == ["encode", "upload", "aggregate", "sync_prepare"]  # in the round's order
    assert phases["encode"] == pytest.approx(0.4)  # median of 0.8, 0.2, 0.4
    assert phases["upload"] == pytest.approx(0.75)  # host 0's 0.5 + 0.25 against host 1's 0.6
    assert phases["aggregate"] == pytest.approx(0.4)  # median of 0.3, 0.5
    assert phases["sync_prepare"] == pytest.approx(0.7)
    runs = [{"phases": {"encode": 0.4, "upload": 1.0}}, {"phases": {"encode": 0.6}}]
    assert pf.phase_figures(runs) == {"encode": {"median": 0.5, "min": 0.4, "max": 0.6, "runs": 2}}


def test_payload_is_the_largest_body_one_host_moved_one_way():
    records = [
        rec(1, "0", "upload", 0, 1, bytes=46_000_000), rec(1, "1", "upload", 0, 1, bytes=45_000_000),
        rec(1, "0", "download", 0, 1, bytes=46_100_000), rec(1, "1", "download", 0, 1, bytes=46_100_000),
        rec(1, "coordinator", "receive", 0, 1, bytes=91_000_000),  # not a host's link
        rec(2, "1", "upload", 0, 1),  # no bytes recorded
    ]
    assert pf.host_payload(records) == {1: 46_100_000, 2: 0}


def test_rounds_from_per_process_times_with_bytes_per_host_each_way():
    replica0 = [{"round": r, "sent": 10.0 * r, "applied": 10.0 * r + 3, "done": 10.0 * r + 3} for r in range(3)]
    replica1 = [{"round": r, "sent": 10.0 * r + 1, "applied": 10.0 * r + 4, "done": 10.0 * r + 4} for r in range(3)]
    last = sf.latest_times([replica0, replica1])
    assert last[(1, "sent")] == 11.0 and last[(1, "done")] == 14.0
    counters = Counters(Loopback(2))  # nothing sampled on loopback: timelines filled by hand
    assert counters.up == [[], []] and counters.down == [[], []] and peers.byte_windows(counters) == {}
    counters.counted = True  # as if sampled in namespaces
    counters.up = [[(4.0, 0), (14.0, 300)], [(4.0, 0), (14.0, 500)]]
    counters.down = [[(4.0, 0), (14.0, 100)], [(4.0, 0), (14.0, 100)]]
    rounds = sf.per_round(last, windows=peers.byte_windows(counters))
    assert rounds == [
        {"round": 1, "up_bytes": 400.0, "down_bytes": 100.0, "delta_to_sync_s": 3.0, "round_s": 10.0},
        {"round": 2, "up_bytes": 0.0, "down_bytes": 0.0, "delta_to_sync_s": 3.0, "round_s": 10.0},
    ]
    assert counters.both_ways(4.0, 14.0) == 1000
    assert sf.run_figures(rounds, pf.METRICS) == {"round_s": 10.0, "delta_to_sync_s": 3.0, "up_bytes": 200.0,
                                                   "down_bytes": 50.0}  # no payload_bytes: not in these rounds


def test_goals_met_or_not_with_their_ranges():
    def fig(**metrics):
        return {m: sf.spread(list(v)) for m, v in metrics.items()}

    figures = {
        "unlimited": {"nodeox": fig(round_s=(1.4, 1.6)), "torchft": fig(delta_to_sync_s=(1.0, 1.4))},
        "1000 Mbit/s": {"nodeox": fig(round_s=(1.0, 1.2), payload_bytes=(46e6,)),
                        "torchft": fig(delta_to_sync_s=(4.0, 5.0))},
        "200 Mbit/s": {"nodeox": fig(round_s=(2.0, 2.4), payload_bytes=(46e6, 46e6)),
                       "torchft": fig(delta_to_sync_s=(16.0, 18.0))},
        "100 Mbit/s": {"nodeox": fig(round_s=(10.0,), payload_bytes=(50e6,))},  # torchft did not run
    }
    rates = {"unlimited": None, "1000 Mbit/s": 1000.0, "200 Mbit/s": 200.0, "100 Mbit/s": 100.0}
    got = pf.goals(figures, rates)
    assert [g["goal"] for g in got] == [
        "unlimited: nodeox's round <= 0.5x torchft DiLoCo's sync",
        "1000 Mbit/s: nodeox's round <= 0.25x torchft DiLoCo's sync",  # no floor goal above 200 Mbit/s
        "200 Mbit/s: nodeox's round <= 0.25x torchft DiLoCo's sync",
        "200 Mbit/s: nodeox's round <= 1.3x one transfer of its payload (1.84 s)",
        "100 Mbit/s: nodeox's round <= 1.3x one transfer of its payload (4.00 s)",
    ]
    measured = [(round(g["measured"], 4), [round(x, 4) for x in g["range"]], g["met"]) for g in got]
    assert measured == [
        (1.25, [1.0, 1.6], False),  # 1.5 / 1.2
        (0.2444, [0.2, 0.3], True),  # 1.1 / 4.5
        (0.1294, [0.1111, 0.15], True),  # 2.2 / 17
        (1.1957, [1.087, 1.3043], True),  # 2.2 s against 46 MB at 200 Mbit/s = 1.84 s
        (2.5, [2.5, 2.5], False),  # 10 s against 4 s
    ]
    assert pf.goals({"unlimited": {"nodeox": fig(round_s=(1.0,))}}, {"unlimited": None}) == []


def test_links_are_mbit_or_unlimited():
    assert peers.parse_links("unlimited,1000,200") == [None, 1000.0, 200.0]
    assert [pf.link_label(m) for m in (None, 1000.0, 200.0, 2.5)] == [
        "unlimited", "1000 Mbit/s", "200 Mbit/s", "2.5 Mbit/s"]
    with pytest.raises(argparse.ArgumentTypeError, match="give Mbit/s"):
        peers.parse_links("1gbit")
    with pytest.raises(argparse.ArgumentTypeError, match="positive"):
        peers.parse_links("unlimited,0")
