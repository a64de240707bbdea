"""The data ledger through faults, end to end: digits hosts whose loaders read what the coordinator leases them
(``--ledger``), each logging the indices every training step trained with the round its delta carries them in
(``host<id>_steps.jsonl``, kept by a host killed). A host killed with -9 mid-epoch, a host joining mid-epoch, the
coordinator killed with -9 (or stopped with Ctrl-C) and started again on its run directory and port: across the
run the coordinator's committed positions (its ``data`` records) hold every index of each ended epoch once, and
the hosts' logs, joined with the deltas the coordinator took into its published rounds (the same records), agree:
no sample lost, none trained twice into the published model."""

from __future__ import annotations

import json
import os
import signal
import threading
from collections import Counter
from pathlib import Path

import pytest
from helpers import Coordinator, read_events, start_host, stop, wait_for

from lightning_nodeox.core.ledger_order import DataOrder

pytestmark = pytest.mark.slow  # every test here starts processes

SAMPLES = 1797  # scikit-learn's digits
UNIT = 64
HOST_ARGS = ("--ledger", "--log-indices", "--max-epochs", "2", "--max-steps", "100000", "--local-steps", "4",
             "--batch-size", "16", "--overlap", "off")
COORDINATOR_ARGS = ("--data-unit", str(UNIT), "--lease", "4", "--snapshot-every", "1000")


def _data_records(coord: Coordinator) -> list[dict]:
    return [e for e in coord.events() if e["phase"] == "data" and e["host"] == "coordinator"]


def _committed(coord: Coordinator) -> tuple[int, int]:
    """(the ledger's epoch, its samples committed) after the last round published, as the records say."""
    records = _data_records(coord)
    return (records[-1]["epoch"], records[-1]["epoch_committed_samples"]) if records else (0, 0)


def _restart(coord: Coordinator, hosts: int, *args: str) -> Coordinator:
    """The coordinator started again on ``coord``'s run directory and port."""
    port = coord.url.rsplit(":", 1)[1]
    return Coordinator(coord.run_dir, hosts, *args, "--bind", f"127.0.0.1:{port}")


def _steps(out: Path) -> dict[str, list[dict]]:
    """Each host's logged training steps (``round``, ledger ``epoch``, ``indices``)."""
    return {path.name.removeprefix("host").removesuffix("_steps.jsonl"):
            [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            for path in out.glob("host*_steps.jsonl")}


def check_every_sample_once(run_dir: Path, out: Path) -> list[int]:
    """The run's published rounds, from the coordinator's records (a round published again after a restart: its
    last record), against the hosts' logs. Returns the ledger epochs that ended."""
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    by_round = {e["round"]: e for e in events if e["phase"] == "data" and e["host"] == "coordinator"}
    saved = json.loads((run_dir / "state" / "run.json").read_text())["data"]["order"]
    order = DataOrder(saved["samples"], saved["seed"], saved["shuffle"])
    # the coordinator's side: the positions each published round committed, per ledger epoch, as sample indices
    committed: dict[int, Counter] = {}
    for record in by_round.values():
        epoch = record["epoch_ended"] if record["epoch_ended"] is not None else record["epoch"]
        for _, start, end in record["spans"]:
            committed.setdefault(epoch, Counter()).update(order.epoch(epoch).indices(start, end).tolist())
    # the hosts' side: what each host trained in each round, kept where the coordinator took its delta whole
    logged: dict[tuple[str, int], list[dict]] = {}
    for host, steps in _steps(out).items():
        for step in steps:
            logged.setdefault((host, step["round"]), []).append(step)
    trained: dict[int, Counter] = {}
    for round_, record in by_round.items():
        for host, samples in record["deltas"].items():
            steps = logged.get((host, round_), []) if samples else []
            assert sum(len(s["indices"]) for s in steps) == samples, (host, round_, samples, steps)
            for s in steps:
                trained.setdefault(s["epoch"], Counter()).update(s["indices"])
    ended = sorted(r["epoch_ended"] for r in by_round.values() if r["epoch_ended"] is not None)
    for epoch in sorted(set(committed) | set(trained)):
        twice = {i: n for i, n in (committed.get(epoch, Counter()) + trained.get(epoch, Counter())).items() if n != 2}
        assert not twice, f"epoch {epoch}: indices not committed once and trained once: {sorted(twice.items())[:20]}"
        if epoch in ended:
            assert sorted(committed[epoch]) == list(range(SAMPLES)), epoch  # none lost
    return ended


class SavedStates:
    """Every ``run.json`` the coordinator writes, by round, copied as it appears (a thread polls it)."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / "state" / "run.json"
        self.by_round: dict[int, dict] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.wait(0.005):
            try:
                saved = json.loads(self.path.read_text())
            except (OSError, ValueError):
                continue
            self.by_round.setdefault(saved["round"], saved)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def one_round_behind(run_dir: Path, states: SavedStates) -> int:
    """Make the saved state the one of the round before (as if the coordinator was killed after publishing a round
    and before saving it), with what it wrote before that round's sync went out beside it: the ledger after the
    publish, ``data-R.json`` (the run's ``run.json`` of round R holds that ledger). Returns R. When the kill itself
    landed between a publish and its save (the last round published is the saved state's, not the one before), the
    state is left as it is: it is behind already, and the coordinator wrote ``data-R.json`` itself."""
    now = json.loads((run_dir / "state" / "run.json").read_text())
    published = max(e["round"] for e in read_events(run_dir) if e["phase"] == "sync_prepare")
    if published == now["round"]:
        return published + 1
    r = now["round"]
    assert r - 1 in states.by_round, f"run.json of round {r - 1} was not seen"
    behind = dict(states.by_round[r - 1], hosts=now["hosts"])  # (credentials issued since: kept, as at a join)
    behind["files"] = {k: v for k, v in now["files"].items() if k == "model"}  # the sync of round r-2 is gone
    behind["snapshot_round"], behind["snapshot_hash"] = now["snapshot_round"], now["snapshot_hash"]
    (run_dir / "state" / f"data-{r}.json").write_text(json.dumps(
        {"round": r, "model_hash": now["model_hash"], "data": now["data"]}))
    (run_dir / "state" / "run.json").write_text(json.dumps(behind))
    return r


@pytest.mark.timeout(180)
@pytest.mark.parametrize("how", ["kill", "behind"])
def test_a_host_killed_a_host_joining_and_the_coordinator_killed_and_restarted_train_every_sample_once(
        tmp_path: Path, how: str) -> None:
    """Three hosts share out epoch 0; host 2 is killed -9 once some units are committed, host 3 joins then (its
    units go back when its lease expires); once host 3 trained, the coordinator is killed -9 and started again:
    its ledger voids every lease. ``behind``: the kill as if between a round's publish and its save: the saved
    state is the round before's, the hosts give the published round's model back, and the ledger written before
    that round's sync went out comes with it (the saved one would lease that round's units again). Every kill
    lands in epoch 0. The run ends after 2 epochs' passes; each ended epoch is every index once, committed and
    trained, and nothing is twice in the published model."""
    run_dir, out = tmp_path / "run", tmp_path / "out"
    coord = Coordinator(run_dir, 3, "--elastic", *COORDINATOR_ARGS)
    states = SavedStates(run_dir)
    join = tmp_path / "host3-joins"
    pace = ("--step-seconds", "0.15")
    procs = {h: start_host(h, coord.url, out, *HOST_ARGS, *pace) for h in "012"}
    procs["3"] = start_host("3", coord.url, out, *HOST_ARGS, *pace, "--join-file", str(join))
    started = []
    try:
        wait_for(lambda: _committed(coord)[1] >= 4 * UNIT, 90, "4 units of epoch 0 committed")
        procs["2"].send_signal(signal.SIGKILL)
        assert procs["2"].wait(30) == -signal.SIGKILL
        assert _committed(coord)[0] == 0  # mid-epoch
        join.touch()
        wait_for(lambda: "3" in _steps(out) and len(_steps(out)["3"]) >= 2, 60, "host 3 to join and train")
        at_kill = _committed(coord)
        wait_for(lambda: _committed(coord)[1] > at_kill[1], 60, "a round published after host 3 trained")
        coord.proc.send_signal(signal.SIGKILL)
        assert coord.proc.wait(30) == -signal.SIGKILL
        assert _committed(coord)[0] == 0, "the coordinator's kill did not land in epoch 0: pace the hosts slower"
        states.stop()
        behind = one_round_behind(run_dir, states) if how == "behind" else None
        started.append(_restart(coord, 3, "--elastic", *COORDINATOR_ARGS))
        for h in "013":
            assert procs[h].wait(120) == 0, [f.read_text()[-3000:] for f in sorted(out.glob(f"host{h}-*.log"))]
        assert started[0].wait(60) == 0, started[0].log_path.read_text()[-4000:]
    finally:
        states.stop()
        stop(list(procs.values()))
        coord.stop()
        for c in started:
            c.stop()
    assert [e["round"] for e in started[0].events() if e["phase"] == "restart"]  # it resumed
    log = started[0].log_path.read_text()
    assert (f"hosts were at round {behind}" in log) == (how == "behind"), log
    assert "the data ledger is one round behind" not in log
    ended = check_every_sample_once(run_dir, out)
    assert 0 in ended


@pytest.mark.timeout(180)
def test_a_run_stopped_with_ctrl_c_and_resumed_continues_its_epoch(tmp_path: Path) -> None:
    """Two hosts; mid-epoch 0 the coordinator gets SIGINT (Ctrl-C): it stops, saving the run's state; started again
    on its run directory it continues epoch 0 where it was (its next round commits on from there), and the epoch
    ends with every index once, none trained twice into the published model."""
    run_dir, out = tmp_path / "run", tmp_path / "out"
    coord = Coordinator(run_dir, 2, *COORDINATOR_ARGS)
    procs = [start_host(h, coord.url, out, *HOST_ARGS, "--step-seconds", "0.2") for h in "01"]
    started = []
    try:
        wait_for(lambda: _committed(coord)[1] >= 8 * UNIT, 90, "8 units of epoch 0 committed")
        # Ctrl-C to the coordinator itself (its own pid, not the test's forwarder, which inherits the worker's
        # signal dispositions: once under the full suite the signal never reached it)
        os.kill(json.loads((run_dir / "coordinator.json").read_text())["pid"], signal.SIGINT)
        coord.proc.wait(60)
        epoch, committed = _committed(coord)
        assert epoch == 0 and 0 < committed < SAMPLES, "the stop did not land in epoch 0: pace the hosts slower"
        saved = json.loads((run_dir / "state" / "run.json").read_text())
        assert saved["stopped"] and saved["data"]["committed"] == committed
        started.append(_restart(coord, 2, *COORDINATOR_ARGS))
        for p in procs:
            assert p.wait(120) == 0, [f.read_text()[-3000:] for f in sorted(out.glob("host*.log"))]
        assert started[0].wait(60) == 0, started[0].log_path.read_text()[-4000:]
    finally:
        stop(procs)
        coord.stop()
        for c in started:
            c.stop()
    events = started[0].events()
    restart = next(k for k, e in enumerate(events) if e["phase"] == "restart")
    after = [e for e in events[restart:] if e["phase"] == "data"]
    first = next(e for e in after if e["published_samples"])  # (deltas trained under a lease made void: none)
    assert first["epoch_ended"] == 0 or (first["epoch"], first["epoch_committed_samples"]) == (
        0, committed + first["published_samples"])  # the epoch goes on from where it was: not begun again
    ended = check_every_sample_once(run_dir, out)
    assert 0 in ended
