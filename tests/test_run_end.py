"""The run's end is an explicit decision: it completes with the round of a final delta, never because no host was
heard from; with no live host it waits (``--no-hosts-timeout``), then stops resumable. A resumed run's hosts are
not yet heard from, so new processes take their ids; Ctrl-C under `nodeox launch` stops the run resumable, in a few
lines, and the same command resumes it. Only the run's first round waits for ``--hosts`` to join."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from helpers import (
    DIGITS,
    REPO,
    SPECS,
    assert_identical,
    join,
    model_file,
    published,
    read_events,
    start_host,
    stop,
    train,
    upload,
    wait_for,
)
from helpers import model as restart_model
from helpers import train_on_model as restart_train
from local_transport import LocalClient

from lightning_nodeox.coordinator.hosts import HostState
from lightning_nodeox.coordinator.waiting import waiting_for
from lightning_nodeox.core.phases import PhaseLog
from lightning_nodeox.core.protocol import Reason, Refusal, Upload
from lightning_nodeox.core.specs import spec_of
from lightning_nodeox.host.client import HttpClient
from lightning_nodeox.host.round import HostRound
from lightning_nodeox.host.tensors import HostTensors

pytestmark = pytest.mark.usefixtures("keep_records")  # every PhaseLog keeps its records




def saved_state(run_dir: Path) -> dict:
    return json.loads((run_dir / "state" / "run.json").read_text())


def waiting_line(c) -> str:
    said = waiting_for(c.state, c.rounds, c.run.recovery, c.membership.provider)
    return "" if said is None else said[1]


# -- in process -------------------------------------------------------------------------------------------------


def test_a_waiting_round_names_the_hosts_whose_deltas_it_waits_for_and_says_it_once_while_it_holds(
        local_coordinator, caplog) -> None:
    caplog.set_level("INFO")
    c = local_coordinator(hosts=3, status_interval=0.0)
    a, b, _ = join(c, "a", "b", "x")
    assert waiting_line(c) == "round 0 waits for deltas from hosts a, b, x"
    train(a, 0)
    assert upload(a) is Upload.TAKEN
    c.call(c.rounds.deltas.accumulated())
    assert waiting_line(c) == "round 0 waits for deltas from hosts b, x; it has those of a"
    for _ in range(3):
        c.tick()
    train(b, 0)
    assert upload(b) is Upload.TAKEN
    c.call(c.rounds.deltas.accumulated())
    for _ in range(3):
        c.tick()
    lines = [m for m in caplog.messages if "waits for deltas" in m]
    assert lines == ["nodeox coordinator: round 0 waits for deltas from hosts b, x; it has those of a",
                     "nodeox coordinator: round 0 waits for deltas from host x; it has those of a, b"]


def test_waiting_for_the_initial_model_is_said_once_and_then_who_uploads_it(local_coordinator, caplog) -> None:
    caplog.set_level("INFO")
    c = local_coordinator(hosts=2, status_interval=0.0)
    for _ in range(3):
        c.tick()
    a = LocalClient(c, "a")
    assert a.join([s.as_json() for s in spec_of(restart_model(0))]).provide_model  # asked, not yet uploaded
    for _ in range(3):
        c.tick()
    lines = [m for m in caplog.messages if "initial model" in m]
    assert lines == ["nodeox coordinator: waiting for the first host to join: it provides the initial model",
                     "nodeox coordinator: host a joined and uploads the initial model (another host is asked if it "
                     "has not within --provider-timeout 300 s)"]



def test_hosts_that_all_sent_their_final_delta_are_not_reported_as_gone(local_coordinator) -> None:
    """Between the last final delta and the round that takes it, no host trains: that is the run ending, not a run
    waiting for its hosts (the console said "no host is live ... waits 600 s" just before "the run completed")."""
    c = local_coordinator(lease=0.3, no_hosts_timeout=0.6)
    join(c, "a", "b")
    for entry in c.state.hosts.values():
        entry.state = HostState.FINISHED  # as the hosts' final uploads leave them while the round closes
    assert c.state.hosts.all_finished()
    c.tick()
    assert c.state.alone_since is None and not waiting_line(c).startswith("no host is live")
    c.state.hosts["b"].state = HostState.LEFT  # one left instead: nobody will send the round's delta
    assert not c.state.hosts.all_finished()
    c.tick()
    assert c.state.alone_since is not None


@pytest.mark.parametrize("final_wait", [60.0, 0.0])
def test_a_host_of_the_final_round_paused_past_its_lease_still_gets_the_final_model_within_the_final_wait(
        local_coordinator, final_wait: float) -> None:
    """a and b send their final deltas; b is then paused (no call, its lease long expired) while a fetches the
    final model and leaves. The run waits for b (up to ``--final-wait``): resumed, b gets the same final model and
    leaves, and only then may the coordinator stop. With ``--final-wait 0`` it stops without b."""
    c = local_coordinator(lease=0.3, final_wait=final_wait)
    a, b = join(c, "a", "b")
    train(a, 0), train(b, 0)
    assert upload(a, final=True) is Upload.TAKEN and upload(b, final=True) is Upload.TAKEN
    assert a.synchronize().complete
    a.client.leave()
    c.state.hosts["b"].seen -= 10 * c.config.lease  # b paused: not heard from for ten leases
    c.tick()
    assert c.state.complete and c.state.final_members == {"a", "b"}
    assert c.run.status()["hosts"] == {"a": "left", "b": "finished"}
    assert c.state.finished.is_set() == (final_wait == 0.0)
    if final_wait == 0.0:
        return
    c.tick()
    assert not c.state.finished.is_set()
    result = b.synchronize()  # b resumes
    assert (result.complete, result.round, b.model_hash) == (True, 0, a.model_hash)
    assert c.state.final_served == {"a", "b"}
    assert not c.state.finished.is_set()  # b is heard from again: the run waits for it to leave
    b.client.leave()
    assert c.state.finished.is_set()


def test_a_host_of_the_final_round_that_was_sent_the_final_sync_does_not_hold_the_end_past_its_lease(
        local_coordinator) -> None:
    """a and b send their final deltas and fetch the final sync; b then dies without leaving. Once its lease has
    lapsed the coordinator may stop at once: it waits (``--final-wait``) only for a host not yet sent the sync."""
    c = local_coordinator(lease=0.3, final_wait=600.0)
    a, b = join(c, "a", "b")
    train(a, 0), train(b, 0)
    assert upload(a, final=True) is Upload.TAKEN and upload(b, final=True) is Upload.TAKEN
    assert a.synchronize().complete and b.synchronize().complete
    a.client.leave()
    c.state.hosts["b"].seen -= 10 * c.config.lease  # b died after its sync
    c.tick()
    assert c.state.finished.is_set()


def test_hosts_that_are_dropped_or_leave_never_complete_the_run_and_a_dropped_one_that_returns_trains_on(local_coordinator) -> None:
    c = local_coordinator(lease=0.3, no_hosts_timeout=0.6)
    a, b = join(c, "a", "b")
    train(a, 0), train(b, 0)
    assert upload(a) is Upload.TAKEN and upload(b) is Upload.TAKEN
    a.synchronize(), b.synchronize()
    time.sleep(0.5)  # both cut off for longer than the lease
    c.tick()
    assert c.run.status()["hosts"] == {"a": "dropped", "b": "dropped"}
    assert not c.state.complete and c.state.alone_since is not None
    assert waiting_line(c).startswith("no host is live at round 1: waiting for a (not heard from for ")
    c.call(c.membership.heartbeat("a"))  # a is back: it trains on
    c.tick()
    assert c.run.status()["hosts"] == {"a": "training", "b": "dropped"} and c.state.alone_since is None
    c.call(c.membership.leave("a")), c.call(c.membership.leave("b"))
    c.tick()
    assert (c.state.complete, c.state.finished.is_set(), c.state.given_up.is_set()) == (False, False, False)
    assert "waiting for a (left), b (left) to come back" in waiting_line(c)
    time.sleep(0.7)
    c.tick()
    assert (c.state.complete, c.state.given_up.is_set(), c.state.published_round) == (False, True, 0)


def test_every_round_after_the_first_closes_once_the_live_hosts_have_sent_whatever_hosts_have_not_joined(local_coordinator) -> None:
    """--hosts 3 --min-hosts 2 --round-timeout T with 2 hosts: round 0 waits T for the third to join; later rounds
    close as soon as both have sent (long before T)."""
    timeout = 3.0
    c = local_coordinator(hosts=3, min_hosts=2, round_timeout=timeout)
    a, b = join(c, "a", "b")
    opened = []
    for r in range(3):
        opened.append(c.state.round_opened)
        train(a, r), train(b, r)
        assert upload(a) is Upload.TAKEN and upload(b) is Upload.TAKEN
        c.call(c.rounds.deltas.accumulated())
        c.call(c.rounds.maybe_close())
        c.call(c.rounds.wait_stable())  # a close started by the last delta's accumulation has published
        if r == 0:
            assert c.state.published_round == -1, "round 0 waits for the third host"
            assert "round 0 waits for 1 more host(s) to join (--hosts 3)" in waiting_line(c)
            time.sleep(max(0.0, opened[0] + timeout - time.time()) + 0.1)
            c.tick()
        assert c.state.published_round == r
        a.synchronize(), b.synchronize()
    closed = {e["round"]: e["start"] for e in read_events(c.config.run_dir) if e["phase"] == "aggregate"}
    assert closed[0] - opened[0] >= timeout
    assert all(closed[r] - opened[r] < timeout for r in (1, 2)), (closed, opened)
    assert (a.round, b.round, c.state.complete) == (3, 3, False)


# -- a coordinator process ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_host_that_left_cannot_read_the_model_with_its_credential(coordinator) -> None:
    coord = coordinator(2)
    a = HttpClient(coord.url, host="a", retry_for=5)
    assert a.join([s.as_json() for s in SPECS]).provide_model
    a.put_model(memoryview(model_file()))
    a.get_model().close()
    a.leave()
    with pytest.raises(Refusal, match="host a left the run") as refused:
        a.get_model()
    assert refused.value.reason is Reason.FORBIDDEN
    a.leave()  # a goodbye said again is no error
    assert a.join([s.as_json() for s in SPECS]).model_hash  # joining again, it may read the model again
    a.get_model().close()


RESTART_SPECS = [s.as_json() for s in spec_of(restart_model(0))]


def hosts_of(url: str) -> list[HostRound]:
    hosts = [HostRound(HostTensors(restart_model(seed)), HttpClient(url, host=h, retry_for=60), PhaseLog(h))
             for seed, h in enumerate("ab")]
    for h in hosts:
        h.join()
    return hosts


def exchange(hosts: list[HostRound], round_: int, final: bool = False) -> None:
    """One round of every host, each host's sync awaited at most 60 s."""
    for k, h in enumerate(hosts, 1):
        restart_train(h, k, round_)
        assert h.upload(h.encode(h.tensors.live, 16, final)).value == "taken"
    with ThreadPoolExecutor(len(hosts)) as pool:
        futures = [pool.submit(h.synchronize, follow_to_end=final) for h in hosts]
        assert [f.result(timeout=60).round for f in futures] == [round_] * len(hosts)


@pytest.mark.slow
def test_a_restart_with_a_larger_hosts_goes_on_with_the_hosts_it_has(coordinator) -> None:
    coord = coordinator(2)
    port = coord.url.rsplit(":", 1)[1]
    hosts = hosts_of(coord.url)
    exchange(hosts, 0), exchange(hosts, 1)
    coord.proc.send_signal(signal.SIGTERM)
    assert coord.wait(30) == 1 and not saved_state(coord.run_dir)["complete"]
    again = coordinator(3, "--bind", f"127.0.0.1:{port}", run_dir=coord.run_dir)
    exchange(hosts, 2), exchange(hosts, 3, final=True)
    for h in hosts:
        h.client.leave()
        h.close()
    assert again.wait(60) == 0
    assert saved_state(coord.run_dir)["complete"]
    assert sorted(published(coord.run_dir)) == [0, 1, 2, 3]
    assert hosts[0].model_hash == hosts[1].model_hash == published(coord.run_dir)[3]["model_hash"]


@pytest.mark.slow
def test_a_resumed_runs_hosts_are_not_yet_heard_from_so_a_new_process_takes_the_place_of_one(coordinator) -> None:
    """The coordinator stops while both hosts train (saved as training); started again with a long lease, a new
    process with host a's id joins at once, and the old process's credential no longer acts for a."""
    coord = coordinator(2, "--lease", "60")
    port = coord.url.rsplit(":", 1)[1]
    hosts = hosts_of(coord.url)
    exchange(hosts, 0)
    coord.proc.send_signal(signal.SIGTERM)
    assert coord.wait(30) == 1
    assert {h: d["state"] for h, d in saved_state(coord.run_dir)["hosts"].items()} == {"a": "training",
                                                                                       "b": "training"}
    again = coordinator(2, "--bind", f"127.0.0.1:{port}", "--lease", "60", run_dir=coord.run_dir)
    new_a = HttpClient(again.url, host="a", retry_for=5)
    reply = new_a.join(RESTART_SPECS)
    assert reply.model_hash == hosts[0].model_hash and reply.round == 1
    with pytest.raises(Refusal) as refused:
        hosts[0].client.heartbeat()
    assert refused.value.reason is Reason.FORBIDDEN
    hosts[1].client.heartbeat()  # b was heard from: its process keeps its id
    with pytest.raises(Refusal) as in_use:
        HttpClient(again.url, host="b", retry_for=5).join(RESTART_SPECS)
    assert in_use.value.reason is Reason.ID_IN_USE
    for h in hosts:
        h.close()


# -- real hosts -------------------------------------------------------------------------------------------------


def start_launch(run_dir: Path, out: Path, log: Path, *args: str) -> subprocess.Popen:
    """`nodeox launch` of 2 digits hosts in a session of its own (so a test can Ctrl-C its process group)."""
    with open(log, "a") as sink:  # the child holds its own copy
        return subprocess.Popen(
            [sys.executable, "-m", "lightning_nodeox", "launch", "--hosts", "2", "--run-dir", str(run_dir),
             "--threads", "1", *args], cwd=REPO, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True,
            env=dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1"))


def end(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def after_fit(out: Path, host: str) -> dict:
    return json.loads((out / f"host{host}_after_fit.json").read_text())


@pytest.mark.slow
def test_a_run_whose_hosts_are_all_cut_off_for_longer_than_the_lease_goes_on_when_they_return(tmp_path) -> None:
    run_dir, out, log = tmp_path / "run", tmp_path / "out", tmp_path / "launch.log"
    proc = start_launch(run_dir, out, log, "--lease", "1", "--", *DIGITS, "--out", str(out), "--max-steps", "60",
                        "--local-steps", "10", "--step-seconds", "0.05")
    try:
        wait_for(lambda: 1 in published(run_dir), 180, "round 1")
        pids = [int((out / f"host{h}.pid").read_text()) for h in "01"]
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        wait_for(lambda: "no host is live" in log.read_text(), 30, "the coordinator to see no live host")
        time.sleep(1.0)
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
        assert proc.wait(180) == 0
    finally:
        for pid in locals().get("pids", []):
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        end(proc)
    text = log.read_text()
    assert "host 0: no heartbeat" in text and "host 1: no heartbeat" in text
    assert saved_state(run_dir)["complete"]
    rounds = published(run_dir)
    assert sorted(rounds) == list(range(6))
    assert [after_fit(out, h)["global_step"] for h in "01"] == [60, 60]
    assert assert_identical(out, ["0", "1"]) == rounds[5]["model_hash"]


@pytest.mark.slow
def test_a_run_with_no_live_host_for_the_no_hosts_timeout_stops_unfinished_and_a_restart_resumes_it(
        coordinator, tmp_path) -> None:
    coord = coordinator(2, "--lease", "1", "--no-hosts-timeout", "2")
    out = tmp_path / "out"
    pace = ["--local-steps", "10", "--step-seconds", "0.05"]
    procs = [start_host(h, coord.url, out, "--max-steps", "5000", *pace) for h in "01"]
    try:
        wait_for(lambda: 1 in published(coord.run_dir), 180, "round 1")
        stop(procs)  # kill -9: no goodbye
        assert coord.wait(60) == 1
        stopped = saved_state(coord.run_dir)
        assert not stopped["complete"]
        log = coord.log_path.read_text()
        assert "no host is live" in log and "no host was live for" in log and "stopped before the run completed" in log
        # the restarted coordinator waits one lease for the saved hosts to be heard from: long enough for both
        # host processes to start (a few seconds each under load), so that both train every round after it
        again = coordinator(2, "--lease", "10", run_dir=coord.run_dir)
        assert "resuming the run" in again.log_path.read_text()
        procs = [start_host(h, again.url, out, "--max-steps", "20", *pace) for h in "01"]
        assert [p.wait(180) for p in procs] == [0, 0]
        assert again.wait(60) == 0
    finally:
        stop(procs)
    assert saved_state(coord.run_dir)["complete"]
    (restart,) = [e for e in read_events(coord.run_dir) if e["phase"] == "restart"]
    assert restart["round"] == stopped["round"]
    rounds = published(coord.run_dir)
    assert sorted(rounds) == list(range(stopped["round"] + 2)), "two rounds of 10 steps after the restart"
    assert [after_fit(out, h)["global_step"] for h in "01"] == [20, 20]
    assert assert_identical(out, ["0", "1"]) == rounds[max(rounds)]["model_hash"]


@pytest.mark.slow
def test_ctrl_c_under_launch_stops_the_run_resumable_in_a_few_lines_and_the_same_command_resumes_it(tmp_path) -> None:
    run_dir, out, stop_file = tmp_path / "run", tmp_path / "out", tmp_path / "stop"
    command = ["--lease", "2", "--", *DIGITS, "--out", str(out), "--max-steps", "5000", "--local-steps", "10",
               "--step-seconds", "0.05", "--stop-file", str(stop_file)]
    first, second = tmp_path / "first.log", tmp_path / "second.log"
    proc = start_launch(run_dir, out, first, *command)
    try:
        wait_for(lambda: 1 in published(run_dir), 180, "round 1")
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C in the terminal: the whole foreground process group
        assert proc.wait(60) == 128 + signal.SIGINT
    finally:
        end(proc)
    text = first.read_text()
    after = text[text.index("nodeox launch: SIGINT"):].splitlines()
    assert "Traceback" not in text and "KeyboardInterrupt" not in text
    assert len(after) <= 20, after
    assert after[-3:] == ["nodeox launch: host 0: exit status 143 (SIGTERM)",
                          "nodeox launch: host 1: exit status 143 (SIGTERM)",
                          "nodeox launch: coordinator: stopped before the run completed, the run saved (exit status 1)"]
    stopped = saved_state(run_dir)
    assert not stopped["complete"]

    proc = start_launch(run_dir, out, second, *command)
    try:
        wait_for(lambda: stopped["round"] + 1 in published(run_dir), 180, "a round after the restart")
        stop_file.touch()
        assert proc.wait(120) == 0
    finally:
        end(proc)
    text = second.read_text()
    assert "resuming the run" in text and "in use" not in text
    assert saved_state(run_dir)["complete"]
    (restart,) = [e for e in read_events(run_dir) if e["phase"] == "restart"]
    assert restart["round"] == stopped["round"]
    rounds = published(run_dir)
    assert sorted(rounds) == list(range(max(rounds) + 1)) and max(rounds) > stopped["round"]
    assert assert_identical(out, ["0", "1"]) == rounds[max(rounds)]["model_hash"]
