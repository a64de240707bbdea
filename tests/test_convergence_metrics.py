"""The definitions benchmarks/convergence.py reports: wait share, bytes per host and the relay goal (no runs)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # as `python benchmarks/x.py` has it
from convergence_metrics import ddp_bytes_per_host, host_records, nodeox_bytes_sent, wait_share  # noqa: E402
from convergence_modes import (ACCURACY, DEFAULT_MODES, DILOCO, LM_MODES, MODES, RELAY_BASELINE,  # noqa: E402
                               RELAY_MODE, SWEEP_MODES, VAL_LOSS)
from convergence_report import goals, lm_goals, relay_goal, summarize, with_ratios  # noqa: E402


def rec(round_, phase, start, end, **extra):
    return {"round": round_, "host": "0", "phase": phase, "start": start, "end": end, **extra}


def test_wait_share_counts_every_exchange_phase_from_round_one():
    records = [
        rec(0, "train", 0, 1), rec(0, "wait", 1, 5),  # round 0: start-up skew, not counted
        rec(1, "train", 5, 9), rec(1, "encode", 9, 9.5), rec(1, "upload", 9.5, 10), rec(1, "wait", 10, 12),
        rec(1, "download", 12, 12.5), rec(1, "apply", 12.5, 13),
        rec(2, "train", 13, 15),
    ]
    assert wait_share(records) == pytest.approx(4 / 10)
    assert wait_share(records, first_round=0) == pytest.approx(8 / 15)


def test_wait_share_leaves_out_exchange_work_that_overlaps_training():
    records = [rec(1, "train", 0, 4), rec(1, "encode", 4, 5), rec(1, "upload", 5, 6), rec(1, "poll", 6, 7),
               rec(2, "train", 4, 8), rec(1, "fold", 7, 7.1), rec(1, "wait", 8, 8.4), rec(3, "train", 8.4, 10)]
    assert wait_share(records) == pytest.approx(0.5 / 10)


def test_wait_share_without_training_is_unknown():
    assert wait_share([rec(1, "wait", 0, 1)]) is None


def test_bytes_per_host():
    assert ddp_bytes_per_host(1000, steps=10, ranks=2) == 10_000  # ring all-reduce: 2(N-1)/N
    assert ddp_bytes_per_host(1000, steps=10, ranks=4) == 15_000
    events = [rec(1, "upload", 0, 1, bytes=100), rec(1, "download", 1, 2, bytes=50), rec(2, "upload", 2, 3, bytes=7)]
    assert nodeox_bytes_sent(events) == 107


def test_host_records_take_a_relayed_host_by_its_id_and_leave_out_memory_samples():
    events = [rec(1, "train", 0, 1), {**rec(1, "train", 0, 2), "host": "site0/0"},
              {**rec(1, "train", 0, 3), "host": "1"},
              {**rec(1, "aggregate", 0, 4), "host": "site0/coordinator"}, {**rec(1, "upload", 0, 5), "host": "site0"},
              rec(1, "rss", 0, 6), {**rec(1, "rss", 0, 7), "host": "site1/0"}]
    assert [r["end"] for r in host_records(events, "0")] == [1, 2]
    assert [r["end"] for r in host_records(events, "1")] == [3]


def summary(accuracies, identical=True):
    return {"summary": {"seeds": len(accuracies), "accuracy_mean": sum(accuracies) / len(accuracies),
                        "accuracy_min": min(accuracies), "accuracy_max": max(accuracies),
                        "hosts_identical": identical}}


def test_relay_goal_allows_no_loss_beyond_the_flat_seed_spread():
    flat = summary([0.95, 0.96, 0.97])  # mean 96%, spread 2 points
    base = RELAY_BASELINE
    goal = relay_goal({base: flat, RELAY_MODE: summary([0.94, 0.94, 0.94])})
    assert goal["met"] is True and "+2.00 points lost, spread 2.00 points over 3 seed(s)" in goal["measured"]
    assert relay_goal({base: flat, RELAY_MODE: summary([0.93, 0.94, 0.94])})["met"] is False
    assert relay_goal({base: flat, RELAY_MODE: summary([0.97] * 3, identical=False)})["met"] is False
    not_run = relay_goal({base: flat})
    assert not_run["met"] is None and not_run["measured"] == f"{RELAY_MODE}: not run (not in --modes)"
    failed = relay_goal({base: {"status": "failed", "reason": "boom"}, RELAY_MODE: flat})
    assert failed["met"] is None and failed["measured"] == f"{base}: boom"
    assert not [g for g in goals({"ddp": {}}, 20) if RELAY_MODE in g["goal"]]  # neither run


def lm_summary(losses, bytes_per_host, identical=True):
    return {"summary": {"seeds": len(losses), "val_loss_mean": sum(losses) / len(losses), "val_loss_min": min(losses),
                        "val_loss_max": max(losses), "bytes_per_host": bytes_per_host, "hosts_identical": identical}}


def test_language_model_goals_take_half_the_bytes_within_q4s_seed_spread():
    q4 = lm_summary([2.40, 2.42, 2.44], 1000)  # mean 2.42, spread 0.04
    found = lm_goals({"q4": q4, "q2": lm_summary([2.45, 2.46, 2.47], 530),
                      "q2_b256": lm_summary([2.44, 2.45, 2.46], 490),
                      "q4_no_ef": lm_summary([2.50, 2.50, 2.50], 1000)})
    by_mode = {g["goal"].split(":")[0]: g for g in found}
    assert by_mode["q2"]["met"] is False and by_mode["q2"]["measured"].startswith("0.530x q4's bytes")
    assert by_mode["q2_b256"]["met"] is True
    assert "val loss 2.4500 against q4's 2.4200 (+0.0300, spread 0.0400 over 3 seed(s))" in by_mode["q2_b256"]["measured"]
    assert by_mode["q4_no_ef"]["met"] is True and "(+0.0800)" in by_mode["q4_no_ef"]["measured"]
    worse = lm_goals({"q4": q4, "q2_b256": lm_summary([2.47, 2.47, 2.47], 490)})
    assert [g["met"] for g in worse] == [False]
    assert lm_goals({"q4": q4, "q2": {"status": "failed", "reason": "boom"}})[0]["measured"] == "q2: boom"
    assert lm_goals({"ddp": {}}) == []


def test_the_language_models_summary_is_of_its_validation_loss():
    runs = [{"val_loss": v, "perplexity": math.exp(v), "bytes_per_host": 10, "wall_s": 1.0, "wait_share": {"0": 0.1},
             "hosts_identical": True, "samples": {"0": 8}, "step_s": {"0": 0.3}} for v in (2.0, 2.2)]
    s = summarize(runs, VAL_LOSS)
    assert (s["val_loss_mean"], s["val_loss_min"], s["val_loss_max"]) == (pytest.approx(2.1), 2.0, 2.2)
    assert s["perplexity_mean"] == pytest.approx((math.exp(2.0) + math.exp(2.2)) / 2)
    modes = {"ddp": {"summary": {**s, "val_loss_mean": 2.0, "wall_s": 2.0}}, "q4": {"summary": s}}
    with_ratios(modes, VAL_LOSS)
    assert modes["q4"]["summary"]["val_loss_vs_ddp"] == pytest.approx(0.1)
    assert ACCURACY.vs_ddp == "accuracy_vs_ddp_points"  # the digits table's key, as before


def test_the_sweep_modes_set_their_own_local_steps():
    assert SWEEP_MODES == [f"q4_{o}_h{h}" for o in ("average", "nesterov") for h in (10, 20, 50, 100)]
    assert MODES["q4_nesterov_h50"]["local_steps"] == 50
    assert MODES["q4_nesterov_h50"]["coordinator"] == DILOCO
    assert not set(SWEEP_MODES) & set(DEFAULT_MODES) | set(LM_MODES) - set(MODES)
