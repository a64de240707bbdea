"""Joining the run and keeping this host's model the run's (host/joining.py): agreeing on the starting model,
joining again when a call is refused as NOT_JOINED or NO_MODEL, fetching the model."""

from __future__ import annotations

import logging

import pytest
import torch
from helpers import assert_on_the_run_model, join, model, train
from local_transport import LocalClient

from lightning_nodeox.core import phases as P
from lightning_nodeox.core.codecs.settings import Q4Settings
from lightning_nodeox.core.hashing import model_hash
from lightning_nodeox.core.logs import Named
from lightning_nodeox.core.phases import PhaseLog
from lightning_nodeox.core.protocol import JoinReply, Reason, Refusal
from lightning_nodeox.host import waiting
from lightning_nodeox.host.client import HttpClient
from lightning_nodeox.host.joining import REJOIN_TRIES, Joining
from lightning_nodeox.host.standing import Into, Standing
from lightning_nodeox.host.tensors import HostTensors


def joining(c, host: str, seed: int) -> Joining:
    standing = Standing(HostTensors(model(seed=seed)), LocalClient(c, host), PhaseLog(host),
                        Named(logging.getLogger(__name__), "nodeox"))
    return Joining(standing, rounding="nearest", error_feedback=True, codec_threads=1)


def test_the_first_host_provides_the_model_an_equal_one_keeps_its_own_and_another_fetches_it(local_coordinator,
                                                                                             keep_records) -> None:
    c = local_coordinator(3)
    first, same, other = joining(c, "a", 0), joining(c, "b", 0), joining(c, "c", 1)
    for j in (first, same, other):
        j.join()
    phases = {j.standing.host: [r.phase for r in j.standing.phases.records] for j in (first, same, other)}
    assert phases == {"a": [P.PROVIDE_MODEL], "b": [], "c": [P.FALLBACK_FETCH]}
    for j in (first, same, other):
        s = j.standing
        assert s.model_hash == c.rounds.model.hash == model_hash(s.tensors.named()) and s.round == 0


def test_a_call_refused_as_not_joined_joins_again_and_is_made_once_more(local_coordinator) -> None:
    c = local_coordinator(1)
    j = joining(c, "a", 0)
    j.join()
    calls = []

    def refused_once() -> int:
        calls.append(1)
        if len(calls) == 1:
            raise Refusal(Reason.NOT_JOINED, "who?")
        return 5

    assert j.call(refused_once, into=Into.LIVE) == 5 and len(calls) == 2
    with pytest.raises(Refusal):  # refused every time: given up after REJOIN_TRIES
        j.call(lambda: (_ for _ in ()).throw(Refusal(Reason.NO_MODEL, "none")), into=Into.LIVE)
    with pytest.raises(Refusal) as refused:  # any other refusal is raised at once
        j.call(lambda: (calls.append(1), (_ for _ in ()).throw(Refusal(Reason.LATE, "late")))[1], into=Into.LIVE)
    assert refused.value.reason is Reason.LATE and len(calls) == 3 and REJOIN_TRIES == 3


def test_a_model_fetched_into_base_leaves_the_live_model_alone_until_fetched_into_it(local_coordinator,
                                                                                  keep_records) -> None:
    c = local_coordinator(2)
    a, b = join(c, "a", "b")
    train(b, 0)
    training = [t.clone() for t in b.tensors.live]
    with torch.no_grad():
        b.tensors.base[0].add_(1.0)
    b.joining.fetch_model(Into.BASE)
    assert all(torch.equal(t, x) for t, x in zip(b.tensors.live, training))
    assert model_hash(b.tensors.named(b.tensors.base)) == b.model_hash == c.rounds.model.hash
    b.joining.fetch_model(Into.LIVE)
    assert_on_the_run_model(c, a, b)


# -- a host never waits silently ------------------------------------------------------------------------------------


class Polls:
    """Answers ``nothing`` times with nothing new, then ``then``: a coordinator that keeps a host waiting."""

    def __init__(self, nothing: int, then) -> None:
        self.left, self.then = nothing, then

    def __call__(self, *args, **kwargs):
        if self.left:
            self.left -= 1
            return None
        return self.then


def test_a_host_waiting_for_a_rounds_sync_says_so_at_every_interval(monkeypatch, caplog) -> None:
    monkeypatch.setattr(waiting, "SAY_EVERY", 0.0)  # every poll that brings nothing is a line
    caplog.set_level(logging.INFO, logger=waiting.__name__)
    client = HttpClient("http://127.0.0.1:9", host="a")
    ready = object()
    monkeypatch.setattr(client, "poll_sync", Polls(3, ready))
    assert client.wait_sync(4) is ready
    lines = [m.split(" (")[0] + ": " + m.split("): ", 1)[1] for m in caplog.messages]
    assert lines == ["nodeox: host a waits for round 4's sync: the coordinator has not closed that round yet (its "
                     "waiting line says why)"] * 3


def test_a_host_that_trains_while_it_polls_for_a_sync_is_not_said_to_wait(monkeypatch, caplog) -> None:
    monkeypatch.setattr(waiting, "SAY_EVERY", 0.0)
    caplog.set_level(logging.INFO, logger=waiting.__name__)
    client = HttpClient("http://127.0.0.1:9", host="a")
    ready = object()
    monkeypatch.setattr(client, "poll_sync", Polls(3, ready))
    trains = iter([True, True, False, True])  # overlap: only the third empty poll found it idle
    assert client.wait_sync(4, training=lambda: next(trains)) is ready
    assert len(caplog.messages) == 1 and "host a waits for round 4's sync" in caplog.messages[0]


def test_a_host_waiting_for_the_model_to_join_says_so_at_every_interval(monkeypatch, caplog) -> None:
    monkeypatch.setattr(waiting, "SAY_EVERY", 0.0)
    caplog.set_level(logging.INFO, logger=waiting.__name__)
    j = joining(None, "b", 0)
    replies = [JoinReply(0, None, Q4Settings(), retry=True)] * 2 + [JoinReply(3, "h", Q4Settings())]
    monkeypatch.setattr(j.standing, "client", type("Client", (), {"host": "b", "join": lambda self, *a, **k: replies.pop(0)})())
    assert j._join_reply(None).model_hash == "h" and not replies
    assert [m.split(" (")[0] for m in caplog.messages] == ["nodeox: host b waits for the run's model to join"] * 2
    assert all(m.endswith("a restarted coordinator waits for a host to give it back (its own log says which)")
               for m in caplog.messages)


def test_a_wait_line_comes_once_its_interval_has_passed_and_not_before(monkeypatch, caplog) -> None:
    caplog.set_level(logging.INFO, logger=waiting.__name__)
    now = [100.0]
    monkeypatch.setattr(waiting.time, "monotonic", lambda: now[0])
    line = waiting.WaitLine("host a waits for round 1's sync", every=30.0)
    said = []
    for t in (110.0, 129.9, 130.0, 140.0, 160.0):
        now[0] = t
        said.append(line.still("why"))
    assert said == [False, False, True, False, True]
    assert caplog.messages == ["nodeox: host a waits for round 1's sync (30 s so far): why",
                               "nodeox: host a waits for round 1's sync (60 s so far): why"]


def test_a_host_whose_base_a_broken_sync_half_changed_rejoins_holding_no_model_and_fetches_the_run_s(
        local_coordinator) -> None:
    """Found by the soak (seed 3, a relay killed -9 while its hosts read a sync): a host that rejoins a restarted
    coordinator with a half-applied sync in its base must not offer that base as the model it holds."""
    c = local_coordinator(2)
    a, b = joining(c, "a", 0), joining(c, "b", 0)
    a.join(), b.join()
    s = b.standing
    held = s.model_hash
    with torch.no_grad():
        s.tensors.base[0].add_(1.0)  # pieces of a sync applied, then the download broke off
    s.base_changed = True
    said: list[str | None] = []
    join = s.client.join
    s.client.join = lambda specs, model_hash=None, round_=None: said.append(model_hash) or join(
        specs, model_hash=model_hash, round_=round_)
    b.rejoin()
    assert said == [None]  # it did not claim to hold the model its base no longer is
    assert (s.model_hash, s.base_changed, s.tensors.base_hash()) == (held, False, held)  # fetched whole
