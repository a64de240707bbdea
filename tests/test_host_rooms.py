"""The host's rooms on their own: the overlap mode, the round timing, the refusals that are outcomes, and a
NodeoxStrategy whose exchange goes through a client it was given (the in-process transport), a fetched model
that goes where the caller says, and no class or function of host/ too long to read in one sitting."""

from __future__ import annotations

import ast
import time
from pathlib import Path

import pytest
import torch
from helpers import TwoOptimizers, assert_on_the_run_model, data, model, train
from lightning.pytorch import Trainer
from local_transport import LocalClient, LocalCoordinator

from lightning_nodeox import NodeoxStrategy
from lightning_nodeox.core.hashing import model_hash
from lightning_nodeox.core.phases import PhaseLog
from lightning_nodeox.core.protocol import Reason, Refusal, SyncGone, Upload
from lightning_nodeox.core.transport import HostClient, delta_outcome, sync_outcome
from lightning_nodeox.host.client import HttpClient
from lightning_nodeox.host.round import HostRound, Into
from lightning_nodeox.host.settings import Connection, Overlap
from lightning_nodeox.host.tensors import HostTensors, shared_tensors
from lightning_nodeox.host.timing import RoundTiming


def test_overlap_is_decided_once_as_a_mode() -> None:
    assert [Overlap.of(v) for v in (False, None, True, "eager", "delayed")] == [
        Overlap.OFF, Overlap.OFF, Overlap.EAGER, Overlap.EAGER, Overlap.DELAYED]
    assert NodeoxStrategy(overlap="delayed").settings.overlap is Overlap.DELAYED
    with pytest.raises(ValueError, match=r"overlap='later' is not known; use NodeoxStrategy\(overlap=False\)"):
        NodeoxStrategy(overlap="later")


def test_steps_are_counted_as_global_step_and_a_round_closes_only_at_a_batch_end() -> None:
    timing = RoundTiming(local_steps=3, round_seconds=None)
    timing.begin()
    with timing.inside():  # automatic optimization: optimizer_step, around the closure's training_step
        with timing.inside():
            assert not timing.batch_ended()
        assert not timing.batch_ended()
    timing.stepped()
    assert timing.batch_ended() and not timing.batch_ended()
    assert timing.steps == 1 and not timing.due()
    with timing.inside():  # manual optimization: training_step, around two optimizers' steps
        for _ in range(2):
            with timing.inside():
                pass
            timing.stepped()
            assert not timing.batch_ended() and not timing.due()  # never between two optimizers of a batch
    assert timing.batch_ended()
    assert timing.steps == 3 and timing.due()
    assert not timing.batch_ended()  # a batch that did not step is not counted


def test_a_time_budget_keeps_overlapped_boundaries_on_a_fixed_schedule() -> None:
    now = [100.0]
    timing = RoundTiming(local_steps=20, round_seconds=10.0, clock=lambda: now[0])
    timing.begin()
    assert timing.deadline == 110.0 and not timing.due()
    now[0] = 111.5  # the round closed 1.5 s late: an overlapped round makes it up ...
    assert timing.due()
    timing.begin(overlapped=True)
    assert timing.deadline == 120.0
    now[0] = 121.0  # ... a round that waited for its sync starts a budget of its own
    timing.begin()
    assert timing.deadline == 131.0
    now[0] = 150.0  # behind by a whole round: start afresh
    timing.begin(overlapped=True)
    assert timing.deadline == 160.0


def test_refusals_that_are_outcomes_become_values_and_the_others_stay_errors() -> None:
    def refused(reason: Reason):
        def call():
            raise Refusal(reason, reason.value)
        return call

    assert delta_outcome(lambda: None, "a", 0) is Upload.TAKEN
    assert [delta_outcome(refused(r), "a", 0) for r in (Reason.DUPLICATE, Reason.LATE, Reason.STALE_BASE)] == [
        Upload.TAKEN, Upload.LATE, Upload.STALE_BASE]
    assert isinstance(sync_outcome(refused(Reason.GONE)), SyncGone) and sync_outcome(lambda: None) is None
    for call in (lambda: delta_outcome(refused(Reason.FORBIDDEN), "a", 0), lambda: sync_outcome(refused(Reason.BUSY))):
        with pytest.raises(Refusal):
            call()


def test_both_clients_offer_what_a_host_needs(tmp_path) -> None:
    c = LocalCoordinator(tmp_path, 1)
    try:
        assert isinstance(LocalClient(c, "a"), HostClient)
        assert isinstance(HttpClient("http://127.0.0.1:1", host="a"), HostClient)
    finally:
        c.close()


def test_a_given_client_carries_the_exchange(tmp_path) -> None:
    c = LocalCoordinator(tmp_path / "run", 1)
    made: list[Connection] = []

    def local(conn: Connection) -> LocalClient:
        made.append(conn)
        return LocalClient(c, conn.host_id)

    try:
        model = TwoOptimizers()
        strategy = NodeoxStrategy(coordinator_url="http://unused.invalid", host_id="solo", local_steps=4,
                                  client=local)
        trainer = Trainer(strategy=strategy, max_steps=2 * 5, default_root_dir=tmp_path, logger=False,
                          enable_progress_bar=False, enable_checkpointing=False)
        trainer.fit(model, data())
        # 5 batches of 2 optimizer steps: rounds of 4 and 4, and a final round of 2, through the in-process coordinator
        assert [m.host_id for m in made] == ["solo"]
        assert strategy.last_result.round == 2 and strategy.last_result.complete
        assert model_hash(shared_tensors(model)) == c.rounds.model.hash == strategy.model_hash
    finally:
        c.close()


def test_a_fetched_model_goes_where_the_caller_says(tmp_path) -> None:
    c = LocalCoordinator(tmp_path, 2)
    try:
        a, b = (HostRound(HostTensors(model(seed=i)), LocalClient(c, h), PhaseLog(h)) for i, h in enumerate("ab"))
        a.join(), b.join()
        train(b, 0)  # b's live model is training (an overlapped round): a fetch into base leaves it alone
        with torch.no_grad():
            b.tensors.base[0].add_(1.0)
        training = [t.clone() for t in b.tensors.live]
        b.fetch_model(Into.BASE)
        assert all(torch.equal(t, x) for t, x in zip(b.tensors.live, training))
        assert model_hash(b.tensors.named(b.tensors.base)) == b.model_hash == c.rounds.model.hash
        b.fetch_model(Into.LIVE)  # training waits: the live model and θ_r both become the run's model
        assert_on_the_run_model(c, a, b)
    finally:
        c.close()


def test_a_round_budget_is_kept_on_a_monotonic_clock_whatever_the_wall_clock_does() -> None:
    assert RoundTiming(local_steps=20, round_seconds=10.0).clock is time.monotonic
    steady, wall = [500.0], [1_000_000.0]
    timing = RoundTiming(local_steps=20, round_seconds=10.0, clock=lambda: steady[0], wall=lambda: wall[0])
    timing.begin()
    assert timing.start == 1_000_000.0  # the training record's timestamp stays wall-clock time
    steady[0], wall[0] = 505.0, wall[0] - 3600.0  # the wall clock steps back an hour mid-round
    assert not timing.due()
    steady[0] = 510.0  # ten seconds of training: the round closes on time
    assert timing.due()
    timing.begin(overlapped=True)
    assert timing.deadline == 520.0 and timing.start == 1_000_000.0 - 3600.0
    steady[0], wall[0] = 520.0, wall[0] + 7200.0  # and a step forward does not close the next one early
    timing.begin()
    steady[0] = 529.9
    assert not timing.due()


HOST = Path(__file__).resolve().parents[1] / "lightning_nodeox" / "host"
LONGEST_CLASS, LONGEST_FUNCTION = 300, 60  # lines, from its first line (decorators aside) to its last


def too_long(source: str) -> list[str]:
    """The classes and functions of ``source`` longer than their limit, as ``kind name lines``."""
    out = []
    for node in ast.walk(ast.parse(source)):
        limit = {ast.ClassDef: LONGEST_CLASS, ast.FunctionDef: LONGEST_FUNCTION,
                 ast.AsyncFunctionDef: LONGEST_FUNCTION}.get(type(node))
        if limit is not None and node.end_lineno - node.lineno + 1 > limit:
            out.append(f"{type(node).__name__} {node.name} {node.end_lineno - node.lineno + 1}")
    return out


@pytest.mark.parametrize("path", sorted(HOST.glob("*.py")), ids=lambda p: p.name)
def test_no_class_of_the_host_holds_more_than_300_lines_nor_a_function_more_than_60(path: Path) -> None:
    assert too_long(path.read_text()) == [], f"host/{path.name}: split it along its ideas"


def test_the_length_check_sees_a_long_class_and_a_long_function() -> None:
    body = "\n".join(f"        x{i} = {i}" for i in range(60))
    probe = f"class Big:\n    def long(self):\n{body}\n" + "\n".join(f"    y{i} = {i}" for i in range(240))
    assert too_long(probe) == ["ClassDef Big 302", "FunctionDef long 61"]
