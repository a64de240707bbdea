"""A run that survives, with real host processes: a host whose training fails, a host killed and started again,
a coordinator killed and started again on its run directory."""

from __future__ import annotations

import json
import signal
import time

import pytest
from helpers import (
    DIGITS,
    assert_identical,
    launch,
    load,
    published,
    read_events,
    start_host,
    stop,
    wait_for,
)

pytestmark = pytest.mark.slow  # every test here starts processes


def test_a_host_whose_training_step_raises_leaves_and_the_other_finishes_on_time(tmp_path) -> None:
    """Host 1's training_step raises mid-way through round 1: it flushes its phase records and says goodbye, so
    host 0 waits seconds, not the 120 s lease, and finishes the run alone."""
    run_dir, out = tmp_path / "run", tmp_path / "out"
    result = launch(run_dir, 2, [*DIGITS, "--out", str(out), "--fail-round", "1"], "--lease", "120", timeout=180)
    assert result.returncode != 0, "launch reports the host that failed"
    assert "injected failure in training_step" in result.stdout
    assert "host 1 failed: exit status 1" in result.stdout  # host 0 may end first: interpreter exit is slow
    records = read_events(run_dir)
    assert {(e["round"], e["phase"]) for e in records if e["host"] == "1"} >= {(0, "train"), (0, "verify")}
    waits = {e["round"]: e["end"] - e["start"] for e in records if e["host"] == "0" and e["phase"] == "wait"}
    assert waits[1] < 15, f"host 0 waited {waits[1]:.1f} s for the host that failed"
    aggregated = {e["round"]: e["hosts"] for e in records if e["phase"] == "aggregate"}
    assert aggregated[0] == ["0", "1"] and aggregated[1] == ["0"]
    _, final = load(out / "host0_final.safetensors")
    assert final["model_hash"] == published(run_dir)[max(published(run_dir))]["model_hash"]


def test_a_killed_host_is_dropped_at_its_lease_and_rejoins_when_started_again(coordinator, tmp_path) -> None:
    """kill -9 of host 2 of 3 mid-round: the round closes at its lease (2 s) with hosts 0 and 1; host 2 is
    started again, rejoins, takes part again, and all three end bit-identical."""
    coord = coordinator(3, "--lease", "2")
    out, stop_file = tmp_path / "out", tmp_path / "stop"
    pace = ["--local-steps", "10", "--step-seconds", "0.05"]
    procs = [start_host(h, coord.url, out, "--max-steps", "5000", "--stop-file", str(stop_file), *pace)
             for h in "012"]
    try:
        wait_for(lambda: 1 in published(coord.run_dir), 120, "round 1")
        procs[2].send_signal(signal.SIGKILL)
        killed = time.time()
        procs[2].wait()
        killed_round = max(published(coord.run_dir)) + 1
        # until its lease ends its id is in use (a restart forked from the zygote is back well within 2 s)
        wait_for(lambda: "host 2: no heartbeat" in coord.log_path.read_text(), 30, "host 2's lease to end")
        procs[2] = start_host("2", coord.url, out, "--max-steps", "30", *pace)

        def three_again() -> bool:
            return any(e["phase"] == "aggregate" and e["round"] > killed_round and len(e["hosts"]) == 3
                       for e in read_events(coord.run_dir))

        wait_for(three_again, 120, "host 2 to take part again")
        stop_file.touch()  # hosts 0 and 1 end; host 2 ends after its 30 steps; all apply every sync to the end
        assert [p.wait(120) for p in procs] == [0, 0, 0]
        assert coord.wait(60) == 0
    finally:
        stop(procs)
    records = read_events(coord.run_dir)
    closed = {e["round"]: e for e in records if e["phase"] == "aggregate"}
    assert closed[killed_round]["hosts"] == ["0", "1"]
    assert 1.0 <= closed[killed_round]["end"] - killed <= 6.0, closed[killed_round]["end"] - killed
    assert "host 2: no heartbeat" in coord.log_path.read_text()
    assert any(e["hosts"] == ["0", "1", "2"] for r, e in closed.items() if r > killed_round), "host 2 took part again"
    assert_identical(out, ["0", "1", "2"])


def test_a_killed_coordinator_started_again_resumes_the_run(coordinator, tmp_path) -> None:
    """kill -9 of the coordinator mid-run, started again on its run directory and port: the hosts (never
    restarted) ride it out, give the model back, and the run completes from where it was, bit-identical."""
    coord = coordinator(2)
    out = tmp_path / "out"
    procs = [start_host(h, coord.url, out, "--max-steps", "80", "--local-steps", "10", "--step-seconds", "0.05")
             for h in "01"]
    try:
        wait_for(lambda: 2 in published(coord.run_dir), 120, "round 2")
        coord.proc.send_signal(signal.SIGKILL)
        coord.proc.wait()
        before = published(coord.run_dir)
        port = coord.url.rsplit(":", 1)[1]
        again = coordinator(2, "--bind", f"127.0.0.1:{port}", run_dir=coord.run_dir)
        assert [p.wait(240) for p in procs] == [0, 0], "the hosts were never restarted and ended well"
        assert again.wait(60) == 0
    finally:
        stop(procs)
    records = read_events(coord.run_dir)
    restart = [e for e in records if e["phase"] == "restart"]
    assert len(restart) == 1 and restart[0]["round"] in (max(before), max(before) + 1)
    assert restart[0]["model_hash"] in {e["model_hash"] for e in before.values()}
    after = published(coord.run_dir)
    assert max(after) > restart[0]["round"] + 2, "rounds went on after the restart"
    assert "resuming the run" in again.log_path.read_text()
    final = assert_identical(out, ["0", "1"])
    assert final == after[max(after)]["model_hash"]
    losses = json.loads((out / "host0_losses.json").read_text())
    times = json.loads((out / "host0_loss_times.json").read_text())
    resumed = [loss for loss, t in zip(losses, times) if t > restart[0]["start"]][:10]
    assert len(resumed) == 10 and sum(resumed) / 10 < 0.6 * sum(losses[:10]) / 10, "training went on, not over"
