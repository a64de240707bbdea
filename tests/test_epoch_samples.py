"""benchmarks/epoch_samples.py: the samples of each epoch the published model lost or repeated, from the hosts'
logs of what they trained joined with the deltas the coordinator took into published rounds."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # as `python benchmarks/x.py` has it
from epoch_samples import per_epoch


def _log(out: Path, host: str, rows: list[tuple[int, int, list[int]]], cut: bool = False) -> None:
    text = "".join(json.dumps(list(r)) + "\n" for r in rows)
    (out / f"host{host}_trained.jsonl").write_text(text + ('[9, 0, [1' if cut else ""))  # a kill mid-line


def _events(taken: list[tuple[str, int]], published: list[int], ended: list[int] = ()) -> list[dict]:
    return ([{"round": r, "host": "coordinator", "phase": "receive", "from_host": h} for h, r in taken]
            + [{"round": r, "host": "coordinator", "phase": "sync_prepare"} for r in published]
            + [{"round": r, "host": "coordinator", "phase": "data", "epoch_ended": k} for k, r in enumerate(ended)])


def test_hand_sharded_a_dead_hosts_untaken_round_is_lost_and_a_joiner_repeats_a_share(tmp_path: Path) -> None:
    # 6 samples, 2 hosts of 3 each; host 1 dies in round 1 (its delta not taken); host 2 joins in round 1 (host 0's
    # epoch 1 then), training host 0's share
    _log(tmp_path, "0", [(0, 0, [0, 2]), (0, 0, [4]), (1, 1, [2, 0]), (1, 1, [4])])
    _log(tmp_path, "1", [(0, 0, [1, 3, 5]), (1, 1, [5, 1])], cut=True)
    _log(tmp_path, "2", [(1, 0, [0, 2, 4])])
    events = _events([("0", 0), ("1", 0), ("0", 1), ("2", 1)], [0, 1])
    assert per_epoch(tmp_path, events, 6, ledger=False, epochs=2) == [
        {"epoch": 0, "trained": 6, "lost": 0, "repeated": 0},
        {"epoch": 1, "trained": 6, "lost": 3, "repeated": 3}]  # 1, 3, 5 lost; host 0's share twice


def test_under_the_ledger_a_samples_epoch_is_the_ledgers_by_round(tmp_path: Path) -> None:
    # epoch 0 ends at round 1; host 1 joined late, its Lightning epoch 0 is the ledger's epoch 1
    _log(tmp_path, "0", [(0, 0, [0, 1]), (1, 0, [2]), (2, 1, [3, 4])])
    _log(tmp_path, "1", [(1, 0, [3, 4, 5]), (2, 0, [0, 1, 2]), (3, 0, [5])])
    events = _events([("0", 0), ("0", 1), ("1", 1), ("0", 2), ("1", 2), ("1", 3)], [0, 1, 2], ended=[1])
    assert per_epoch(tmp_path, events, 6, ledger=True, epochs=2) == [
        {"epoch": 0, "trained": 6, "lost": 0, "repeated": 0},
        {"epoch": 1, "trained": 5, "lost": 1, "repeated": 0}]  # round 3 never published: sample 5 not counted
