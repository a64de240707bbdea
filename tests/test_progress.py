"""A host's progress line: one a round, folded to one every EVERY_S seconds when rounds are shorter, the first round
and the one that completes the run always shown."""

from __future__ import annotations

from lightning_nodeox.core.phases import TRAIN, WAIT, PhaseRecord
from lightning_nodeox.host.progress import EVERY_S, RoundProgress


def test_short_rounds_fold_into_one_line_every_few_seconds_and_the_last_is_always_shown() -> None:
    now = [100.0]
    progress = RoundProgress("0", clock=lambda: now[0])
    metrics = {"train_loss": 0.5, "val_loss": 9.0}
    shown = {}
    for r in range(12):  # rounds of EVERY_S / 4 seconds, each waiting 0.25 s for its sync
        now[0] += EVERY_S / 4
        progress(PhaseRecord(r, "0", WAIT, now[0] - 0.25, now[0]))
        progress(PhaseRecord(r, "0", TRAIN, now[0] - 1.0, now[0] - 0.25))  # not a wait: not added
        line = progress.line(r, 10 * (r + 1), f"{r:02d}" * 16, metrics, complete=r == 11)
        if line is not None:
            shown[r] = line
    assert shown == {
        0: "nodeox: host 0 round 0, step 10, train_loss 0.5, waited 0.25s, model 00000000",
        4: "nodeox: host 0 rounds 1-4, step 50, train_loss 0.5, waited 1.00s, model 04040404",  # EVERY_S after round 0
        8: "nodeox: host 0 rounds 5-8, step 90, train_loss 0.5, waited 1.00s, model 08080808",
        11: "nodeox: host 0 rounds 9-11, step 120, train_loss 0.5, waited 0.75s, model 11111111 (the run is complete)",
    }


def test_rounds_longer_than_the_interval_each_get_their_line() -> None:
    now = [0.0]
    progress = RoundProgress("h", clock=lambda: now[0])
    lines = []
    for r in range(3):
        now[0] += EVERY_S + 1
        lines.append(progress.line(r, r + 1, "ab" * 16, {}, complete=False))
    assert lines == [f"nodeox: host h round {r}, step {r + 1}, waited 0.00s, model abababab" for r in range(3)]
