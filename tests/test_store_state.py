"""The run's state in its object store, without processes: the lease that keeps one coordinator per run (taken,
refused while another holds it, taken over once expired, lost, released) and the copy of ``state/`` (what the store
holds after each save, what it drops, its catch-up after the store failed, taking it up on an empty run directory)."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from lightning_nodeox.coordinator.claim import claim_store
from lightning_nodeox.coordinator.config import CoordinatorConfig, OuterSettings
from lightning_nodeox.coordinator.lease import LEASE_KEY, Holder, Lease, LeaseKeeper, LeaseLost, LeaseRefused
from lightning_nodeox.coordinator.state import RunStore, SavedRun, tensor_chunks
from lightning_nodeox.coordinator.statecopy import PREFIX, StateCopy
from lightning_nodeox.core.codecs.settings import Q4Settings
from lightning_nodeox.core.hashing import model_hash
from lightning_nodeox.core.stores import StoreUnavailable, open_store

NAME = "nodeox coordinator"


class Flaky:
    """A store whose every call fails (:class:`StoreUnavailable`) while ``down``; ``puts``: the keys written."""

    def __init__(self, store) -> None:
        self.store, self.down, self.puts = store, False, []
        self.url = store.url

    def __getattr__(self, name: str):
        call = getattr(self.store, name)

        def wrapped(*args, **kwargs):
            if self.down:
                raise StoreUnavailable(f"{self.url} does not answer (test)")
            if name in ("put", "create", "replace"):
                self.puts.append(args[0])
            return call(*args, **kwargs)

        return wrapped


# -- the lease ----------------------------------------------------------------------------------------------------


def expired_holder(store, ttl: float = 3.0) -> None:
    """A lease left by a coordinator gone long ago (pid 1 on another machine)."""
    old = Holder(1, "gone-machine", time.time() - 100, time.time() - 2 * ttl, ttl, "http://gone:8470")
    assert store.create(LEASE_KEY, old.to_bytes()) is not None


def test_a_lease_is_taken_once_and_a_second_coordinator_is_refused_naming_the_holder_and_its_expiry(store_url):
    store = open_store(store_url)
    first = Lease(store, 30.0)
    first.acquire()
    holder = Holder.from_bytes(store.get(LEASE_KEY))
    assert (holder.pid, holder.host, holder.ttl) == (os.getpid(), socket.gethostname(), 30.0)
    first.url = "http://10.0.0.1:8470"
    first.renew()
    with pytest.raises(LeaseRefused) as refused:
        Lease(store, 30.0).acquire()
    said = str(refused.value)
    assert f"pid {os.getpid()} on {socket.gethostname()} (http://10.0.0.1:8470)" in said
    renewed = Holder.from_bytes(store.get(LEASE_KEY)).renewed_at  # the expiry is the renewal's, not the clock's now
    assert f"expires at {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(renewed + 30))}" in said, said
    assert first.held


def test_an_expired_lease_is_taken_over_and_its_old_holder_finds_it_lost_and_releases_nothing(store_url):
    store = open_store(store_url)
    old = Lease(store, 3.0)
    old.acquire()
    _, tag = store.get_tagged(LEASE_KEY)
    stale = Holder.from_bytes(store.get(LEASE_KEY))
    assert store.replace(LEASE_KEY, Holder(stale.pid, stale.host, stale.started, time.time() - 10, 3.0).to_bytes(),
                         tag)  # its machine stopped renewing it 10 s ago
    old._tag = store.get_tagged(LEASE_KEY)[1]
    new = Lease(store, 3.0)
    new.url = "http://new:8470"
    new.acquire()
    with pytest.raises(LeaseLost, match="another coordinator took the run over: .*http://new:8470"):
        old.renew()
    old.release()  # not ours any more: left alone
    assert Holder.from_bytes(store.get(LEASE_KEY)).url == "http://new:8470"
    new.release()
    assert store.keys() == []
    Lease(store, 3.0).acquire()  # a successor need not wait


def test_of_two_coordinators_taking_over_one_expired_lease_at_once_one_wins_the_other_is_refused(store_url):
    store = open_store(store_url)
    expired_holder(store)
    flaky = Flaky(store)
    winner = Lease(store, 3.0)
    read = flaky.store.get_tagged

    def read_then_lose_the_race(key):
        found = read(key)  # the expired lease, as the loser read it ...
        winner.acquire()  # ... before the winner replaced it
        return found

    flaky.get_tagged = read_then_lose_the_race
    with pytest.raises(LeaseRefused, match=f"pid {os.getpid()}"):
        Lease(flaky, 3.0).acquire()
    assert winner.held and Holder.from_bytes(store.get(LEASE_KEY)).pid == os.getpid()


def keep(keeper: LeaseKeeper, until, timeout: float = 10.0) -> None:
    """Tick ``keeper`` as the coordinator does (4 times a second) until ``until()`` holds."""

    async def ticking() -> None:
        deadline = time.monotonic() + timeout
        while not until():
            assert time.monotonic() < deadline, "timed out ticking the lease"
            await keeper.tick()
            await asyncio.sleep(0.05)

    asyncio.run(ticking())


def test_renewals_keep_the_lease_and_one_that_finds_it_taken_stops_the_coordinator(store_url, caplog):
    store = open_store(store_url)
    lease = Lease(store, 0.6)
    lease.acquire()
    keeper = LeaseKeeper(lease, NAME)
    first = Holder.from_bytes(store.get(LEASE_KEY)).renewed_at
    keep(keeper, lambda: Holder.from_bytes(store.get(LEASE_KEY)).renewed_at > first + 0.5)
    assert not keeper.lost.is_set()
    _, tag = store.get_tagged(LEASE_KEY)
    store.replace(LEASE_KEY, Holder(4242, "other", time.time(), time.time(), 0.6).to_bytes(), tag)
    keep(keeper, keeper.lost.is_set)
    assert any("another coordinator took the run over: pid 4242 on other" in m and "stops at once" in m
               for m in caplog.messages)


def test_a_store_unreachable_for_the_leases_length_stops_the_coordinator_and_is_said_once(store_url, caplog):
    flaky = Flaky(open_store(store_url))
    lease = Lease(flaky, 0.6)
    lease.acquire()
    keeper = LeaseKeeper(lease, NAME)
    flaky.down = True
    began = time.monotonic()
    keep(keeper, keeper.lost.is_set)
    assert 0.6 <= time.monotonic() - began < 3
    assert sum("cannot write the run's lease" in m for m in caplog.messages) == 1
    assert any("could not be renewed for 1 s" in m or "could not be renewed for 0 s" in m for m in caplog.messages)


# -- the state's copy ---------------------------------------------------------------------------------------------


def tensors(round_: int) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(round_)
    return [("w", torch.randn(30, 20, generator=gen)), ("b", torch.randn(30, generator=gen))]


def save(store: RunStore, round_: int, *, snapshot: bool = True) -> SavedRun:
    """Round ``round_``'s state, as the coordinator saves it (the outer state ahead, then the rest)."""
    named = tensors(round_)
    h = model_hash(named)
    saved = SavedRun(round=round_, model_hash=h, complete=False, hosts={"a": {"state": "training", "credential": "c"}},
                     codec=Q4Settings(), outer=OuterSettings("nesterov", 0.7, 0.9))
    outer = {n: t * 0.5 for n, t in named}
    store.save_outer(outer, round_, h)
    store.save(saved, sync=None, outer=outer, model_chunks=tensor_chunks(named, round_, h) if snapshot else None)
    return saved


def same_in_store(store, state_dir: Path) -> list[str]:
    """The names under state/ in the store, each asserted byte-identical to the local file."""
    names = [k.removeprefix(PREFIX) for k in store.keys(PREFIX)]
    for name in names:
        assert store.get(PREFIX + name) == (state_dir / name).read_bytes(), name
    return names


def test_each_save_is_copied_run_json_last_and_files_it_no_longer_names_leave_the_store(store_url, tmp_path):
    flaky = Flaky(open_store(store_url))
    state = RunStore(tmp_path / "run", StateCopy(flaky, tmp_path / "run" / "state", NAME))
    save(state, 3)
    assert same_in_store(flaky.store, state.dir) == ["model-3.safetensors", "outer-3.safetensors", "run.json"]
    assert flaky.puts[-1] == "state/run.json"
    flaky.puts.clear()
    save(state, 4, snapshot=False)
    assert same_in_store(flaky.store, state.dir) == ["model-3.safetensors", "outer-4.safetensors", "run.json"]
    assert flaky.puts == ["state/outer-4.safetensors", "state/run.json"]  # the snapshot is not put again
    save(state, 5)
    assert same_in_store(flaky.store, state.dir) == ["model-5.safetensors", "outer-5.safetensors", "run.json"]
    assert json.loads(flaky.store.get("state/run.json"))["round"] == 5


def test_a_failing_store_never_fails_the_save_is_said_once_and_the_copy_catches_up(store_url, tmp_path, caplog):
    flaky = Flaky(open_store(store_url))
    state = RunStore(tmp_path / "run", StateCopy(flaky, tmp_path / "run" / "state", NAME))
    save(state, 3)
    flaky.down = True
    save(state, 4)
    save(state, 5, snapshot=False)
    assert state.load().round == 5  # saved here all along
    flaky.down = False
    assert json.loads(flaky.store.get("state/run.json"))["round"] == 3  # the store kept round 3's whole state,
    assert flaky.store.keys(PREFIX) == ["state/model-3.safetensors", "state/outer-3.safetensors", "state/run.json"]
    assert sum("cannot write the copy of the run's state" in m for m in caplog.messages) == 1
    flaky.puts.clear()
    save(state, 6, snapshot=False)  # names round 4's snapshot, which the store never got
    assert flaky.puts == ["state/outer-6.safetensors", "state/model-4.safetensors", "state/run.json"]
    assert same_in_store(flaky.store, state.dir) == ["model-4.safetensors", "outer-6.safetensors", "run.json"]
    assert any("writing the copy of the run's state" in m and "again" in m for m in caplog.messages)


def test_the_store_copy_is_taken_up_on_an_empty_run_directory_and_checked_as_the_run_directory_is(store_url,
                                                                                                  tmp_path):
    store = open_store(store_url)
    first = RunStore(tmp_path / "lost", StateCopy(store, tmp_path / "lost" / "state", NAME))
    saved = save(first, 7)
    copy = StateCopy(store, tmp_path / "new" / "state", NAME)
    assert copy.fetch() == 7
    taken = RunStore(tmp_path / "new", copy)
    again = taken.load()
    taken.check(again)
    assert (again.round, again.model_hash, again.files) == (7, saved.model_hash, saved.files)
    assert same_in_store(store, taken.dir) == sorted(p.name for p in taken.dir.iterdir())
    save(taken, 8)  # it goes on copying, nothing uploaded twice that the store holds
    assert same_in_store(store, taken.dir) == ["model-8.safetensors", "outer-8.safetensors", "run.json"]


def test_a_damaged_file_in_the_store_is_refused_at_take_up_naming_fresh_and_fresh_clears_the_store(store_url,
                                                                                                  tmp_path):
    store = open_store(store_url)
    save(RunStore(tmp_path / "lost", StateCopy(store, tmp_path / "lost" / "state", NAME)), 2)
    store.put("state/model-2.safetensors", [store.get("state/model-2.safetensors")[:-10]])  # cut short
    copy = StateCopy(store, tmp_path / "new" / "state", NAME)
    assert copy.fetch() == 2
    taken = RunStore(tmp_path / "new", copy)
    with pytest.raises(ValueError, match="model-2.safetensors is missing or damaged .*--fresh"):
        taken.check(taken.load())
    assert StateCopy(store, tmp_path / "fresh" / "state", NAME).clear() == 3
    assert store.keys(PREFIX) == [] and StateCopy(store, tmp_path / "other" / "state", NAME).fetch() is None


# -- a coordinator's start on the store ---------------------------------------------------------------------------


def test_a_store_that_cannot_be_written_refuses_the_start_naming_it(tmp_path):
    (tmp_path / "file").write_text("not a folder")
    config = CoordinatorConfig(hosts=1, run_dir=tmp_path / "run", store=f"file://{tmp_path / 'file' / 'store'}")
    with pytest.raises(ValueError, match=f"--store file://{tmp_path}/file/store: cannot write to"):
        claim_store(config)


def test_a_run_directory_behind_the_store_is_refused_and_fresh_removes_the_stores_state(store_url, tmp_path,
                                                                                        capsys):
    store = open_store(store_url)
    save(RunStore(tmp_path / "elsewhere", StateCopy(store, tmp_path / "elsewhere" / "state", NAME)), 4)
    save(RunStore(tmp_path / "old"), 2)  # this machine's own state stopped at round 2
    config = CoordinatorConfig(hosts=1, run_dir=tmp_path / "old", store=store_url)
    with pytest.raises(ValueError, match="holds the run's state at round 4, later than .* \\(round 2\\).*--fresh"):
        claim_store(config)
    assert store.keys() == ["state/model-4.safetensors", "state/outer-4.safetensors", "state/run.json"]  # released
    claim = claim_store(replace(config, fresh=True))
    assert "--fresh: removed the earlier run's state" in capsys.readouterr().out
    assert store.keys() == ["lease.json"]
    claim.release()
    assert store.keys() == []


def test_a_renewal_whose_retried_write_had_gone_through_keeps_the_lease(store_url):
    """The store's client retried a conditional write that had succeeded: the retry finds the condition changed.
    The lease is still this coordinator's (it wrote it), so it keeps it."""
    store = open_store(store_url)
    lease = Lease(store, 30.0)
    lease.acquire()
    first = lease._tag
    store.replace(LEASE_KEY, lease._mine(), first)  # the first try of the renewal, gone through unseen
    lease.renew()  # its retry: the tag it expected is gone, the holder is this coordinator
    assert lease.held and store.get_tagged(LEASE_KEY)[1] == lease._tag != first
