"""Uneven hosts under the data ledger, end to end: two digits hosts of one device with the automatic sampler, one 3x
slower per step, both under a time budget (``round_seconds``). The epochs line up (neither host trains a sample of
the next epoch before the ledger ended the last one, and both start it in the same round), and the fast host
takes about 3x the units; ``nodeox report`` says what the coordinator's records say."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import Coordinator, run_hosts

SAMPLES = 1797  # scikit-learn's digits
EPOCHS = 3


def _steps(out: Path, host: str) -> list[list[int]]:
    """The host's ``[epoch, round, samples]`` of each step (digits_host --log-indices)."""
    return json.loads((out / f"host{host}_steps.json").read_text())


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_3x_slower_host_takes_a_third_of_the_units_and_both_start_each_epoch_in_the_round_after_it_ended(
        tmp_path: Path) -> None:
    coord = Coordinator(tmp_path / "run", 2, "--data-unit", "32")
    out = tmp_path / "out"
    run_hosts(coord, out, "01", "--ledger", "--log-indices", "--max-epochs", str(EPOCHS + 1),
              "--max-steps", "100000", "--batch-size", "16", "--round-seconds", "1.5",
              "--step-seconds", "0.1,0.3",
              timeout=200)  # host 1 sleeps 3x as long at every step
    # the last epoch is cut short (the fast host's training ends with it, and so the run): the first EPOCHS count
    records = [e for e in coord.events() if e["phase"] == "data"]
    ended = {e["epoch_ended"]: e["round"] for e in records if e["epoch_ended"] is not None}
    assert sorted(ended)[:EPOCHS] == list(range(EPOCHS)), ended

    steps = {h: _steps(out, h) for h in "01"}
    for h, rows in steps.items():  # each host's samples of an epoch were trained by the round that ended it
        for epoch, round_, _ in rows:
            assert epoch not in ended or round_ <= ended[epoch], (h, epoch, round_, ended)
    for epoch in range(1, EPOCHS):  # and both began the next epoch in the round after: neither ran ahead
        first = {h: min(r for e, r, _ in rows if e == epoch) for h, rows in steps.items()}
        assert first == {"0": ended[epoch - 1] + 1, "1": ended[epoch - 1] + 1}, (epoch, first, ended)

    # the samples (so units) each host trained in each epoch, from the ledger's records: the fast host about 3x
    at_end = {e["epoch_ended"]: e["hosts"] for e in records if e["epoch_ended"] is not None}
    done = {h: at_end[EPOCHS - 1][h]["committed"] for h in "01"}
    assert sum(done.values()) == EPOCHS * SAMPLES
    assert 2.0 <= done["0"] / done["1"] <= 4.5, done
    trained = {h: sum(n for e, _, n in rows if e < EPOCHS) for h, rows in steps.items()}  # the hosts' own count
    assert trained == done

    report = subprocess.run([sys.executable, "-m", "lightning_nodeox", "report", str(coord.run_dir), "--json"],
                            capture_output=True, text=True, timeout=120, check=True)
    data = json.loads(report.stdout)["summary"]["data"]
    assert [(e["epoch"], e["ended_round"]) for e in data["epochs"]] == sorted(ended.items())
    per_epoch = {e["epoch"]: e["committed"] for e in data["epochs"]}
    for epoch in range(EPOCHS):  # what each host committed in each epoch: its own steps of that epoch
        assert sum(per_epoch[epoch].values()) == SAMPLES
        assert per_epoch[epoch] == {h: sum(n for e, _, n in rows if e == epoch) for h, rows in steps.items()}
    last = records[-1]["hosts"]
    assert data["hosts"] == {h: {**c, "in_flight": c["leased"] - c["committed"] - c["returned"]}
                             for h, c in last.items()}
    assert data["current"]["epoch"] == records[-1]["epoch"]
    text = subprocess.run([sys.executable, "-m", "lightning_nodeox", "report", str(coord.run_dir)],
                          capture_output=True, text=True, timeout=120, check=True).stdout
    assert f"{len(ended)} epochs ended" in text
    assert (f"epoch 0    ended at round {ended[0]:<6} samples committed: host 0 {per_epoch[0]['0']}, "
            f"host 1 {per_epoch[0]['1']}") in text
