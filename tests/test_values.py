"""coordinator/values.py, through the in-process transport: a key is answered once, the same to every host, when
each host still in the run has posted it or cannot (it waits in the open round, or on another key, or left), and
a retried post changes nothing. Host-side: the epoch values' reduction and the torchmetrics states' encoding."""

from __future__ import annotations

import copy
import pickle
import threading
import time

import pytest
import torch
from helpers import hosts, upload
from local_transport import LocalClient
from torchmetrics.classification import MulticlassAccuracy

from lightning_nodeox.coordinator.intake import parse_values, values_key
from lightning_nodeox.core.protocol import MAX_VALUES_BYTES, Reason, Refusal
from lightning_nodeox.core.reduction import reduce_values
from lightning_nodeox.host.client import HttpClient
from lightning_nodeox.host.metric_states import MetricStates, _decode, _encode
from lightning_nodeox.host.round import HostRound, Into


def _post(client: LocalClient, key: str, payload, poll: float = 0.3):
    return client.coordinator.call(client.coordinator.run.values.exchange(client.host, key, payload, poll))


def _in_thread(fn, *args) -> tuple[threading.Thread, list]:
    box: list = []
    thread = threading.Thread(target=lambda: box.append(fn(*args)), daemon=True)
    thread.start()
    return thread, box


def test_a_key_is_answered_once_every_host_posted_it_in_host_order_and_a_retry_changes_nothing(local_coordinator):
    c = local_coordinator(2)
    b, a = hosts(c, "b", "a")
    assert _post(b.client, "epoch.train.0.1", {"v": 2}) is None  # a is training: not yet answered
    assert _post(b.client, "epoch.train.0.1", {"v": 99}) is None  # a retry: b's first payload is kept
    reply = a.client.exchange_values("epoch.train.0.1", {"v": 1})
    assert reply.hosts == ["a", "b"] and reply.payloads == [{"v": 1}, {"v": 2}]
    assert b.client.exchange_values("epoch.train.0.1", {"v": 99}) == reply  # the same answer to every host


def test_a_host_waiting_in_the_open_round_does_not_hold_a_key_and_posting_late_gets_the_same_answer(
        local_coordinator):
    c = local_coordinator(2)
    a, b = hosts(c, "a", "b")
    upload(a)  # a closed its round and waits for b's delta; b stopped at its epoch's end first
    start = time.monotonic()
    reply = b.client.exchange_values("epoch.train.0.1", {"v": 2})
    assert time.monotonic() - start < 2.0
    assert reply.hosts == ["b"] and reply.payloads == [{"v": 2}]
    assert a.client.exchange_values("epoch.train.0.1", {"v": 1}) == reply  # a's later post: b's answer, as is


def test_an_overlapped_host_holds_a_key_while_it_trains_on_and_no_longer_once_it_waits_for_the_sync(
        local_coordinator):
    c = local_coordinator(2, long_poll=0.2)
    a, b = hosts(c, "a", "b")
    a.trains_on = True  # a's round overlaps: its delta goes in (into base), and a trains on (InFlight.start)
    a.upload(a.encode(a.tensors.live, 8, False), into=Into.BASE)
    assert c.rounds.deltas.training == {"a"}
    thread, box = _in_thread(b.client.exchange_values, "epoch.train.0.1", {"v": 2})
    thread.join(0.6)
    assert not box  # b's epoch ended first: the key waits for a's values, a still trains
    assert a.client.exchange_values("epoch.train.0.1", {"v": 1}).payloads == [{"v": 1}, {"v": 2}]
    thread.join(5)
    assert box and box[0].hosts == ["a", "b"]  # the mean over both hosts, not b's own
    thread, box = _in_thread(b.client.exchange_values, "epoch.train.0.2", {"v": 4})
    thread.join(0.6)
    assert not box
    a.trains_on = False  # a reached its next boundary: training waits for the sync (InFlight.fold(wait=True))
    waiting, synced = _in_thread(a.download, Into.BASE)  # its next sync poll says so (the round waits for b)
    thread.join(5)
    assert box and box[0].hosts == ["b"] and c.rounds.deltas.training == set()  # a does not hold b's key: no deadlock
    upload(b)
    waiting.join(10)
    assert synced and synced[0].round == 0 and synced[0].contributed


def test_a_host_that_is_not_overlapped_is_held_as_soon_as_its_delta_is_in(local_coordinator):
    c = local_coordinator(2)
    a, b = hosts(c, "a", "b")
    upload(a)  # trains_on False: a blocking round, a waits for its sync from here
    assert c.rounds.deltas.training == set()
    assert b.client.exchange_values("epoch.train.0.1", {"v": 2}).hosts == ["b"]


def test_hosts_waiting_on_other_keys_or_in_a_round_or_gone_do_not_hold_a_key(local_coordinator):
    c = local_coordinator(3)
    a, b, gone = hosts(c, "a", "b", "gone")
    gone.client.leave()
    thread, box = _in_thread(a.client.exchange_values, "epoch.train.0.1", {"v": 1})
    time.sleep(0.3)
    other = b.client.exchange_values("epoch.validate.0.1", {"w": 2})  # b names another key: a does not hold it
    assert other.hosts == ["b"]
    thread.join(0.5)
    assert not box  # b trains on: a waits for it, as under DDP ...
    upload(b)  # ... until b closes a round, where it waits for a
    thread.join(5)
    assert box and box[0].hosts == ["a"] and box[0].payloads == [{"v": 1}]


def test_a_key_is_answered_on_the_round_timeout_without_a_host_that_never_posts(local_coordinator):
    c = local_coordinator(2, round_timeout=1.0)
    a, _ = hosts(c, "a", "b")
    start = time.monotonic()
    reply = a.client.exchange_values("state.train.0.1", {"v": 1})
    assert 1.0 <= time.monotonic() - start < 4.0 and reply.hosts == ["a"]


def test_epoch_values_reduce_as_round_values_do() -> None:
    assert reduce_values([(30.0, 1.0), (10.0, 3.0)], "mean") == 1.5  # weighted by samples
    assert reduce_values([(1.0, 1.0), (1.0, 3.0)], "sum") == 4.0
    assert reduce_values([(1.0, 1.0), (1.0, 3.0)], "max") == 3.0 and reduce_values([(0, 1.0), (0, 3.0)], "mean") == 2.0


def test_a_torchmetrics_state_travels_bit_for_bit() -> None:
    for t in (torch.tensor([3, 0, 7]), torch.tensor(0.1, dtype=torch.bfloat16), torch.rand(2, 3, dtype=torch.float64),
              torch.tensor([True, False]), torch.empty(0)):
        back = _decode(_encode(t), torch.device("cpu"))
        assert back.dtype == t.dtype and back.shape == t.shape and torch.equal(back, t)


class _Trainer:
    """What a trainer holds that neither copies nor pickles (a lock)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()


def test_a_module_with_synced_metrics_copies_while_training_and_saves_whole_after_it() -> None:
    module = torch.nn.Module()
    module.acc = MulticlassAccuracy(num_classes=3)
    own = (module.acc.dist_sync_fn, module.acc.distributed_available_fn)
    states = MetricStates(_Trainer(), lambda key, payload: None)
    assert states.attach(module) == ["acc"]
    copied = copy.deepcopy(module)  # an EMA or teacher copy made while training: the trainer is not copied
    assert copied.acc.dist_sync_fn.__self__ is states and copied.acc is not module.acc
    states.detach()  # training ended: the metrics' own functions again, nothing that holds the trainer
    assert (module.acc.dist_sync_fn, module.acc.distributed_available_fn) == own
    assert isinstance(pickle.loads(pickle.dumps(module)).acc, MulticlassAccuracy)


def test_a_values_post_is_checked_before_anything_sees_it() -> None:
    assert values_key("epoch.train.0.1") == "epoch.train.0.1"
    for bad in ("", "a/b", "x" * 201, "épique"):
        with pytest.raises(Refusal) as e:
            values_key(bad)
        assert e.value.reason is Reason.INVALID
    assert parse_values(b'{"payload": {"values": {"loss_epoch": [0.5, "mean", 32]}}}') == {
        "values": {"loss_epoch": [0.5, "mean", 32]}}
    for body, reason in ((b'{"values": 1}', Reason.INVALID), (b"[1]", Reason.INVALID), (b'{"payload": NaN}',
                         Reason.INVALID), (b" " * (MAX_VALUES_BYTES + 1), Reason.TOO_LARGE)):
        with pytest.raises(Refusal) as e:
            parse_values(body)
        assert e.value.reason is reason


def test_the_http_client_says_training_goes_on_with_a_delta_and_at_each_sync_poll(monkeypatch) -> None:
    client, sent, polls = HttpClient("http://127.0.0.1:9", host="a"), [], iter([204, 204, 204])
    trains = iter([True, False])

    class Response:
        def __init__(self, status: int) -> None:
            self.status_code, self.headers = status, {}

        def close(self) -> None:
            pass

    def request(method, path, *, params, **kwargs):
        sent.append((method, params.get("training")))
        if method == "GET" and next(polls, None) is None:
            raise Refusal(Reason.GONE, "stop")
        return Response(202 if method == "POST" else 204)

    monkeypatch.setattr(client, "_request", request)
    client.post_delta(0, memoryview(b""), training=True)
    client.post_delta(0, memoryview(b""))
    client.wait_sync(0, poll=0.01, training=lambda: next(trains, False))
    assert sent == [("POST", "1"), ("POST", None), ("GET", "1"), ("GET", None), ("GET", None), ("GET", None)]


def _restarted(hosts_: list, again) -> None:
    """Point the hosts' in-process clients at ``again``, a coordinator started anew (it knows none of them)."""
    for h in hosts_:
        h.client.coordinator = again


def test_after_a_coordinator_restart_a_values_post_joins_again_and_every_host_gets_the_values_of_both(
        local_coordinator):
    c = local_coordinator(2)
    a, b = hosts(c, "a", "b")
    for h in (a, b):
        upload(h)
    assert [h.synchronize().round for h in (a, b)] == [0, 0]
    again = local_coordinator(2)  # the coordinator restarted (nothing saved): the values post is refused ...
    _restarted([a, b], again)
    with pytest.raises(Refusal) as refused:
        b.client.exchange_values("epoch.train.0.1", {"v": 2})
    assert refused.value.reason is Reason.NOT_JOINED
    # ... so the host joins again (giving its model back) and posts again; b's exchange in flight (joins False)
    # waits for that exchange to join
    thread, box = _in_thread(lambda: b.exchange_values("epoch.train.0.1", {"v": 2}, retry_for=10,
                                                       joins=lambda: False))
    time.sleep(0.3)
    assert not box
    b.rejoin()
    thread.join(0.6)
    assert not box  # b posted again; a has not joined again yet: the key waits for it, as round 0 does
    reply = a.exchange_values("epoch.train.0.1", {"v": 1}, retry_for=10, joins=lambda: True)
    thread.join(10)
    assert reply.hosts == ["a", "b"] and box == [reply] and reply.payloads == [{"v": 1}, {"v": 2}]
    assert again.state.model.hash == a.model_hash == b.model_hash  # given back by the first to join again
    with pytest.raises(Refusal):  # within retry_for only: then the refusal is the caller's (its own values)
        HostRound(a.tensors, LocalClient(again, "zed"), a.phases).exchange_values("k", {}, retry_for=0,
                                                                                 joins=lambda: False)
