"""benchmarks/epoch_samples.py: the samples of each epoch the published model lost or repeated, from the hosts'
logs of what they trained joined with the deltas the coordinator took into published rounds (across a restart)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # as `python benchmarks/x.py` has it
from epoch_samples import per_epoch


def _log(out: Path, host: str, rows: list[tuple], cut: bool = False) -> None:
    """A host's steps ``(round, epoch, indices[, time])``; the time defaults to 10 x round (before its receive)."""
    lines = [json.dumps([*row[:3], row[3] if len(row) > 3 else 10.0 * row[0]]) for row in rows]
    (out / f"host{host}_trained.jsonl").write_text("".join(f"{line}\n" for line in lines)
                                                   + ('[9, 0, [1' if cut else ""))  # a kill mid-line


def _record(phase: str, round_: int, at: float, **extra) -> dict:
    return {"round": round_, "host": "coordinator", "phase": phase, "start": at, "end": at, **extra}


def _events(taken: list[tuple[str, int]], published: list[int], ended: list[int] = ()) -> list[dict]:
    """Receives at 10 x round + 5, each round published at 10 x round + 8."""
    return ([_record("receive", r, 10.0 * r + 5, from_host=h) for h, r in taken]
            + [_record("sync_prepare", r, 10.0 * r + 8) for r in published]
            + [_record("data", r, 10.0 * r + 8, epoch_ended=k) for k, r in enumerate(ended)])


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


def test_a_round_a_restarted_coordinator_forgot_does_not_count_and_its_retake_does(tmp_path: Path) -> None:
    # round 1 published at 18, the coordinator killed, restarted at 19 resuming at round 1 (its save was of round 0):
    # host 0's round-1 step before the restart is forgotten; after it, host 0 trains round 1 again
    _log(tmp_path, "0", [(0, 0, [0, 1]), (1, 0, [2, 3]), (1, 0, [2, 3], 20.0)])  # the retake at 20, received at 25
    events = [*_events([("0", 0), ("0", 1)], [0, 1]), _record("restart", 1, 19.0),
              _record("receive", 1, 25.0, from_host="0"), _record("sync_prepare", 1, 28.0)]
    assert per_epoch(tmp_path, events, 4, ledger=False, epochs=1) == [
        {"epoch": 0, "trained": 4, "lost": 0, "repeated": 0}]  # without the restart's rule: 2 and 3 twice


def test_a_round_whose_model_a_host_gave_back_to_the_restarted_coordinator_counts(tmp_path: Path) -> None:
    # round 1 published at 18, killed before its save; restarted at 19 from the save of round 0 (its record: resumed
    # at round 1), a host gave back round 1's model: the new life publishes round 2 first, so round 1 is kept
    _log(tmp_path, "0", [(0, 0, [0, 1]), (1, 0, [2, 3]), (2, 0, [4, 5], 20.0)])
    events = [*_events([("0", 0), ("0", 1)], [0, 1]), _record("restart", 1, 19.0),
              _record("receive", 2, 25.0, from_host="0"), _record("sync_prepare", 2, 28.0)]
    assert per_epoch(tmp_path, events, 6, ledger=False, epochs=1) == [
        {"epoch": 0, "trained": 6, "lost": 0, "repeated": 0}]  # by the restart record alone: 2 and 3 lost


def test_a_refused_deltas_steps_do_not_count_though_the_empty_delta_sent_instead_was_received(tmp_path: Path) -> None:
    _log(tmp_path, "0", [(0, 0, [0, 1]), (1, 0, [2, 3])])
    _log(tmp_path, "1", [(1, 0, [2, 3])])  # its round-1 delta refused (its lease void), an empty one received instead
    uploads = [{"round": 1, "host": "1", "phase": "upload", "start": 11.0, "end": 12.0, "rejected": "lease_void"},
               {"round": 1, "host": "1", "phase": "upload", "start": 13.0, "end": 14.0, "empty": True}]
    events = [*_events([("0", 0), ("0", 1), ("1", 1)], [0, 1]), *uploads]
    assert per_epoch(tmp_path, events, 4, ledger=False, epochs=1) == [
        {"epoch": 0, "trained": 4, "lost": 0, "repeated": 0}]


def test_the_time_join_is_checked_against_the_ledgers_data_records(tmp_path: Path) -> None:
    from epoch_samples import ledger_disagreements

    _log(tmp_path, "0", [(0, 0, [0, 1]), (1, 0, [2, 3])])
    _log(tmp_path, "1", [(0, 0, [4, 5]), (1, 0, [6])])
    taken = [("0", 0), ("1", 0), ("0", 1), ("1", 1)]
    agree = [_record("data", 0, 8.0, deltas={"0": 2, "1": 2}), _record("data", 1, 18.0, deltas={"0": 2, "1": 1})]
    assert ledger_disagreements(tmp_path, [*_events(taken, [0, 1]), *agree]) == {}
    # the ledger took 0 samples of host 1's round-1 delta (say, a step skipped that its log still had)
    differ = [agree[0], _record("data", 1, 18.0, deltas={"0": 2})]
    assert ledger_disagreements(tmp_path, [*_events(taken, [0, 1]), *differ]) == {("1", 1): (1, 0)}
