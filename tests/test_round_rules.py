"""Each recovery rule of a host's round, against the real coordinator round object in-process (no HTTP):
hosts end on the coordinator's model, bit for bit, whatever went wrong on the way."""

from __future__ import annotations

import time

import pytest
import torch
from helpers import assert_on_the_run_model, join, recorded, train, upload

from lightning_nodeox.core.protocol import Upload

pytestmark = pytest.mark.usefixtures("keep_records")  # every PhaseLog keeps its records


def test_hosts_agree_after_joining_and_a_normal_round(local_coordinator) -> None:
    c = local_coordinator()
    a, b = join(c, "a", "b")
    assert a.model_hash == b.model_hash == c.rounds.model.hash  # b fetched a's model: they started different
    train(a, 0), train(b, 0)
    assert upload(a) is Upload.TAKEN and upload(b) is Upload.TAKEN
    assert a.synchronize().contributed and b.synchronize().contributed
    assert a.round == b.round == 1
    assert_on_the_run_model(c, a, b)


def test_a_retried_delta_is_taken_once(local_coordinator) -> None:
    c = local_coordinator()
    a, b = join(c, "a", "b")
    train(a, 0)
    message = a.encode(a.tensors.live, 8, False)
    assert a.upload(message) is Upload.TAKEN
    assert a.upload(message) is Upload.TAKEN  # the same bytes again: a retry after a lost reply
    assert c.rounds.received == {"a": 8}
    upload(b, samples=24)
    a.synchronize(), b.synchronize()
    assert c.rounds.model.weight == 0 and a.round == 1  # the round closed with 8 + 24 samples, not 16 + 24
    assert_on_the_run_model(c, a, b)


def test_a_tick_drops_a_host_whose_lease_expired_and_the_round_closes_without_it(local_coordinator) -> None:
    c = local_coordinator(lease=1.0)  # the in-process transport ticks with the server's own lifecycle
    a, _ = join(c, "a", "b")  # b is never heard from again
    train(a, 0)
    assert upload(a) is Upload.TAKEN
    time.sleep(1.2)  # neither host sent a heartbeat since
    c.call(c.membership.heartbeat("a"))
    c.tick()
    status = c.run.status()
    assert status["hosts"] == {"a": "training", "b": "dropped"}
    assert (status["published_round"], status["round"], status["complete"]) == (0, 1, False)
    a.synchronize()
    assert a.round == 1
    assert_on_the_run_model(c, a)


def test_a_late_delta_is_dropped_and_its_round_sync_still_applies(local_coordinator) -> None:
    c = local_coordinator(round_timeout=0.2, min_hosts=1)
    a, b = join(c, "a", "b")
    train(a, 0), train(b, 0)
    assert upload(a) is Upload.TAKEN
    time.sleep(0.3)
    c.tick()  # the round closes on its timeout without b
    assert upload(b) is Upload.LATE
    a.synchronize(), b.synchronize()
    assert b.round == a.round == 1
    assert_on_the_run_model(c, a, b)


def test_a_stale_delta_makes_the_host_fetch_the_model_and_rejoin_the_round(local_coordinator) -> None:
    c = local_coordinator(round_timeout=0.2, min_hosts=1)
    a, b = join(c, "a", "b")
    for r in range(2):  # b sleeps through two rounds: its next delta is computed against round 0's model
        train(a, r)
        upload(a)
        time.sleep(0.3)
        c.tick()
        a.synchronize()
    train(b, 0)
    assert upload(b) is Upload.STALE_BASE  # b fetched the model and sent an empty delta for the current round
    assert b.round == a.round == 2 and b.model_hash == a.model_hash
    train(a, 2)
    upload(a)
    a.synchronize(), b.synchronize()
    assert_on_the_run_model(c, a, b)


def test_a_sync_that_is_gone_makes_the_host_fetch_the_model(local_coordinator) -> None:
    c = local_coordinator(round_timeout=0.2, min_hosts=1)
    a, b = join(c, "a", "b")
    for r in range(2):
        train(a, r)
        upload(a)
        time.sleep(0.3)
        c.tick()
        a.synchronize()
    result = b.synchronize()  # b asks for round 0's sync; rounds 0 and 1 have been published since
    assert not result.contributed and b.round == 2
    assert_on_the_run_model(c, a, b)
    assert any(r.phase == "fallback_fetch" for r in recorded(b))


def test_a_broken_download_is_asked_for_again(local_coordinator) -> None:
    c = local_coordinator()
    a, b = join(c, "a", "b")
    train(a, 0), train(b, 0)
    upload(a), upload(b)
    b.client.break_next_sync = True
    a.synchronize()
    assert b.synchronize().contributed  # the second try succeeded: no fallback to the full model
    assert not any(r.phase == "fallback_fetch" for r in recorded(b))
    assert_on_the_run_model(c, a, b)


def test_a_model_hash_mismatch_makes_the_host_fetch_the_model(local_coordinator) -> None:
    c = local_coordinator()
    a, b = join(c, "a", "b")
    train(a, 0), train(b, 0)
    upload(a), upload(b)
    with torch.no_grad():
        b.tensors.base[0][0, 0] += 1.0  # b's copy of θ_r is corrupt: the sync cannot reproduce the run's model
    a.synchronize()
    assert not b.synchronize().contributed
    assert_on_the_run_model(c, a, b)


