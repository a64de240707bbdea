"""A run you can trust with its own disk: one coordinator per run directory, a new run moves aside only what a
run wrote, damaged state is refused naming --fresh, and the events log and TensorBoard recover with the disk."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests
import torch
from helpers import Coordinator, TwoOptimizers, data, forked, model
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.loggers import TensorBoardLogger
from local_transport import LocalClient
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.summary.writer.record_writer import RecordWriter

from lightning_nodeox import NodeoxStrategy, PhaseMonitor
from lightning_nodeox.coordinator.config import CoordinatorConfig
from lightning_nodeox.coordinator.lock import LOCK_FILE
from lightning_nodeox.coordinator.runlog import LineFile, RunLog, Trouble, tag
from lightning_nodeox.coordinator.state import take_up
from lightning_nodeox.core.eventfiles import RetryingEventWriter
from lightning_nodeox.core.phases import PhaseLog, PhaseRecord
from lightning_nodeox.host.client import HttpClient
from lightning_nodeox.host.round import HostRound
from lightning_nodeox.host.tensors import HostTensors

ENOSPC = OSError(errno.ENOSPC, "No space left on device")


def start_coordinator(run_dir: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """A `nodeox coordinator` expected to refuse (it is not waited for to serve), forked from the zygote."""
    return subprocess.run(forked(
        [sys.executable, "-m", "lightning_nodeox", "coordinator", "--hosts", "1", "--run-dir", str(run_dir), "--bind",
         "127.0.0.1:0", "--threads", "1", *args]), check=False, capture_output=True, text=True, timeout=timeout,
        env=dict(os.environ, PYTHONUNBUFFERED="1"))


# -- one coordinator per run directory -------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_second_coordinator_on_a_run_directory_refuses_at_once_naming_the_first(coordinator, tmp_path) -> None:
    first = coordinator(1, run_dir=tmp_path / "run")
    before = {name: (first.run_dir / name).read_text() for name in (LOCK_FILE, "coordinator.json")}
    began = time.monotonic()
    second = start_coordinator(first.run_dir)
    assert second.returncode == 2, second.stderr
    assert time.monotonic() - began < 30  # at once: no wait for a lease or a timeout
    assert f"another coordinator holds {first.run_dir} (pid {first.pid} on {socket.gethostname()}" in second.stderr
    assert "Traceback" not in second.stderr
    assert {name: (first.run_dir / name).read_text() for name in before} == before  # the second changed nothing
    assert json.loads(before[LOCK_FILE])["pid"] == first.pid
    assert requests.get(f"{first.url}/v1/status", timeout=10).json()["round"] == 0  # the first serves on

    first.proc.send_signal(signal.SIGKILL)  # the kernel releases the lock of a process that dies
    assert first.wait(30) == -signal.SIGKILL
    again = coordinator(1, run_dir=first.run_dir)
    assert requests.get(f"{again.url}/v1/status", timeout=10).json()["round"] == 0
    assert json.loads((again.run_dir / LOCK_FILE).read_text())["pid"] == again.pid


# -- a new run moves aside what a run wrote, and nothing else --------------------------------------------------------


@pytest.mark.slow
def test_a_new_run_moves_aside_only_the_records_a_run_wrote(coordinator, tmp_path) -> None:
    run_dir = tmp_path / "run"
    for name in ("state/run.json", "events.jsonl", "tb/coordinator/events.out", "hosts/host0/ckpt", "coordinator.json"):
        (run_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (run_dir / name).write_text(f"earlier {name}")
    (run_dir / "my-notes.txt").write_text("mine")
    (run_dir / "train.log").write_text("my own log")
    (run_dir / "data").mkdir()
    (run_dir / "data" / "x.csv").write_text("1,2")

    coord = coordinator(1, "--fresh", run_dir=run_dir)
    (previous,) = run_dir.glob("previous-*")
    assert f"the earlier records are now in {previous}" in coord.log_path.read_text()
    assert sorted(p.name for p in previous.iterdir()) == ["coordinator.json", "events.jsonl", "hosts", "state", "tb"]
    assert (previous / "hosts" / "host0" / "ckpt").read_text() == "earlier hosts/host0/ckpt"
    assert (previous / "state" / "run.json").read_text() == "earlier state/run.json"
    assert (run_dir / "my-notes.txt").read_text() == "mine"
    assert (run_dir / "train.log").read_text() == "my own log"
    assert (run_dir / "data" / "x.csv").read_text() == "1,2"
    assert not (run_dir / "state").exists() and not (run_dir / "hosts").exists()


# -- damaged state is refused, naming --fresh ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved_state(tmp_path_factory) -> Path:
    """The state/ of a real run stopped (SIGTERM) after one round, with Nesterov: run.json, sync, outer, model."""
    root = tmp_path_factory.mktemp("saved")
    coord = Coordinator(root / "run", 1, "--outer-optimizer", "nesterov", "--snapshot-every", "1")
    try:
        host = HostRound(HostTensors(model(0)), HttpClient(coord.url, host="a", retry_for=30), PhaseLog("a"))
        host.join()
        with torch.no_grad():
            host.tensors.live[0].add_(0.01)
        assert host.run_round(16, final=False).round == 0
        host.close()
    finally:
        coord.stop()
    state = root / "run" / "state"
    names = json.loads((state / "run.json").read_text())["files"]
    assert sorted(names) == ["model", "outer", "sync"]
    return state


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def _edit_run(change) -> callable:
    def edit(path: Path) -> None:
        d = json.loads(path.read_text())
        change(d)
        path.write_text(json.dumps(d))
    return edit


def _garble_header(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[8:24] = b"}{ not json at a"
    path.write_bytes(bytes(data))


# name: (the file of state/ that is damaged: run.json or the kind run.json names it by, the damage)
DAMAGE = {
    "run.json truncated": ("run.json", _truncate),
    "run.json whose hosts are a list": ("run.json", _edit_run(lambda d: d.update(hosts=[1]))),
    "run.json with a host state this version does not know": (
        "run.json", _edit_run(lambda d: d["hosts"]["a"].update(state="sleeping"))),
    "the sync with a flipped byte": ("sync", _flip_last_byte),
    "the outer state truncated": ("outer", _truncate),
    "the outer state with a flipped byte": ("outer", _flip_last_byte),  # its size and header still right
    "the snapshot's header garbled": ("model", _garble_header),
    "the snapshot missing": ("model", lambda path: path.unlink()),
    "the snapshot with a flipped byte": ("model", _flip_last_byte),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(DAMAGE))
def test_damaged_state_is_refused_naming_fresh_not_a_traceback(saved_state: Path, tmp_path, name: str) -> None:
    which, damage = DAMAGE[name]
    run_dir = tmp_path / "run"
    shutil.copytree(saved_state, run_dir / "state")
    file = which if which == "run.json" else json.loads((saved_state / "run.json").read_text())["files"][which]
    damage(run_dir / "state" / file)
    left = sorted(p.name for p in (run_dir / "state").iterdir())
    result = start_coordinator(run_dir)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    message = result.stderr.strip().splitlines()[-1]
    assert message.startswith(f"nodeox coordinator: {run_dir / 'state' / file} ") and "start with --fresh" in message
    assert sorted(p.name for p in (run_dir / "state").iterdir()) == left  # nothing removed nor moved aside


# name: (what run.json is changed to, the file of state/ named as disagreeing, what run.json says that file holds)
DISAGREE = {
    "run.json a round ahead": (lambda d: d.update(round=d["round"] + 1), "sync", "round 1"),
    "run.json a round ahead, without its sync": (lambda d: (d.update(round=d["round"] + 1), d["files"].pop("sync")),
                                                 "outer", "round 2 (model {model_hash})"),
    "run.json naming another model": (lambda d: d.update(model_hash="0" * 16), "outer",
                                      "round 1 (model 0000000000000000)"),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(DISAGREE))
def test_a_run_json_whose_round_disagrees_with_its_files_is_refused_naming_the_file_and_fresh(
        saved_state: Path, tmp_path, name: str) -> None:
    change, which, says = DISAGREE[name]
    run_dir = tmp_path / "run"
    shutil.copytree(saved_state, run_dir / "state")
    run_file = run_dir / "state" / "run.json"
    saved = json.loads(run_file.read_text())
    _edit_run(change)(run_file)
    edited = json.loads(run_file.read_text())
    before = {p.name: p.read_bytes() for p in (run_dir / "state").iterdir()}
    with pytest.raises(ValueError) as refused:
        take_up(CoordinatorConfig(hosts=1, run_dir=run_dir))
    message = str(refused.value)
    file = run_dir / "state" / saved["files"][which]
    holds = "round 0" if which == "sync" else f"round 1 (model {saved['model_hash']})"
    assert message == (f"{file} holds {holds} but {run_file} (round {edited['round']}) says it holds "
                       f"{says.format(model_hash=saved['model_hash'])}: they come from different saves. Put back the "
                       "files saved together, or start with --fresh to begin a new run (the old records are moved "
                       "aside; nothing is deleted)")
    assert {p.name: p.read_bytes() for p in (run_dir / "state").iterdir()} == before  # nothing lost
    assert not list(run_dir.glob("previous-*"))


@pytest.mark.slow
@pytest.mark.parametrize("left", ["the events log", "state/ without run.json"])
def test_a_run_whose_state_is_gone_is_refused_naming_fresh_not_started_over(saved_state: Path, tmp_path,
                                                                            left: str) -> None:
    """``state/`` deleted (or its run.json) while hosts wait out a restart: a new run at round 0 would leave them
    waiting on a run that is gone; the coordinator refuses, and --fresh starts over explicitly."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    shutil.copy(saved_state.parent / "events.jsonl", run_dir / "events.jsonl")
    if left == "state/ without run.json":
        shutil.copytree(saved_state, run_dir / "state")
        (run_dir / "state" / "run.json").unlink()
    result = start_coordinator(run_dir)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    (message,) = result.stderr.strip().splitlines()
    assert message.startswith(f"nodeox coordinator: {run_dir} holds the records of a run whose state was saved (")
    assert message.endswith(f"but no {run_dir / 'state' / 'run.json'}: its state was deleted or moved. Put "
                            f"{run_dir / 'state'} back to resume the run, or start with --fresh to begin a new run "
                            "(the old records are moved aside)")
    assert not list(run_dir.glob("previous-*")) and (run_dir / "events.jsonl").exists()  # nothing moved

    config, saved = take_up(CoordinatorConfig(hosts=1, run_dir=run_dir, fresh=True))
    assert saved is None
    (previous,) = run_dir.glob("previous-*")
    assert (previous / "events.jsonl").exists() and not (run_dir / "events.jsonl").exists()


@pytest.mark.slow
def test_undamaged_state_resumes(coordinator, saved_state: Path, tmp_path) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(saved_state, run_dir / "state")
    coord = coordinator(1, run_dir=run_dir)
    assert "resuming the run in" in coord.log_path.read_text()
    assert requests.get(f"{coord.url}/v1/status", timeout=10).json()["round"] == 1


# -- the events log and TensorBoard recover when the disk does -------------------------------------------------------


def record(round_: int, host: str = "a") -> PhaseRecord:
    return PhaseRecord(round_, host, "encode", 100.0 + round_, 100.5 + round_, 1000 + round_)


class FullDisk:
    """``LineFile``'s writes while ``full``: half the bytes reach the file, then ENOSPC (a write cut mid-line)."""

    def __init__(self, monkeypatch) -> None:
        self.full = False
        self.calls = 0
        monkeypatch.setattr(LineFile, "_write", staticmethod(self.write))

    def write(self, fd: int, data: memoryview) -> int:
        self.calls += 1
        if self.full:
            os.write(fd, data[: max(1, len(data) // 2)])
            raise ENOSPC
        return os.write(fd, data)


def lines(run_dir: Path) -> list[dict]:
    text = (run_dir / "events.jsonl").read_text()
    assert text.endswith("\n")
    return [json.loads(line) for line in text.splitlines()]  # every line parses


def test_the_events_log_keeps_every_record_across_a_full_disk_and_never_holds_part_of_a_line(
        tmp_path, monkeypatch, caplog) -> None:
    monkeypatch.setattr(RunLog, "_tb", lambda self, r: None)  # TensorBoard has its own test
    disk = FullDisk(monkeypatch)
    runlog = RunLog(tmp_path)
    runlog.write([record(0), record(1)])
    disk.full = True
    caplog.set_level("WARNING", logger="lightning_nodeox.coordinator.runlog")
    for r in (2, 3, 4):
        runlog.write([record(r)])
        assert [e["round"] for e in lines(tmp_path)] == [0, 1]  # the half-written line was cut back
    errors = [m for m in caplog.messages if "cannot" in m]
    assert len(errors) == 1 and "cannot write" in errors[0] and "No space left" in errors[0]  # said once
    monkeypatch.setattr(Trouble, "REPORT_EVERY", 0.0)  # then at a slow interval (here: at once)
    runlog.write([record(5)])
    assert sum("still cannot be written" in m for m in caplog.messages) == 1
    disk.full = False
    runlog.write([record(6)])
    runlog.write([record(7)])
    runlog.close()
    assert [e["round"] for e in lines(tmp_path)] == list(range(8))  # those of the outage too, in order
    assert [e["bytes"] for e in lines(tmp_path)] == [1000 + r for r in range(8)]
    assert any("writing" in m and "again" in m and "0 records lost" in m for m in caplog.messages)


def test_an_events_log_left_with_part_of_a_line_is_cut_back_to_its_last_whole_line(tmp_path, caplog) -> None:
    whole = json.dumps(record(0).to_json(), separators=(",", ":")) + "\n"
    (tmp_path / "events.jsonl").write_text(whole + whole[:30])  # an earlier coordinator died mid-line
    runlog = RunLog(tmp_path)
    runlog.write([record(1)])
    runlog.close()
    assert [e["round"] for e in lines(tmp_path)] == [0, 1]
    assert any("ended in part of a line" in m for m in caplog.messages)


def test_records_beyond_what_a_failing_log_can_hold_are_counted_and_the_rest_written(tmp_path, monkeypatch,
                                                                                     caplog) -> None:
    monkeypatch.setattr(RunLog, "_tb", lambda self, r: None)
    one_line = len(json.dumps(record(0).to_json(), separators=(",", ":"))) + 1
    monkeypatch.setattr(LineFile, "MAX_PENDING", 3 * one_line + 5)  # room for three records
    disk = FullDisk(monkeypatch)
    runlog = RunLog(tmp_path)
    disk.full = True
    caplog.set_level("WARNING", logger="lightning_nodeox.coordinator.runlog")
    for r in range(5):
        runlog.write([record(r)])
    disk.full = False
    runlog.write([record(5)])
    runlog.close()
    assert [e["round"] for e in lines(tmp_path)] == [3, 4, 5]  # at most three wait: the oldest were dropped
    assert any("3 records lost" in m for m in caplog.messages)


def tb_steps(folder: Path, name: str) -> list[int]:
    acc = EventAccumulator(str(folder))
    acc.Reload()
    return sorted(e.step for e in acc.Scalars(name))


def test_tensorboard_writes_again_once_the_disk_recovers(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(RunLog, "RETRY_S", 0.0)
    write = RecordWriter.write
    full = {"on": False}

    def failing(self, data):
        if full["on"]:
            raise ENOSPC
        return write(self, data)

    monkeypatch.setattr(RecordWriter, "write", failing)
    runlog = RunLog(tmp_path)
    runlog.write([record(0)])
    runlog.flush()
    full["on"] = True
    runlog.write([record(1)])
    runlog.flush()  # the writer's thread dies on the failed write; the writer is dropped
    assert "a" not in runlog._writers
    runlog.write([record(2)])  # a new writer, whose thread dies too
    runlog.flush()
    full["on"] = False
    for r in (3, 4, 5):
        runlog.write([record(r)])  # no error: the scalars go to a writer made again
    runlog.close()
    steps = tb_steps(tmp_path / "tb" / "host_a", tag("a", "encode"))
    assert steps == [0, 3, 4, 5]
    assert [e["round"] for e in lines(tmp_path)] == list(range(6))  # events.jsonl was never affected


class FullEventFiles:
    """TensorBoard's record writes while ``on``: ENOSPC (its writer thread dies on it)."""

    def __init__(self, monkeypatch) -> None:
        self.on = False
        write = RecordWriter.write

        def failing(writer, data):
            if self.on:
                raise ENOSPC
            return write(writer, data)

        monkeypatch.setattr(RecordWriter, "write", failing)


class ThreadErrors:
    """The exceptions that reach ``threading.excepthook`` (what Python would print as a thread's traceback)."""

    def __init__(self, monkeypatch) -> None:
        self.seen: list[BaseException] = []
        monkeypatch.setattr(threading, "excepthook", lambda args: self.seen.append(args.exc_value))


def test_a_tensorboard_writer_thread_that_dies_on_a_full_disk_prints_no_traceback(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(RunLog, "RETRY_S", 0.0)
    disk, thread_errors = FullEventFiles(monkeypatch), ThreadErrors(monkeypatch)
    runlog = RunLog(tmp_path)
    runlog.write([record(0)])
    runlog.flush()
    disk.on = True
    runlog.write([record(1)])
    runlog.flush()  # the writer's thread died on the failed write
    assert "a" not in runlog._writers
    disk.on = False
    runlog.write([record(2)])
    runlog.close()
    assert thread_errors.seen == []
    assert tb_steps(tmp_path / "tb" / "host_a", tag("a", "encode")) == [0, 2]


class DiskFullFor(Callback):
    """The disk is full from batch ``first`` up to (not including) batch ``last``."""

    def __init__(self, disk: FullEventFiles, first: int, last: int) -> None:
        self.disk, self.first, self.last = disk, first, last

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        self.disk.on = self.first <= batch_idx < self.last


def test_a_full_disk_is_one_line_on_a_host_and_training_goes_on_and_its_logs_follow_once_there_is_room(
        local_coordinator, tmp_path, monkeypatch, caplog) -> None:
    monkeypatch.setattr(RetryingEventWriter, "RETRY_S", 0.0)  # made again at the first event the disk takes
    disk, thread_errors = FullEventFiles(monkeypatch), ThreadErrors(monkeypatch)
    c = local_coordinator(1)
    strategy = NodeoxStrategy(coordinator_url="http://unused.invalid", host_id="solo", local_steps=4,
                              client=lambda conn: LocalClient(c, conn.host_id))
    logger = TensorBoardLogger(tmp_path / "logs", name="tb")
    trainer = Trainer(strategy=strategy, logger=logger, callbacks=[PhaseMonitor(), DiskFullFor(disk, 3, 7)],
                      max_steps=2 * 10, log_every_n_steps=1, default_root_dir=tmp_path, enable_progress_bar=False,
                      enable_checkpointing=False, enable_model_summary=False)
    caplog.set_level("WARNING")
    trainer.fit(TwoOptimizers(), data())
    assert trainer.global_step == 20 and strategy.last_result.complete  # training went on through the outage
    said = [m for m in caplog.messages if m.startswith("NodeoxStrategy:")]  # (the coordinator's TensorBoard too)
    failed = [m for m in said if "cannot" in m]
    assert len(failed) == 1  # one line for the whole outage
    assert failed[0].startswith(f"NodeoxStrategy: cannot write TensorBoard events in {logger.log_dir} (")
    assert "No space left on device" in failed[0]
    assert sum("writing TensorBoard events in" in m and "again after" in m for m in said) == 1
    assert thread_errors.seen == []
    assert tb_steps(Path(logger.log_dir), "loss_a") == [0, 1, 2, 7, 8, 9]  # batches 3-6 logged on a full disk
