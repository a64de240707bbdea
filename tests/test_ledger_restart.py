"""The data ledger across a coordinator restart, in one process: the ledger a round's publish will leave is written
before its sync goes out and comes back with that round's model; no lease before a resumed run's model is back; a
host's lease joins a restarted coordinator again; a host's sampler that finds its lease void with positions read
but not reported voids the round's delta, and the batches it read ahead under it are not trained."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest
from helpers import model, train
from local_transport import LocalClient, LocalCoordinator

from lightning_nodeox.coordinator import state as state_module
from lightning_nodeox.coordinator.ledger import DataLedger
from lightning_nodeox.coordinator.ledger_saved import RESTORE_STEP
from lightning_nodeox.coordinator.state import RunStore
from lightning_nodeox.core.ledger_order import DataOrder
from lightning_nodeox.core.ledger_terms import Covered, Lease, LeaseVoid, Span
from lightning_nodeox.core.phases import PhaseLog
from lightning_nodeox.core.protocol import DataSpec, Reason, Refusal, Upload
from lightning_nodeox.host.ledger_data import LedgerData
from lightning_nodeox.host.round import HostRound
from lightning_nodeox.host.tensors import HostTensors

SAMPLES, UNIT = 1000, 100
DATA = DataSpec(SAMPLES, seed=3, shuffle=True)


def test_the_ledger_after_a_publish_is_its_saved_state_once_published_and_leaves_it_unchanged() -> None:
    led = DataLedger(DataOrder(SAMPLES, seed=3), unit_size=UNIT)
    a, b = led.lease("a", 2), led.lease("b")
    second = a.spans[1]
    led.covered("a", Covered(0, 0, (a.spans[0], Span(second.unit, second.start, second.start + 10))), delta=0)
    led.covered("b", Covered(0, 0, b.spans), delta=0)
    before = led.to_dict()
    ahead = led.after([("a", 0), ("b", 0)])
    assert led.to_dict() == before  # unchanged: the round publishes it later
    led.publish([("a", 0), ("b", 0)])
    assert ahead == led.to_dict()
    assert DataLedger.from_dict(ahead).status()["epoch_committed_samples"] == 2 * UNIT + 10


def test_the_run_store_finds_the_ledger_written_for_a_model_and_no_other(tmp_path: Path) -> None:
    store = RunStore(tmp_path)
    store.save_data({"x": 1}, 3, "abc")
    assert store.data_of(3, "abc") == {"x": 1}
    assert store.data_of(3, "other") is None and store.data_of(4, "abc") is None


def _hosts(c: LocalCoordinator) -> list[HostRound]:
    return [HostRound(HostTensors(model(seed)), LocalClient(c, h, DATA), PhaseLog(h)) for seed, h in enumerate("ab")]


def test_a_coordinator_killed_between_a_publish_and_its_save_takes_that_rounds_ledger_back_with_its_model(
        tmp_path: Path, monkeypatch) -> None:
    """Rounds 0 and 1 each commit one unit of each host; the save after round 1 fails (run.json stays round 1's,
    whose ledger has round 0's units only) and the coordinator crashes. Started again, it leases nothing until its
    model is back (NO_MODEL); a host's lease joins again, gives round 2's model back, and leases from the ledger
    written before round 1's sync went out: round 1's units are committed, never leased again."""
    c = LocalCoordinator(tmp_path, 2, store=True, data_unit=UNIT)
    hosts = _hosts(c)
    for h in hosts:
        h.join()
    write = state_module.write_atomic

    def no_run_json_after_round_one(path: Path, chunks):
        if path.name == "run.json" and c.state.round == 2:
            raise OSError(errno.EIO, "Input/output error")
        return write(path, chunks)

    monkeypatch.setattr(state_module, "write_atomic", no_run_json_after_round_one)
    epoch = None
    for r in range(2):
        for h in hosts:
            lease = h.lease(epoch)
            epoch = lease.epoch
            train(h, r)
            h.tensors.boundary(h.round)
            outcome = h.upload(h.encode(h.tensors.live, UNIT, False, None, Covered(0, 0, lease.spans)))
            assert outcome is Upload.TAKEN
        assert [h.synchronize().round for h in hosts] == [r, r]
    assert c.call(c.run.recovery.saved()) is False
    c.crash()
    monkeypatch.setattr(state_module, "write_atomic", write)
    saved = json.loads((tmp_path / "state" / "run.json").read_text())
    assert saved["round"] == 1 and saved["data"]["committed"] == 2 * UNIT  # round 0's units only

    again = LocalCoordinator(tmp_path, 2, store=True, long_poll=0.2, data_unit=UNIT)
    try:
        for h in hosts:
            h.client.coordinator = again
        with pytest.raises(Refusal) as refused:
            hosts[0].client.lease(0)
        assert refused.value.reason is Reason.NO_MODEL  # no lease from a ledger its model may be ahead of
        lease = hosts[0].lease(0)  # joins again, gives round 2's model back, leases again
        assert isinstance(lease, Lease)
        assert (again.state.round, again.state.model.hash) == (2, hosts[0].model_hash)
        assert again.state.data.ledger.status()["epoch_committed_samples"] == 4 * UNIT
        assert lease.generation == RESTORE_STEP and lease.spans[0].unit == 4  # units 0-3 committed: the next fresh
    finally:
        again.close()


class Replies:
    """A lease source over whichever ledger is the coordinator's now (``led``)."""

    def __init__(self, led: DataLedger) -> None:
        self.led = led

    def __call__(self, epoch):
        return self.led.lease("a", 1, epoch=epoch)


def test_a_lease_found_void_with_positions_read_but_not_reported_voids_the_rounds_delta_and_its_read_ahead() -> None:
    """The host trained 20 of unit 0 and reported them (published); it reads on, training some of the rest, when
    the coordinator restarts (its ledger voids every lease). Its next lease is of a new generation: what it read
    but did not report goes with the round's delta under the void lease (refused: LEASE_VOID), and the rows read
    before are not trained (a loader's read-ahead)."""
    led = DataLedger(DataOrder(SAMPLES, seed=3), unit_size=UNIT)
    source = Replies(led)
    data = LedgerData(DATA, source, idle=lambda: True)
    sampler = data.sampler
    it = iter(sampler)
    [next(it) for _ in range(30)]
    data.consumed(0, 20)
    report = data.covered(pass_ended=False)
    assert report.spans == (Span(0, 0, 20),)
    led.covered("a", report, delta=0)
    led.publish([("a", 0)])
    source.led = DataLedger.from_dict(led.to_dict())  # the coordinator restarted
    [next(it) for _ in range(UNIT - 30 + 5)]  # unit 0 read to its end, then 5 of a lease of the new generation
    data.consumed(0, 60)  # trained up to 80 of unit 0 meanwhile
    assert sampler.generation == RESTORE_STEP
    stale = data.covered(pass_ended=False)
    assert (stale.generation, stale.spans) == (0, (Span(0, 20, UNIT),))
    with pytest.raises(LeaseVoid):
        source.led.covered("a", stale, delta=1)
    assert data.read_under_void(0)  # trained 80 of the 100 rows read before: the rest is not trained
    data.consumed(0, UNIT - 80)
    assert not data.read_under_void(0)


def test_a_lease_made_after_the_save_under_a_later_generation_is_void_in_the_restored_ledger() -> None:
    """A host refused after the save leased again under generation 1; the restored ledger's generations move on
    past any such: its report is refused as void (LEASE_VOID), not as bad input, and its next lease is new to it."""
    led = DataLedger(DataOrder(SAMPLES, seed=3), unit_size=UNIT)
    led.lease("a")
    saved = led.to_dict()
    led.refused("a")
    late = led.lease("a")
    assert late.generation == 1
    back = DataLedger.from_dict(saved)
    with pytest.raises(LeaseVoid):
        back.covered("a", Covered(late.epoch, late.generation, late.spans), delta=0)
    assert back.lease("a").generation == RESTORE_STEP
