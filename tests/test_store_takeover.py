"""A run that outlives its machine: coordinator processes sharing one object store (``--store``). While one holds
the run's lease a second refuses at once (exit status 2) naming it; once the first is killed with its machine, a
second started again and again (as a supervisor would) takes the run up within the lease's length, on an empty run
directory, and the run completes as if never interrupted."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from helpers import Coordinator, assert_identical, forked, model, published, read_events, start_host, stop, wait_for
from restarts import NESTEROV, ROUNDS, run

from lightning_nodeox.coordinator.lease import LEASE_KEY, Holder
from lightning_nodeox.core.phases import PhaseLog
from lightning_nodeox.core.stores import StoreMissing, open_store
from lightning_nodeox.core.wire import Message
from lightning_nodeox.host.client import HttpClient
from lightning_nodeox.host.round import HostRound
from lightning_nodeox.host.tensors import HostTensors

pytestmark = pytest.mark.slow  # every test here starts processes

# Each test runs on one kind of store, both kinds among them (the store's rules, on both kinds, are test_stores.py's
# and test_store_state.py's; hosts reading from either, test_store_payloads.py's): each end-to-end run once.
ON_S3 = pytest.mark.parametrize("store_url", ["s3"], indirect=True)
ON_FILES = pytest.mark.parametrize("store_url", ["file"], indirect=True)

TTL = 3.0  # --store-lease: how long a coordinator killed with its machine keeps the run from its successor
LEASED = ("--store-lease", f"{TTL:g}")


def stored_round(store) -> int:
    """The round of the run's state in the store (-1: none yet)."""
    try:
        return json.loads(store.get("state/run.json"))["round"]
    except StoreMissing:
        return -1


def whole_syncs(store) -> set[int]:
    """The rounds whose sync the store holds whole (hosts read syncs only from the store: a host can have applied
    only these)."""
    parts: dict[tuple[int, str], list[str]] = {}
    for key in store.keys("syncs/"):
        _, round_, upload, _ = key.split("/")  # syncs/<round>/<upload>/<part>
        parts.setdefault((int(round_), upload), []).append(key)
    whole = set()
    for (round_, _), keys in parts.items():
        try:
            Message.parse(b"".join(store.get(k) for k in sorted(keys)))
        except (ValueError, StoreMissing):  # a part not written yet: the message is cut short
            continue
        whole.add(round_)
    return whole


def holder(store) -> Holder | None:
    try:
        return Holder.from_bytes(store.get(LEASE_KEY))
    except StoreMissing:
        return None


def take_over(coordinator, hosts: int, *args: str, run_dir, timeout: float = 60) -> tuple[Coordinator, int]:
    """Start a coordinator again and again, as a supervisor would, until one is not refused for the lease; returns
    it and how many were refused (each of them naming the run's holder)."""
    deadline, refused = time.monotonic() + timeout, 0
    while True:
        try:
            return coordinator(hosts, *args, run_dir=run_dir), refused
        except RuntimeError as e:
            assert "another coordinator holds the run in" in str(e), str(e)[-3000:]
            refused += 1
            assert time.monotonic() < deadline, "no coordinator took the run over"


@ON_S3  # a real conditional put decides whose lease it is
def test_a_second_coordinator_is_refused_at_once_naming_the_first_and_takes_over_once_it_is_killed(
        coordinator, store_url, tmp_path) -> None:
    store = open_store(store_url)
    first = coordinator(1, "--store", store_url, *LEASED)
    host = HostRound(HostTensors(model(0)), HttpClient(first.url, host="a", retry_for=5), PhaseLog("a"))
    host.join()  # it provides the model: round 0's state is saved, and copied to the store
    wait_for(lambda: stored_round(store) == 0 and holder(store).url == first.url, 20, "the state and the lease's URL")

    began = time.monotonic()
    second = subprocess.run(forked([sys.executable, "-m", "lightning_nodeox", "coordinator", "--hosts", "1",
                                    "--run-dir", str(tmp_path / "other"), "--bind", "127.0.0.1:0", "--threads", "1",
                                    "--store", store_url, *LEASED]),
                            capture_output=True, text=True, timeout=60, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert second.returncode == 2, second.stdout + second.stderr
    assert time.monotonic() - began < 30
    (line,) = [line for line in second.stderr.splitlines() if "holds the run" in line]
    assert f"pid {first.pid} on" in line and f"({first.url})" in line and "expires at" in line, line
    assert not (tmp_path / "other" / "state").exists()  # nothing taken up

    first.proc.send_signal(signal.SIGKILL)
    assert first.proc.wait(30) == -signal.SIGKILL
    killed = time.monotonic()
    left = holder(store)
    assert left.pid == first.pid and left.expires_at > time.time()  # the lease it left behind holds the run still
    again, refused = take_over(coordinator, 1, "--store", store_url, *LEASED, run_dir=tmp_path / "other")
    assert time.monotonic() - killed < TTL + 15, "taken over within the lease's length (and a start's)"
    log = again.log_path.read_text()
    assert f"the run was taken up from the store {store_url} at round 0" in log, log
    wait_for(lambda: holder(store).pid == again.pid, 10, "the lease to name the new coordinator")
    again.proc.send_signal(signal.SIGTERM)
    assert again.wait(30) == 1  # stopped before the run completed
    assert holder(store) is None, "a clean shutdown releases the lease"


@ON_FILES
def test_a_lost_machine_run_completes_on_another_coordinator_from_the_store_as_if_never_interrupted(
        coordinator, uninterrupted, store_url) -> None:
    """Nesterov (its momentum must come back too): kill -9 mid-round 2 (host a's delta sent), the run directory
    deleted, a coordinator on an empty run directory at the same address, with the same --store and no outer flags:
    the hosts ride it out and end on the uninterrupted run's model; no round published before is published again."""
    store = open_store(store_url)
    coord = coordinator(2, *NESTEROV, "--store", store_url, *LEASED)
    port = coord.url.rsplit(":", 1)[1]
    before, started = {}, []

    def lose_the_machine() -> None:
        wait_for(lambda: stored_round(store) >= 2, 10, "round 2's state in the store")
        coord.proc.send_signal(signal.SIGKILL)
        assert coord.proc.wait(30) == -signal.SIGKILL
        before.update(published(coord.run_dir))
        shutil.rmtree(coord.run_dir)
        started.append(take_over(coordinator, 2, "--bind", f"127.0.0.1:{port}", "--store", store_url, *LEASED,
                                 run_dir=coord.run_dir)[0])

    final = uninterrupted(NESTEROV)
    assert run(coord.url, lose_the_machine) == [final, final]
    (again,) = started
    assert again.wait(60) == 0
    log = again.log_path.read_text()
    assert f"taken up from the store {store_url} at round 2" in log and "model from host" in log, log
    events = read_events(again.run_dir)
    assert [e["round"] for e in events if e["phase"] == "restart"] == [2]
    assert sorted(before) == [0, 1]
    assert [e["round"] for e in events if e["phase"] == "sync_prepare"] == list(range(2, ROUNDS))
    assert published(again.run_dir)[ROUNDS - 1]["model_hash"] == final


@ON_S3  # hosts read the syncs through presigned URLs while the store changes hands
def test_a_lost_machine_run_with_host_processes_completes_on_another_coordinator_bit_identical(
        coordinator, store_url, tmp_path) -> None:
    """Digits hosts (never restarted) train on while the coordinator's machine is lost mid-run and another takes
    the run up from the store on an empty run directory at the same address."""
    store = open_store(store_url)
    coord = coordinator(2, "--store", store_url, *LEASED)
    out = tmp_path / "out"
    procs = [start_host(h, coord.url, out, "--max-steps", "80", "--local-steps", "10", "--step-seconds", "0.05")
             for h in "01"]
    try:
        wait_for(lambda: 2 in published(coord.run_dir) and stored_round(store) >= 2, 120, "round 2 in the store")
        coord.proc.send_signal(signal.SIGKILL)
        assert coord.proc.wait(30) == -signal.SIGKILL
        before, readable = published(coord.run_dir), whole_syncs(store)
        shutil.rmtree(coord.run_dir)
        port = coord.url.rsplit(":", 1)[1]
        again, _ = take_over(coordinator, 2, "--bind", f"127.0.0.1:{port}", "--store", store_url, *LEASED,
                             run_dir=coord.run_dir)
        assert [p.wait(240) for p in procs] == [0, 0], "the hosts were never restarted and ended well"
        assert again.wait(60) == 0
    finally:
        stop(procs)
    assert "the run was taken up from the store" in again.log_path.read_text()
    after = published(again.run_dir)
    # no round a host could have applied was done again: at most the one whose sync was still being written
    assert min(after) > max(readable, default=-1) and min(after) >= max(before), (sorted(before), sorted(readable), sorted(after))
    assert sorted(after) == list(range(min(after), max(after) + 1)) and max(after) > min(after) + 2
    assert assert_identical(out, ["0", "1"]) == after[max(after)]["model_hash"]


@ON_FILES
def test_a_coordinator_whose_lease_another_took_stops_at_once_writing_nothing_more_to_the_store(
        coordinator, store_url) -> None:
    store = open_store(store_url)
    coord = coordinator(1, "--store", store_url, *LEASED)
    host = HostRound(HostTensors(model(0)), HttpClient(coord.url, host="a", retry_for=5), PhaseLog("a"))
    host.join()
    wait_for(lambda: stored_round(store) == 0, 20, "round 0's state in the store")
    saved = store.get("state/run.json")
    _, tag = store.get_tagged(LEASE_KEY)
    other = Holder(4242, "elsewhere", time.time(), time.time(), TTL, "http://elsewhere:8470")
    assert store.replace(LEASE_KEY, other.to_bytes(), tag) is not None
    assert coord.wait(TTL + 10) == 1
    log = coord.log_path.read_text()
    assert "another coordinator took the run over: pid 4242 on elsewhere (http://elsewhere:8470)" in log, log
    assert "stopped: the run's lease" in log
    assert holder(store) == other and store.get("state/run.json") == saved  # no shutdown save reached the store
