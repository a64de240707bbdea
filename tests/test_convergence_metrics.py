"""The definitions benchmarks/convergence.py reports: wait share and bytes per host (no runs)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # as `python benchmarks/x.py` has it
import convergence  # noqa: E402


def rec(round_, phase, start, end, **extra):
    return {"round": round_, "host": "0", "phase": phase, "start": start, "end": end, **extra}


def test_wait_share_counts_every_exchange_phase_from_round_one():
    records = [
        rec(0, "train", 0, 1), rec(0, "wait", 1, 5),  # round 0: start-up skew, not counted
        rec(1, "train", 5, 9), rec(1, "encode", 9, 9.5), rec(1, "upload", 9.5, 10), rec(1, "wait", 10, 12),
        rec(1, "download", 12, 12.5), rec(1, "apply", 12.5, 13),
        rec(2, "train", 13, 15),
    ]
    assert convergence.wait_share(records) == pytest.approx(4 / 10)
    assert convergence.wait_share(records, first_round=0) == pytest.approx(8 / 15)


def test_wait_share_leaves_out_exchange_work_that_overlaps_training():
    records = [rec(1, "train", 0, 4), rec(1, "encode", 4, 5), rec(1, "upload", 5, 6), rec(1, "poll", 6, 7),
               rec(2, "train", 4, 8), rec(1, "fold", 7, 7.1), rec(1, "wait", 8, 8.4), rec(3, "train", 8.4, 10)]
    assert convergence.wait_share(records) == pytest.approx(0.5 / 10)


def test_wait_share_without_training_is_unknown():
    assert convergence.wait_share([rec(1, "wait", 0, 1)]) is None


def test_bytes_per_host():
    assert convergence.ddp_bytes_per_host(1000, steps=10, ranks=2) == 10_000  # ring all-reduce: 2(N-1)/N
    assert convergence.ddp_bytes_per_host(1000, steps=10, ranks=4) == 15_000
    events = [rec(1, "upload", 0, 1, bytes=100), rec(1, "download", 1, 2, bytes=50), rec(2, "upload", 2, 3, bytes=7)]
    assert convergence.nodeox_bytes_sent(events) == 107
