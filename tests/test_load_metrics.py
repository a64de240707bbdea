"""The figures benchmarks/load.py reports from a run's records: aggregation-to-sync, CPU per round, RSS drift and
the goals, flat and behind relays (no runs)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # as `python benchmarks/x.py` has it
import load


def rec(round_, host, phase, start, end=None, **extra):
    return {"round": round_, "host": host, "phase": phase, "start": start, "end": start if end is None else end,
            **extra}


def site_records(round_, hosts, agg_end, download_starts):
    """A coordinator's aggregate of ``hosts`` ending at ``agg_end`` and each host's download of that round."""
    return [rec(round_, "coordinator", "aggregate", agg_end - 0.1, agg_end, hosts=hosts)] + [
        rec(round_, h, "download", s, s + 0.05) for h, s in zip(hosts, download_starts)]


def memory(host, samples):
    """Memory samples ``{round: (rss_bytes, cpu_s)}`` of ``host`` (a coordinator, or one forwarded by a relay)."""
    return [rec(r, host, "rss", 100.0 + r, rss_bytes=rss, cpu_s=cpu) for r, (rss, cpu) in samples.items()]


def test_root_aggregation_to_sync_counts_its_own_hosts_not_what_relays_forward():
    root = (site_records(0, ["site0", "site1"], 10.0, [10.5, 10.9])  # round 0: start-up, not counted
            + site_records(1, ["site0", "site1"], 20.0, [20.2, 20.3])
            + site_records(2, ["site0", "site1"], 30.0, [30.4, 30.1])
            # what site0 forwarded: its own aggregate and its hosts' downloads, later than the root's
            + [rec(1, "site0/coordinator", "aggregate", 19.0, 20.25, hosts=["0", "1"]),
               rec(1, "site0/0", "download", 25.0), rec(2, "site0/1", "download", 35.0)])
    assert load.aggregation_to_sync(root, rounds=3) == pytest.approx([0.3, 0.4])
    # a relay's own log: its aggregate against its hosts' downloads; its own upstream download (site0) is no host's
    site = (site_records(1, ["0", "1"], 19.5, [20.4, 20.45]) + site_records(2, ["0", "1"], 29.6, [30.5, 30.2])
            + [rec(1, "site0", "download", 20.2), rec(2, "site0", "download", 30.45)])
    assert load.aggregation_to_sync(site, rounds=3) == pytest.approx([0.95, 0.9])


def test_cpu_per_round_and_rss_from_the_coordinators_own_samples():
    events = (memory("coordinator", {0: (50, 0.5), 1: (90, 1.0), 2: (99, 2.0), 3: (100, 2.5), 4: (104, 2.8),
                                     5: (97, 3.6), 6: (103, 4.0)})
              + memory("site0/coordinator", {3: (1, 100.0), 4: (5000, 200.0)})  # forwarded by a relay
              + [rec(6, "coordinator", "rss", 200.0, rss_bytes=102, cpu_s=4.1)])  # a later sample of round 6 wins
    samples = load.memory_samples(events)
    assert sorted(samples) == [1, 2, 3, 4, 5, 6]
    # rounds 3..6: CPU between samples 2-3, 3-4, 4-5, 5-6 = 0.5, 0.3, 0.8, 0.5
    assert load.cpu_per_round(samples, rounds=6) == pytest.approx(0.5)
    figures = load.rss_figures(samples, rounds=6)
    assert figures["rss_after_round_3"] == 100 and figures["rss_after_last_round"] == 102
    assert figures["rss_max_deviation"] == pytest.approx(0.04)  # round 4: +4%, larger than round 5's -3%
    assert figures["rss_met"] is True
    samples[5]["rss_bytes"] = 94
    assert load.rss_figures(samples, rounds=6)["rss_max_deviation"] == pytest.approx(-0.06)
    assert load.rss_figures(samples, rounds=6)["rss_met"] is False


def relayed_run(rounds, site1_hosts_in_round_2=("2", "3")):
    """Root and two relays of two hosts each: their records over ``rounds`` rounds."""
    mem = {r: (100 + r % 2, 0.1 * r) for r in range(1, rounds + 1)}
    root, sites = memory("coordinator", mem), [memory("coordinator", mem), memory("coordinator", mem)]
    for r in range(rounds):
        t = 10.0 * (r + 1)
        root += site_records(r, ["site0", "site1"], t, [t + 0.2, t + 0.3])
        sites[0] += site_records(r, ["0", "1"], t - 1, [t + 0.4, t + 0.5])
        sites[1] += site_records(r, list(site1_hosts_in_round_2) if r == 2 else ["2", "3"], t - 1, [t + 0.6, t + 0.7])
    return root, sites


def test_summarize_behind_relays_counts_rounds_complete_at_the_root_and_at_every_site():
    root, sites = relayed_run(5)
    out = load.summarize(root, sites, [[0, 1], [2, 3]], rounds=5)
    assert out["rounds_complete_with_every_host"] == 5
    assert out["aggregation_to_sync_median_s"] == pytest.approx(0.3)
    assert out["site_aggregation_to_sync_median_s"] == pytest.approx((1.5 + 1.7) / 2)
    assert out["site_aggregation_to_sync_max_s"] == pytest.approx(1.7)
    assert [d["relay"] for d in out["relays_detail"]] == ["site0", "site1"]
    assert out["relays_detail"][1]["aggregation_to_sync_median_s"] == pytest.approx(1.7)
    assert out["coordinator_cpu_s_per_round"] == pytest.approx(0.1)
    assert out["coordinator_rss_max_deviation"] == pytest.approx(-1 / 101)  # rss 101 after round 3, 100 after 4
    root, sites = relayed_run(5, site1_hosts_in_round_2=("2",))  # site1 closed round 2 without host 3
    assert load.summarize(root, sites, [[0, 1], [2, 3]], rounds=5)["rounds_complete_with_every_host"] == 4


def result(placement, hosts, cpu, rss_met=True, relay_rss=()):
    return {"placement": placement, "hosts": hosts, "relays": len(relay_rss), "rounds": 20,
            "rounds_complete_with_every_host": 20, "coordinator_cpu_s_per_round": cpu,
            "coordinator_rss_met": rss_met, "coordinator_rss_max_deviation": 0.01 if rss_met else 0.07,
            "relays_detail": [{"relay": f"site{k}", "rss_met": abs(d) <= 0.05, "rss_max_deviation": d}
                              for k, d in enumerate(relay_rss)]}


def test_goals_root_cpu_a_quarter_of_flat_and_every_process_rss():
    results = [result("flat", 64, 0.40), result("relays", 64, 0.10, relay_rss=(0.01, -0.02)),
               result("flat", 16, 0.20, rss_met=False), result("relays", 16, 0.06, relay_rss=(0.01, 0.06))]
    goals = load.goals(results)
    assert [g["met"] for g in goals] == [True, True, False, False, True, False]
    assert "site1 +6.0% MISSED" in goals[3]["measured"] and "root +1.0% met" in goals[3]["measured"]
    assert goals[4]["measured"].endswith("0.25x") and goals[5]["measured"].endswith("0.30x")
    assert [g["met"] for g in load.goals([result("relays", 64, 0.1, relay_rss=(0.0,))])] == [True]  # no flat: no ratio
