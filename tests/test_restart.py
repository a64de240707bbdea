"""A coordinator started again on its run directory resumes the run: the same final model as a run never
interrupted (Nesterov outer optimizer, so its state must survive too), whether the model comes back from a host
or from a snapshot; a finished run is not resumed but moved aside."""

from __future__ import annotations

import json
import signal
import time

import pytest
import requests
from helpers import model, train_on_model
from restarts import AVERAGE, NESTEROV, ROUNDS, TUNED, run

from lightning_nodeox.core.phases import PhaseLog
from lightning_nodeox.core.codecs.settings import Q4Settings
from lightning_nodeox.core.specs import spec_of
from lightning_nodeox.core.wire import MessageLayout
from lightning_nodeox.host.client import HttpClient
from lightning_nodeox.host.fragments import Fragments
from lightning_nodeox.host.round import HostRound
from lightning_nodeox.host.tensors import HostTensors

pytestmark = pytest.mark.slow  # every test here starts processes

def saved_round(run_dir) -> int:
    path = run_dir / "state" / "run.json"
    return json.loads(path.read_text())["round"] if path.exists() else -1


def one_round_behind(run_dir) -> None:
    """Make the saved state that of the round before (as if the coordinator died between publishing a round and
    saving it): the hosts then hold the next model, and one of them gives it back."""
    path = run_dir / "state" / "run.json"
    state = json.loads(path.read_text())
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    before = {e["round"]: e["model_hash"] for e in events if e["phase"] == "sync_prepare"}
    state.update(round=state["round"] - 1, model_hash=before[state["round"] - 2])
    state["files"].pop("sync")
    path.write_text(json.dumps(state))


@pytest.mark.parametrize("how, snapshot_every, outer, still, fragments", [
    ("kill", 100, NESTEROV, (), 1), ("kill", 1, NESTEROV, (), 1), ("stop", 100, NESTEROV, (), 1),
    ("behind", 100, AVERAGE, (), 1), ("stop", 100, TUNED, (), 1), ("kill", 100, NESTEROV, ("w",), 1),
    ("kill", 100, NESTEROV, (), 2)])
def test_a_restarted_coordinator_ends_on_the_model_of_an_uninterrupted_run(coordinator, uninterrupted, how,
                                                                           snapshot_every, outer, still,
                                                                           fragments) -> None:
    """Mid-round, one delta sent: kill -9 (no snapshot of the current model: a host gives it back; or a snapshot
    every round), a clean stop (a snapshot at shutdown), or kill -9 with the saved state a round behind the hosts.
    Host a resends its delta, b sends its own, and the run ends bit-identical to one never interrupted. The
    coordinator is started again without the outer-optimizer flags: the saved ones (TUNED: each differs from its
    default) must win. With a frozen parameter (``still``), its deltas and syncs leave it out throughout. With 2
    fragments the kill falls in the middle of a fragment cycle (round 2 sends the first fragment, round 3 the
    second), and every round's messages carry its fragment, the last all."""
    coord = coordinator(2, *outer, "--snapshot-every", str(snapshot_every))
    port = coord.url.rsplit(":", 1)[1]
    started = []

    def interrupt() -> None:
        if how != "stop":  # round 1's state is on disk (the window before it is the "behind" case)
            deadline = time.monotonic() + 10
            while saved_round(coord.run_dir) < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
        coord.proc.send_signal(signal.SIGTERM if how == "stop" else signal.SIGKILL)
        assert coord.proc.wait(30) == (1 if how == "stop" else -signal.SIGKILL)  # 1: stopped before the end
        if how == "behind":
            one_round_behind(coord.run_dir)
        started.append(coordinator(2, "--bind", f"127.0.0.1:{port}", "--snapshot-every", str(snapshot_every),
                                   run_dir=coord.run_dir))

    final = uninterrupted(outer, still, fragments)
    assert run(coord.url, interrupt, still=still, fragments=fragments) == [final, final]
    assert started[0].wait(60) == 0
    log = started[0].log_path.read_text()
    from_snapshot = how == "stop" or snapshot_every == 1
    assert ("from its snapshot" in log) == from_snapshot, log
    assert ("model from host" in log) == (not from_snapshot), log
    assert ("hosts were at round 2" in log) == (how == "behind"), log
    events = [json.loads(line) for line in (coord.run_dir / "events.jsonl").read_text().splitlines()]
    (restart,) = [e["round"] for e in events if e["phase"] == "restart"]
    assert restart == (1 if how == "behind" else 2)
    assert [e["round"] for e in events if e["phase"] == "sync_prepare"] == list(range(ROUNDS))
    assert [e["hosts"] for e in events if e["phase"] == "aggregate" and e["round"] == 2] == [["a", "b"]]
    moving = [(n, t) for n, t in model(0) if n not in still]
    cut = Fragments(fragments, [s.nbytes for s in spec_of(moving)]).cut(tuple(range(len(moving))))
    assert len(cut) == fragments
    sizes = [MessageLayout.of(spec_of([moving[i] for i in cut[r % fragments]]), Q4Settings()).total
             for r in range(ROUNDS - 1)] + [MessageLayout.of(spec_of(moving), Q4Settings()).total]
    for phase in ("receive", "sync_prepare"):  # (a delta resent after the restart is received twice)
        assert {(e["round"], e["bytes"]) for e in events if e["phase"] == phase} == set(enumerate(sizes)), phase


def test_a_finished_run_is_moved_aside_and_a_new_one_starts(coordinator, tmp_path) -> None:
    first = coordinator(1)
    host = HostRound(HostTensors(model(0)), HttpClient(first.url, host="a"), PhaseLog("a"))
    host.join()
    train_on_model(host, 1, 0)
    host.run_round(16, final=True)
    host.client.leave()
    assert first.wait(60) == 0
    state = json.loads((first.run_dir / "state" / "run.json").read_text())
    assert state["complete"] and state["files"]["model"] == "model-1.safetensors"

    again = coordinator(1, run_dir=first.run_dir)
    assert "it held a finished run" in again.log_path.read_text()
    status = requests.get(f"{again.url}/v1/status", timeout=10).json()
    assert status["round"] == 0 and status["model_hash"] is None  # a new run, waiting for its first host
    (previous,) = first.run_dir.glob("previous-*")
    assert (previous / "events.jsonl").exists() and (previous / "state" / "run.json").exists()
    assert not (first.run_dir / "state").exists()
