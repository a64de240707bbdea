"""The data ledger under Lightning, end to end: digits hosts of one device whose loaders get the ledger's sampler
(``Trainer(use_distributed_sampler=True)``), under a real coordinator."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import Coordinator, start_host, stop

SAMPLES = 1797  # scikit-learn's digits


def _trained(out: Path, host: str) -> list[list[int]]:
    return json.loads((out / f"host{host}_indices.json").read_text())


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_two_hosts_train_every_sample_of_the_first_epoch_once_and_the_coordinator_commits_exactly_those(
        tmp_path: Path) -> None:
    """Each host's loader reads the spans the coordinator leases it; a pass ends where the ledger has nothing more
    for the host, and the round closing there reports what it trained. After the run the hosts' first epochs,
    joined, are every index once, and the coordinator committed the epoch's samples exactly once."""
    coord = Coordinator(tmp_path / "run", 2, "--data-unit", "128")
    out = tmp_path / "out"
    procs = [start_host(h, coord.url, out, "--ledger", "--log-indices", "--max-epochs", "2", "--max-steps", "100000",
                        "--local-steps", "6", "--batch-size", "32") for h in "01"]
    try:
        for p in procs:
            assert p.wait(90) == 0, [f.read_text()[-4000:] for f in sorted(out.glob("host*.log"))]
        assert coord.wait(30) == 0, coord.log_path.read_text()[-4000:]
    finally:
        stop(procs)
        coord.stop()
    first = [i for h in "01" for epoch, i in _trained(out, h) if epoch == 0]
    assert sorted(first) == list(range(SAMPLES))  # none lost, none twice
    assert all(_trained(out, h) for h in "01")  # both hosts trained
    records = [e for e in coord.events() if e["phase"] == "data"]
    ended = next(k for k, e in enumerate(records) if e["epoch_ended"] is not None)
    assert records[ended]["epoch_ended"] == 0 and records[ended]["epoch"] == 1
    assert all(e["epoch"] == 0 for e in records[:ended])
    committed = sum(e["published_samples"] for e in records[: ended + 1])
    assert committed == SAMPLES == len(first)  # the first epoch's samples, each committed once: those trained
