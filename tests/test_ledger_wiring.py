"""The data ledger wired into the coordinator and the protocol (docs/ledger.md, "the wiring"): hosts that declare
their data at join lease units over HTTP, their deltas carry what they trained (``covered``), the coordinator
commits it when the round is published, gives it back when a delta is refused or a host leaves, and keeps it
across a restart. Hosts are driven with the real client (HttpClient, HostRound) against a coordinator process;
their "training" is a nudge of the tensors. (The tests that start a coordinator are slow: conftest marks them.)"""

from __future__ import annotations

import json
import signal
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from helpers import SPECS, encoded, model, read_events, train, wait_for

from lightning_nodeox.coordinator import intake
from lightning_nodeox.coordinator.data import RunData

from lightning_nodeox.core.ledger_order import DataOrder
from lightning_nodeox.core.ledger_terms import Covered, EpochEnd, Lease, Span, Wait
from lightning_nodeox.core.phases import PhaseLog
from lightning_nodeox.core.protocol import DataSpec, Reason, Refusal, Upload
from lightning_nodeox.core.wire import METRICS_BYTES, Message, MessageMeta, covered_room, fit_metrics
from lightning_nodeox.host.client import HttpClient
from lightning_nodeox.host.round import HostRound
from lightning_nodeox.host.standing import Into
from lightning_nodeox.host.tensors import HostTensors

SAMPLES, UNIT, SEED = 1000, 100, 7
DATA = DataSpec(SAMPLES, seed=SEED, shuffle=True)
UNIT_FLAGS = ("--data-unit", str(UNIT))


class Host:
    """A host that leases one unit a round and "trains" all of it; ``committed``: the spans of its deltas taken."""

    def __init__(self, url: str, name: str, data: DataSpec = DATA) -> None:
        self.round = HostRound(HostTensors(model(seed=0)), HttpClient(url, host=name, retry_for=60, data=data),
                               PhaseLog(name))
        self.epoch: int | None = None
        self.held: Lease | None = None
        self.taken: list[Span] = []
        self.outcomes: list[Upload] = []

    @property
    def client(self) -> HttpClient:
        return self.round.client

    def lease(self) -> Lease | Wait | EpochEnd:
        reply = self.client.lease(self.epoch)
        if isinstance(reply, Lease):
            self.epoch, self.held = reply.epoch, reply
        elif isinstance(reply, EpochEnd):
            self.epoch = reply.now
        return reply

    def send(self, step: int, covered: Covered | None = None) -> Upload:
        """Train, then send the round's delta, covering what it holds (or ``covered``)."""
        h = self.round
        train(h, step)
        h.tensors.boundary(h.round)
        if covered is None and self.held is not None:
            covered = Covered(self.held.epoch, self.held.generation, self.held.spans)
        outcome = h.upload(h.encode(h.tensors.live, 16, False, None, covered))
        self.outcomes.append(outcome)
        if outcome is Upload.TAKEN and covered is not None:
            self.taken.extend(covered.spans)
        self.held = None  # taken: committed at publish; not taken: the coordinator voided the lease
        return outcome


def exchange(hosts: list[Host], step: int) -> None:
    """One round: each host leases a unit (if any), trains and sends; then every host takes the round's sync."""
    for h in hosts:
        if h.held is None:
            h.lease()
        h.send(step)
    with ThreadPoolExecutor(len(hosts)) as pool:
        results = list(pool.map(lambda h: h.round.synchronize(), hosts))
    assert len({r.round for r in results}) == 1


def joined(url: str, *names: str) -> list[Host]:
    hosts = [Host(url, n) for n in names]
    for h in hosts:
        h.round.join()
    return hosts


def data_status(url: str) -> dict:
    return HttpClient(url, host="watch").status()["data"]


def assert_every_index_once(spans: list[Span], epoch: int = 0) -> None:
    """The spans committed cover the epoch's positions once each, so its sample indices (DataOrder's) once each."""
    order = DataOrder(SAMPLES, SEED, True).epoch(epoch)
    indices = np.concatenate([order.indices(s.start, s.end) for s in spans])
    assert sorted(indices.tolist()) == list(range(SAMPLES))


def test_a_delta_carries_what_it_trained_in_its_metadata_beside_its_metrics() -> None:
    covered = Covered(3, 2, (Span(4, 410, 500), Span(9, 900, 1000)))
    metrics, dropped = fit_metrics({f"m{i}": [float(i), "mean"] for i in range(400)}, covered_room(covered))
    assert dropped and covered_room(covered) < METRICS_BYTES  # the two share the header's room
    message = encoded([torch.zeros(s.shape) for s in SPECS], SPECS)
    message.write_header(MessageMeta("delta", 5, "h", "f" * 32, samples=200, metrics=metrics, covered=covered))
    back = Message.parse(bytes(message.view()))
    assert back.meta.covered == covered and back.meta.metrics == metrics
    plain = encoded([torch.zeros(s.shape) for s in SPECS], SPECS)
    plain.write_header(MessageMeta("delta", 5, "h", "f" * 32, samples=200))
    assert Message.parse(bytes(plain.view())).meta.covered is None  # hosts without a ledger send none
    assert len(plain) == len(message)  # no layout changed


def test_a_covered_too_large_for_the_header_and_bad_lease_calls_are_refused_naming_the_fix() -> None:
    with pytest.raises(ValueError, match="larger --data-unit"):
        covered_room(Covered(0, 0, tuple(Span(u, u * 256, u * 256 + 256) for u in range(40000, 40100))))
    assert intake.parse_lease(b"") == (None, 1, None)
    assert intake.parse_lease(b'{"epoch": 2, "units": 3, "seq": 4}') == (2, 3, 4)
    for body in (b'{"epoch": -1}', b'{"units": 0}', b'{"units": "a"}', b"[1]"):
        with pytest.raises(Refusal) as refused:
            intake.parse_lease(body)
        assert refused.value.reason is Reason.INVALID and "lease" in str(refused.value)
    with pytest.raises(Refusal, match="dataset's length must be a positive integer"):
        intake.parse_join_data(b'{"host": "a", "tensors": [], "data": {"samples": 0}}')
    assert intake.parse_join_data(b'{"host": "a", "tensors": []}') is None
    assert intake.parse_join_data(b'{"data": {"samples": 5, "seed": 1, "shuffle": false}}') == DataSpec(5, 1, False)


def test_a_retried_lease_call_gets_its_first_reply_and_another_data_order_is_refused_naming_both() -> None:
    data = RunData(UNIT, "test")
    data.declare("a", DATA)
    first = data.lease("a", None, 1, seq=1)
    assert data.lease("a", None, 1, seq=1) == first  # a retry whose reply was lost leases nothing more
    assert data.lease("a", None, 1, seq=2).spans[0].unit == first.spans[0].unit + 1
    assert data.status()["hosts"]["a"]["units_held"] == 2
    with pytest.raises(Refusal, match="seed 8, shuffle True but the run's is seed 7, shuffle True"):
        data.declare("b", DataSpec(SAMPLES, seed=SEED + 1))
    data.gone("a")
    assert data.lease("a", None, 1, seq=2).spans == first.spans  # the cache went with the lease


def test_a_host_gone_while_the_open_round_holds_its_delta_has_that_delta_committed_then_its_units_back() -> None:
    """A host that leaves (or expires) after its delta went into the open round: the round's publish commits what
    that delta trained (the model holds it), and only then does the rest the host held go back."""
    data = RunData(UNIT, "test")
    data.declare("a", DATA)
    first, second = data.lease("a", None, 1, seq=1), data.lease("a", None, 1, seq=2)
    data.covered("a", 0, Covered(first.epoch, first.generation, first.spans))
    data.gone("a", in_round=True)
    record = data.publish([("a", 0)])
    assert record["published_samples"] == UNIT and record["spans"] == [[s.unit, s.start, s.end] for s in first.spans]
    assert data.status()["hosts"]["a"]["units_held"] == 0  # the second unit went back at the publish
    assert data.lease("b", None, 1).spans == second.spans  # and is the next one leased
    data.gone("b")  # not in the round: at once
    assert data.status()["hosts"]["b"]["units_held"] == 0


def test_two_hosts_lease_and_commit_every_index_of_the_epoch_exactly_once(coordinator) -> None:
    coord = coordinator(2, *UNIT_FLAGS)
    a, b = joined(coord.url, "a", "b")
    step = 0
    while data_status(coord.url)["epoch"] == 0:
        exchange([a, b], step)
        step += 1
    assert step == SAMPLES // UNIT // 2  # one unit each a round: no unit twice, none left
    assert_every_index_once(a.taken + b.taken)
    status = data_status(coord.url)
    assert status["units_committed"] == 0 and status["epoch_committed_samples"] == 0  # the next epoch, untouched
    for h in (a, b):
        counts = status["hosts"][h.client.host]
        assert counts["committed"] == counts["leased"] == sum(len(s) for s in h.taken) == SAMPLES // 2
        assert counts["in_flight"] == counts["returned"] == 0
    assert a.client.lease(0) == EpochEnd(0, 1)  # every host sees the epoch's end
    records = [e for e in read_events(coord.run_dir) if e["phase"] == "data"]
    assert [e["round"] for e in records] == list(range(step))
    assert records[-1]["epoch_ended"] == 0 and records[-2]["epoch_committed_samples"] == SAMPLES - 2 * UNIT


def test_a_refused_delta_and_a_host_that_leaves_give_their_units_back(coordinator) -> None:
    coord = coordinator(3, *UNIT_FLAGS)
    a, b, c = joined(coord.url, "a", "b", "c")
    lost = c.lease()
    c.client.leave()  # a host that leaves: its unit goes back
    assert data_status(coord.url)["hosts"]["c"]["returned"] == UNIT
    stale = a.lease()
    assert stale.spans == lost.spans  # units given back are leased again first, from where they stand
    a.round.model_hash = "0" * 32  # its delta is computed against another model: refused as a stale base
    assert a.send(0) is Upload.STALE_BASE  # (a then fetched the model and took part with an empty delta)
    assert b.lease().spans == stale.spans  # a's refused delta gave the unit back
    assert b.send(0) is Upload.TAKEN
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda h: h.round.synchronize(), (a, b)))
    status = data_status(coord.url)
    assert status["hosts"]["a"]["returned"] == UNIT and status["hosts"]["a"]["committed"] == 0
    assert status["hosts"]["b"]["committed"] == UNIT and status["units_committed"] == 1
    assert b.taken == list(lost.spans)
    assert [a.lease().spans[0].unit, b.lease().spans[0].unit] == [1, 2]  # the rest of the epoch, in order


def test_a_join_with_another_dataset_and_a_report_of_a_unit_never_leased_are_refused(coordinator) -> None:
    coord = coordinator(2, *UNIT_FLAGS)
    (a,) = joined(coord.url, "a")
    other = Host(coord.url, "c", DataSpec(SAMPLES - 1, seed=SEED))
    with pytest.raises(Refusal) as refused:
        other.round.join()
    assert refused.value.reason is Reason.INVALID
    assert f"{SAMPLES - 1} samples" in str(refused.value) and f"the run's has {SAMPLES}" in str(refused.value)
    assert "c" not in HttpClient(coord.url, host="watch").status()["hosts"]  # not registered
    (b,) = joined(coord.url, "b")

    held = a.lease()
    never = Span(9, 9 * UNIT, 10 * UNIT)
    with pytest.raises(Refusal) as refused:
        a.send(0, Covered(held.epoch, held.generation, (never,)))
    assert refused.value.reason is Reason.INVALID
    assert "not leased to it: report only leased spans" in str(refused.value)
    # the run goes on: a takes part without data (its unit came back: b leases it), and the epoch proceeds
    a.round.uploads.send_empty(False, into=Into.LIVE)
    assert b.lease().spans == held.spans
    assert b.send(0) is Upload.TAKEN
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda h: h.round.synchronize(), (a, b)))
    a.lease()
    assert a.send(1) is Upload.TAKEN
    b.lease()
    assert b.send(1) is Upload.TAKEN
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda h: h.round.synchronize(), (a, b)))
    assert data_status(coord.url)["units_committed"] == 3


def saved_round(run_dir) -> int:
    path = run_dir / "state" / "run.json"
    return json.loads(path.read_text())["round"] if path.exists() else -1


def test_the_ledger_survives_a_coordinator_killed_and_restarted_and_the_epoch_commits_every_index_once(
        coordinator) -> None:
    coord = coordinator(2, *UNIT_FLAGS)
    port = coord.url.rsplit(":", 1)[1]
    a, b = joined(coord.url, "a", "b")
    for step in range(2):
        exchange([a, b], step)
    wait_for(lambda: saved_round(coord.run_dir) >= 2, 10, "round 1's state on disk")
    held = a.lease()  # leased before the kill: void after the restart
    coord.proc.send_signal(signal.SIGKILL)
    assert coord.proc.wait(30) == -signal.SIGKILL
    again = coordinator(2, "--bind", f"127.0.0.1:{port}", *UNIT_FLAGS, run_dir=coord.run_dir)
    assert a.send(2) is Upload.LEASE_VOID  # its lease did not survive: its training is not taken
    b.lease()
    assert b.send(2) is Upload.TAKEN
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda h: h.round.synchronize(), (a, b)))
    assert results[0].round == 2
    status = data_status(again.url)
    assert status["units_committed"] == 5 and status["hosts"]["a"]["committed"] == 2 * UNIT
    step = 3
    while data_status(again.url)["epoch"] == 0:
        exchange([a, b], step)
        step += 1
    assert any(s.unit == held.spans[0].unit for s in b.taken + a.taken[2:])  # its unit was leased again
    assert_every_index_once(a.taken + b.taken)
