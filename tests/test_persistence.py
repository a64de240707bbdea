"""The coordinator's persistence: a save that fails never stops the run, a restart never goes behind what was
published (kill -9 in the middle of a save included), and what a restart takes back is what was saved
(credentials from the moment they were issued, the model's layout and hash, the outer state's checksum)."""

from __future__ import annotations

import errno
import json
import os
import signal
import time
from pathlib import Path

import pytest
from helpers import model, upload, wait_for
from helpers import train_on_model as train
from local_transport import LocalClient, LocalCoordinator
from restarts import AVERAGE, NESTEROV, ROUNDS, run

from lightning_nodeox.coordinator import state as state_module
from lightning_nodeox.coordinator.recovery import Recovery
from lightning_nodeox.coordinator.runlog import Trouble
from lightning_nodeox.core.phases import PhaseLog
from lightning_nodeox.core.protocol import Reason, Refusal, Upload
from lightning_nodeox.core.specs import TensorSpec
from lightning_nodeox.host.client import HttpClient
from lightning_nodeox.host.round import HostRound
from lightning_nodeox.host.tensors import HostTensors

SAYS_FAILED = "cannot write the run's state"


def run_json(run_dir: Path) -> dict:
    return json.loads((run_dir / "state" / "run.json").read_text())


def eventually(holds, timeout: float = 10.0) -> bool:
    """Whether ``holds()`` comes true within ``timeout`` seconds (a state file may not exist yet)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if holds():
                return True
        except FileNotFoundError:
            pass
        time.sleep(0.05)
    return False


def host(coordinator: LocalCoordinator, name: str, seed: int = 0) -> HostRound:
    return HostRound(HostTensors(model(seed)), LocalClient(coordinator, name), PhaseLog(name))


def said(caplog, text: str) -> int:
    return sum(text in m for m in caplog.messages)


# -- a save that fails never stops the run ---------------------------------------------------------------------------


class FullStateDisk:
    """``state/``'s file writes while ``full``: ENOSPC, as on a full disk."""

    def __init__(self, monkeypatch) -> None:
        self.full = False
        self.refused = 0
        write = state_module.write_atomic

        def failing(path: Path, chunks):
            if self.full:
                self.refused += 1
                raise OSError(errno.ENOSPC, "No space left on device")
            return write(path, chunks)

        monkeypatch.setattr(state_module, "write_atomic", failing)


def test_a_round_does_not_close_while_the_state_before_it_cannot_be_saved_and_the_failure_is_said_once(
        tmp_path, monkeypatch, caplog) -> None:
    """A full disk: the round published just before it is the last one, the next round takes its delta but waits
    for the state to reach the disk (a restart could not go behind it), the failure is said once (then at a slow
    interval) and the save tried again on its own; once there is room, the state is saved and the round closes."""
    caplog.set_level("INFO")
    monkeypatch.setattr(Recovery, "RETRY_S", 0.0)  # a failed save is tried again at the next tick
    disk = FullStateDisk(monkeypatch)
    c = LocalCoordinator(tmp_path, 1, store=True, snapshot_every=2)
    a = host(c, "a")
    try:
        a.join()
        assert c.call(c.run.recovery.saved()) is True
        assert run_json(tmp_path)["round"] == 0
        disk.full = True
        train(a, 1, 0)
        assert a.run_round(16, final=False).round == 0  # published; its state's save is refused
        assert c.call(c.run.recovery.saved()) is False
        train(a, 1, 1)
        assert upload(a, samples=16) is Upload.TAKEN
        for _ in range(3):  # the round does not close while each retry is refused
            c.tick()
            c.call(c.run.recovery.saved())
        assert (c.state.round, c.state.published_round, c.run.recovery.durable) == (1, 0, False)
        assert disk.refused >= 4 and run_json(tmp_path)["round"] == 0  # on disk: the last state written whole
        assert said(caplog, SAYS_FAILED) == 1 and said(caplog, "No space left on device") == 1  # said once

        monkeypatch.setattr(Trouble, "REPORT_EVERY", 0.0)  # then at a slow interval (here: at once)
        c.tick()
        c.call(c.run.recovery.saved())
        assert said(caplog, "still cannot be written after") >= 1

        disk.full = False  # room again: the retry writes the state, and the round closes
        c.tick()
        assert c.call(c.run.recovery.saved()) is True and c.run.recovery.durable
        saved = run_json(tmp_path)
        assert (saved["round"], saved["model_hash"]) == (1, a.model_hash)
        c.tick()
        result = a.synchronize()
        assert (result.round, c.state.published_round, a.model_hash) == (1, 1, c.state.model.hash)
        c.call(c.run.recovery.saved())
        assert (run_json(tmp_path)["round"], run_json(tmp_path)["model_hash"]) == (2, a.model_hash)
        assert said(caplog, "writing the run's state in") == 1
        persisted = [e["round"] for e in map(json.loads, (tmp_path / "events.jsonl").read_text().splitlines())
                     if e["phase"] == "persist"]
        assert persisted == [0, 0, 1]  # the saves that reached the disk, by the round they followed
    finally:
        c.close()
    assert run_json(tmp_path)["stopped"] is True


SITE = """
import errno, time
from pathlib import Path
from lightning_nodeox.coordinator import state

_write = state.write_atomic
FLAG, MARK, AT, WHEN = Path({flag!r}), Path({mark!r}), {at!r}, {when!r}


def write_atomic(path, chunks):
    if FLAG.exists():
        raise OSError(errno.ENOSPC, "No space left on device")
    if path.name == AT and WHEN == "before":
        MARK.touch()
        time.sleep(3600)
    out = _write(path, chunks)
    if path.name == AT and WHEN == "after":
        MARK.touch()
        time.sleep(3600)
    return out


state.write_atomic = write_atomic
"""


class Injected:
    """A coordinator process's ``state/`` writes, changed by a ``sitecustomize`` on its PYTHONPATH: they fail
    while ``flag`` exists; the write of the file named ``at`` stops (``before`` or ``after`` it), touching
    ``mark``, until the process is killed."""

    def __init__(self, tmp_path: Path, monkeypatch, at: str = "", when: str = "") -> None:
        site = tmp_path / "site"
        site.mkdir()
        self.flag, self.mark = tmp_path / "disk-full", tmp_path / "stopped-in-save"
        (site / "sitecustomize.py").write_text(SITE.format(flag=str(self.flag), mark=str(self.mark), at=at,
                                                           when=when))
        self.monkeypatch, self.path = monkeypatch, os.environ.get("PYTHONPATH", "")
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(site), self.path) if p))

    def off(self) -> None:
        """Coordinators started from now on write as usual."""
        self.monkeypatch.setenv("PYTHONPATH", self.path)


@pytest.mark.slow
def test_a_coordinator_stopped_after_failed_saves_still_saves_its_state_at_shutdown(coordinator, tmp_path,
                                                                                    monkeypatch) -> None:
    injected = Injected(tmp_path, monkeypatch)
    coord = coordinator(1, "--snapshot-every", "100")
    injected.off()
    a = HostRound(HostTensors(model(0)), HttpClient(coord.url, host="a", retry_for=30), PhaseLog("a"))
    a.join()
    assert eventually(lambda: run_json(coord.run_dir)["round"] == 0)
    injected.flag.touch()  # the disk is full: every later save fails
    train(a, 1, 0)
    assert a.run_round(16, final=False).round == 0  # published; its state's save fails (the next round waits)
    assert eventually(lambda: "cannot write the run's state" in coord.log_path.read_text())
    assert run_json(coord.run_dir)["round"] == 0
    injected.flag.unlink()  # space is back; the shutdown's save comes whatever the retries did
    coord.proc.send_signal(signal.SIGTERM)
    assert coord.wait(30) == 1  # stopped before the run completed
    a.close()
    saved = run_json(coord.run_dir)
    assert (saved["round"], saved["model_hash"], saved["stopped"]) == (1, a.model_hash, True)
    assert (saved["files"]["model"], saved["snapshot_hash"]) == ("model-1.safetensors", a.model_hash)
    log = coord.log_path.read_text()
    assert log.count(SAYS_FAILED) == 1, log
    assert f"the run's state is saved in {coord.run_dir / 'state'} (round 1)" in log


# -- a restart never goes behind what was published ------------------------------------------------------------------

# (where the save of round 2's state stops when the coordinator is killed, the outer optimizer); round 1 is
# published and both hosts hold its model: the sync and snapshot of round 2 are written in that order (its outer
# state was written before round 1's sync was published: test_a_restart_never_goes_behind_a_published_rounds_momentum)
KILL_POINTS = {
    "before anything of it is written": ("sync-2.q4", "before", AVERAGE),
    "after its sync": ("sync-2.q4", "after", AVERAGE),
    "after its snapshot, before run.json": ("model-2.safetensors", "after", AVERAGE),
    "after its sync (Nesterov)": ("sync-2.q4", "after", NESTEROV),
    "after its snapshot, before run.json (Nesterov)": ("model-2.safetensors", "after", NESTEROV),
}


@pytest.mark.slow
@pytest.mark.parametrize("moment", list(KILL_POINTS))
def test_a_coordinator_killed_while_it_saves_resumes_on_the_published_model_not_an_older_snapshot(
        coordinator, uninterrupted, tmp_path, monkeypatch, moment) -> None:  # noqa: F811 - the fixture
    """kill -9 in the middle of the save that follows round 1, with a snapshot every round: run.json and the
    snapshot on disk are of round 1, the hosts hold round 2's model. The restarted coordinator waits for a host
    to give that model back (it does not load its snapshot first) and the run ends bit-identical to one never
    interrupted."""
    killed_while_saving(coordinator, uninterrupted, tmp_path, monkeypatch, *KILL_POINTS[moment])


@pytest.mark.slow
def test_a_restart_never_goes_behind_a_published_rounds_momentum(coordinator, uninterrupted, tmp_path,
                                                                 monkeypatch) -> None:  # noqa: F811 - the fixture
    """Nesterov, kill -9 right after round 1 is published, before anything of the save that follows it is
    written: the momentum of round 2's model was written before its sync went out, so the restart takes it up
    (not round 1's, a step behind) and the run ends bit-identical to one never interrupted."""
    killed_while_saving(coordinator, uninterrupted, tmp_path, monkeypatch, "sync-2.q4", "before", NESTEROV)


def killed_while_saving(coordinator, uninterrupted, tmp_path, monkeypatch, at: str, when: str,
                        outer: tuple[str, ...]) -> None:
    """The run of restarts.run, its coordinator killed where its save after round 1 writes ``at`` (``when``)."""
    injected = Injected(tmp_path, monkeypatch, at, when)
    coord = coordinator(2, *outer, "--snapshot-every", "1")
    injected.off()
    port = coord.url.rsplit(":", 1)[1]
    started = []

    def interrupt() -> None:
        assert eventually(injected.mark.exists)
        coord.proc.send_signal(signal.SIGKILL)
        assert coord.proc.wait(30) == -signal.SIGKILL
        saved = run_json(coord.run_dir)
        assert (saved["round"], saved["snapshot_round"], saved["stopped"]) == (1, 1, False)
        started.append(coordinator(2, "--bind", f"127.0.0.1:{port}", "--snapshot-every", "1", run_dir=coord.run_dir))

    final = uninterrupted(outer)
    assert run(coord.url, interrupt) == [final, final]
    assert started[0].wait(60) == 0
    log = started[0].log_path.read_text()
    assert "model from host" in log and "model from the snapshot" not in log, log
    assert "hosts were at round 2" in log and "one round behind" not in log, log
    assert ("round 1 was published" in log) == (at != "sync-2.q4" or when == "after"), log
    events = [json.loads(line) for line in (coord.run_dir / "events.jsonl").read_text().splitlines()]
    assert [e["round"] for e in events if e["phase"] == "restart"] == [1]
    assert [e["round"] for e in events if e["phase"] == "sync_prepare"] == list(range(ROUNDS))
    assert [e["hosts"] for e in events if e["phase"] == "aggregate" and e["round"] == 2] == [["a", "b"]]
    saved = run_json(coord.run_dir)
    assert (saved["complete"], saved["model_hash"], saved["round"]) == (True, final, ROUNDS)


def test_a_restart_waits_for_its_hosts_and_takes_its_snapshot_once_every_host_is_back_without_a_newer_model(
        tmp_path) -> None:
    """Not saved at shutdown, the snapshot may be behind the hosts: one host that holds no model cannot tell, so the
    run waits; once every host of the run has joined again and none holds a newer model, the snapshot is loaded at
    once (not after the 5 minutes of --provider-timeout)."""
    c = LocalCoordinator(tmp_path, 2, store=True, snapshot_every=1)
    hosts = [host(c, h, seed) for seed, h in enumerate("ab")]
    for h in hosts:
        h.join()
    for k, h in enumerate(hosts, 1):
        train(h, k, 0)
        h.upload(h.encode(h.tensors.live, 16, False))
    assert [h.synchronize().round for h in hosts] == [0, 0]
    assert c.call(c.run.recovery.saved()) is True
    c.crash()
    saved = run_json(tmp_path)
    assert (saved["round"], saved["snapshot_round"], saved["stopped"]) == (1, 1, False)

    again = LocalCoordinator(tmp_path, 2, store=True, long_poll=0.2)
    try:
        assert again.state.model is None  # not loaded at start
        specs = hosts[0].tensors.specs
        reply = again.call(again.membership.join("a", specs, saved["hosts"]["a"]["credential"]))
        assert reply.retry and again.state.model is None  # b may hold the next round's model
        reply = again.call(again.membership.join("b", specs, saved["hosts"]["b"]["credential"]))
        assert (reply.retry, reply.model_hash, again.state.round) == (False, saved["model_hash"], 1)
        assert again.state.model.hash == saved["model_hash"] == hosts[0].model_hash
    finally:
        again.close()


def crashed_after_round_one_was_published(tmp_path: Path, monkeypatch) -> tuple[list[HostRound], str]:
    """Two hosts exchange rounds 0 and 1; the save after round 1 writes its sync, then fails (run.json stays
    that of round 1), and the coordinator crashes. Returns the hosts (they hold round 2's model) and the model
    hash saved in run.json (round 1's)."""
    c = LocalCoordinator(tmp_path, 2, store=True)
    hosts = [host(c, h, seed) for seed, h in enumerate("ab")]
    for h in hosts:
        h.join()
    write = state_module.write_atomic

    def no_run_json_after_round_one(path: Path, chunks):
        if path.name == "run.json" and c.state.round == 2:
            raise OSError(errno.EIO, "Input/output error")
        return write(path, chunks)

    monkeypatch.setattr(state_module, "write_atomic", no_run_json_after_round_one)
    for r in range(2):
        for k, h in enumerate(hosts, 1):
            train(h, k, r)
            h.upload(h.encode(h.tensors.live, 16, False))
        assert [h.synchronize().round for h in hosts] == [r, r]
    assert c.call(c.run.recovery.saved()) is False
    c.crash()
    monkeypatch.setattr(state_module, "write_atomic", write)
    saved = run_json(tmp_path)
    assert saved["round"] == 1 and (tmp_path / "state" / "sync-2.q4").exists()
    return hosts, saved["model_hash"]


def test_once_a_round_is_known_published_only_its_model_is_taken_back(tmp_path, monkeypatch) -> None:
    hosts, saved_hash = crashed_after_round_one_was_published(tmp_path, monkeypatch)
    c = LocalCoordinator(tmp_path, 2, store=True, long_poll=0.2)
    try:
        specs = hosts[0].tensors.specs
        credential = run_json(tmp_path)["hosts"]["a"]["credential"]
        for held, round_ in ((saved_hash, 1), ("f" * 32, 2)):  # the saved (older) model; another "next" model
            reply = c.call(c.membership.join("a", specs, credential, held, round_))
            assert reply.retry and not reply.provide_model
        assert c.state.model is None
        reply = c.call(c.membership.join("a", specs, credential, hosts[0].model_hash, 2))
        assert reply.provide_model
    finally:
        c.close()


def test_a_host_whose_model_has_another_layout_cannot_give_a_saved_runs_model_back(tmp_path, monkeypatch) -> None:
    hosts, _ = crashed_after_round_one_was_published(tmp_path, monkeypatch)
    c = LocalCoordinator(tmp_path, 2, store=True, long_poll=0.2)
    try:
        specs = hosts[0].tensors.specs
        other = (TensorSpec(specs[0].name, specs[0].dtype, (40, 48)),) + tuple(specs[1:])  # transposed
        credential = run_json(tmp_path)["hosts"]["a"]["credential"]
        with pytest.raises(Refusal) as refused:
            c.call(c.membership.join("a", other, credential, hosts[0].model_hash, 2))
        assert refused.value.reason is Reason.INVALID
        message = str(refused.value)
        assert repr(specs[0].name) in message and "Start this host with the run's model" in message and "--fresh" in message
        assert c.state.model is None and c.membership.provider is None
    finally:
        c.close()


# -- credentials are saved when issued --------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_credential_issued_at_a_join_survives_a_crash_and_the_one_it_replaced_stays_refused(coordinator) -> None:
    coord = coordinator(2, "--snapshot-every", "100")

    def joined(name: str, seed: int) -> HostRound:
        h = HostRound(HostTensors(model(seed)), HttpClient(coord.url, host=name, retry_for=30), PhaseLog(name))
        h.join()
        return h

    first, b = joined("a", 0), joined("b", 1)
    assert eventually(lambda: set(run_json(coord.run_dir)["hosts"]) == {"a", "b"})
    replaced = run_json(coord.run_dir)["hosts"]["a"]["credential"]
    first.client.leave()  # the id is free: a new process takes it, with a new credential
    second = joined("a", 0)
    assert eventually(lambda: run_json(coord.run_dir)["hosts"]["a"]["credential"] != replaced)  # before any round

    coord.proc.send_signal(signal.SIGKILL)
    assert coord.wait(30) == -signal.SIGKILL
    port = coord.url.rsplit(":", 1)[1]
    again = coordinator(2, "--bind", f"127.0.0.1:{port}", run_dir=coord.run_dir)
    assert "resuming the run in" in again.log_path.read_text()
    assert second.client.heartbeat() > 0 and b.client.heartbeat() > 0  # the new holder is accepted
    with pytest.raises(Refusal) as refused:
        first.client.heartbeat()
    assert refused.value.reason is Reason.FORBIDDEN
    for h in (first, second, b):
        h.close()


def test_run_json_keeps_the_credential_of_every_join_in_process(tmp_path) -> None:
    c = LocalCoordinator(tmp_path, 2, store=True)
    try:
        a, b = host(c, "a"), host(c, "b", 1)
        a.join()
        b.join()
        a.client.leave()
        again = host(c, "a")
        again.join()
        c.crash()
        saved = run_json(tmp_path)["hosts"]
        assert {h: e["credential"] for h, e in saved.items()} == {"a": again.client.credential,
                                                                  "b": b.client.credential}
        assert again.client.credential != a.client.credential
    finally:
        if c.thread.is_alive():
            c.close()
    resumed = LocalCoordinator(tmp_path, 2, store=True)
    try:
        resumed.membership.authenticate("a", again.client.credential)
        with pytest.raises(Refusal) as refused:
            resumed.membership.authenticate("a", a.client.credential)
        assert refused.value.reason is Reason.FORBIDDEN
    finally:
        resumed.close()



def test_a_host_that_joins_while_the_state_cannot_be_saved_is_told_to_join_again_never_given_a_credential_a_restart_forgets(
        tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(Recovery, "RETRY_S", 0.0)
    disk = FullStateDisk(monkeypatch)
    c = LocalCoordinator(tmp_path, 1, store=True, elastic=True, long_poll=0.2)
    try:
        a = host(c, "a")
        a.join()
        assert c.call(c.run.recovery.saved()) is True
        disk.full = True
        train(a, 1, 0)
        assert a.run_round(16, final=False).round == 0  # its state's save is refused
        b = LocalClient(c, "b")
        specs = [s.as_json() for s in c.state.model.specs]
        reply = b.join(specs)
        assert (reply.retry, reply.credential, b.credential) == (True, "", "")
        assert "b" not in c.state.hosts
        disk.full = False
        c.tick()  # the retried save reaches the disk
        assert c.call(c.run.recovery.saved()) is True
        reply = b.join(specs)
        assert not reply.retry and b.credential
        assert run_json(tmp_path)["hosts"]["b"]["credential"] == b.credential  # on disk when the reply came
    finally:
        c.close()
