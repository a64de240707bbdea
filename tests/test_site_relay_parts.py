"""A site relay's parts, in process: its delta upstream is its site's sample-weighted mean, re-quantized with
its own error feedback (raw tensors taken as a coordinator takes them); the root's sync passes down to the
site's hosts unchanged, so they end on the root's model bit for bit; its site's phase records go upstream under
its name."""

from __future__ import annotations

import asyncio
import json
import logging
import time

import pytest
import torch
from helpers import SETTINGS, bits, exchange, frozen, hosts, read_events, socket_closed_port, train, wait_for
from local_transport import LocalClient, LocalCoordinator, MemoryBody
from reference_q4 import kernels

from lightning_nodeox.coordinator.intake import of_sender, parse_records
from lightning_nodeox.coordinator.model import CoordinatorModel
from lightning_nodeox.core.codec import decode_tensor, encode_tensor
from lightning_nodeox.core.hashing import model_hash
from lightning_nodeox.core.pool import WorkerPool
from lightning_nodeox.core.protocol import Reason, Refusal, Unreachable, ValuesReply
from lightning_nodeox.core.wire import Message, MessageMeta
from lightning_nodeox.host.tensors import HostTensors
from lightning_nodeox.relay.config import RelayConfig
from lightning_nodeox.relay.run import Site, upstream_client
from lightning_nodeox.relay.tensors import RelayTensors
from lightning_nodeox.relay.upstream import Upstream
from lightning_nodeox.relay.values import flatten, site_payload
from lightning_nodeox.tools.cli import main

NAMED = [("w", torch.randn(70, 30, generator=torch.Generator().manual_seed(0))),
         ("b", torch.randn(70, generator=torch.Generator().manual_seed(1))),
         ("steps", torch.tensor(3))]  # a raw tensor: taken from one host, not averaged


def host_delta(host: str, samples: int, scale: float, steps: int, frozen_names: tuple[str, ...] = ()) -> Message:
    """Host ``host``'s delta of ``samples`` samples: every float value moved by ``scale`` times a pattern; the
    tensors ``frozen_names`` are frozen parameters there (not sent)."""
    tensors = frozen([(n, t.clone()) for n, t in NAMED], frozen_names)
    tensors.allocate(SETTINGS, 1)
    with torch.no_grad():
        for t in tensors.live[:2]:
            t.add_(torch.linspace(-1, 1, t.numel()).view(t.shape) * scale)
        tensors.live[2].fill_(steps)
    return tensors.encode(tensors.live, MessageMeta("delta", 0, host, tensors.base_hash(), samples=samples), None).join()


def test_a_relays_delta_is_its_sites_weighted_mean_requantized_with_its_own_residual() -> None:
    pool = WorkerPool(SETTINGS, "cpu", 1)
    model = CoordinatorModel(tuple(HostTensors(NAMED).specs), [t.clone() for _, t in NAMED], SETTINGS, pool)
    deltas = {"b": (host_delta("b", 24, 0.03, steps=9), 24), "a": (host_delta("a", 8, 0.01, steps=5), 8)}
    for message, samples in deltas.values():
        model.accumulate(Message.parse(message.buffer.clone()), samples)
    acc = [a.clone() for a in model.acc]
    tensors = RelayTensors(model)
    tensors.allocate(SETTINGS, 1)
    tensors.take_round()
    sent = tensors.encode(tensors.live, MessageMeta("delta", 0, "site", model.hash, samples=model.weight), None).join()

    assert sent.meta.samples == 32 and [s.name for s in sent.meta.tensors] == ["w", "b", "steps"]
    assert int(sent.raw(2).clone().view(torch.int64)) == 5  # host "a" sorts first: its raw values, as a coordinator's
    k = kernels(SETTINGS)
    for j in range(2):
        weighted = torch.zeros(acc[j].numel())
        for message, samples in deltas.values():  # the sample-weighted mean of what the hosts sent
            values = torch.empty(acc[j].numel())
            decode_tensor(k, message.codes(j), message.scales(j), values)
            weighted += samples * values
        mean = acc[j] * (1 / 32)
        torch.testing.assert_close(mean, weighted / 32, rtol=1e-6, atol=1e-7)
        codes, scales = torch.empty_like(sent.codes(j)), torch.empty_like(sent.scales(j))
        encode_tensor(k, mean, codes, scales)  # first round: the residual was zero, so q4 of the mean itself
        assert torch.equal(codes, sent.codes(j)) and torch.equal(scales, sent.scales(j))
        sent_values = torch.empty(mean.numel())
        decode_tensor(k, sent.codes(j), sent.scales(j), sent_values)
        assert torch.equal(tensors.residual[j], (mean - sent_values).to(tensors.residual[j].dtype))  # its own
        assert tensors.residual[j].abs().max() > 0
    assert model.weight == 0 and not model.moving  # the site's round is handed on: the next one starts afresh
    tensors.close()
    pool.close()


class EventsClient(LocalClient):
    """A local client whose records go into the coordinator's run log as its HTTP server takes them (refused from
    a host that has not joined)."""

    def post_events(self, records: list[dict], *, retry_for: float = 0.0) -> None:
        body = MemoryBody(json.dumps({"records": records}).encode())
        self.coordinator.call(self.service.take_records(self._me(), body))


def test_each_tensor_of_a_relays_delta_is_the_mean_over_the_hosts_that_sent_it_and_a_partial_set_is_said_once(
        caplog) -> None:
    """Host "b" (24 samples) has "w" frozen, host "a" (8) not: the site's "w" is a's own change, "b" the mean over
    both; upstream the delta counts the site's 32 samples for each, which the relay says once (not again while
    the same tensors differ). A tensor only a delta without samples carried stays out of the site's delta."""
    caplog.set_level(logging.WARNING, logger="lightning_nodeox.relay.tensors")
    pool = WorkerPool(SETTINGS, "cpu", 1)
    model = CoordinatorModel(tuple(HostTensors(NAMED).specs), [t.clone() for _, t in NAMED], SETTINGS, pool)
    tensors = RelayTensors(model, "nodeox relay siteA")
    tensors.allocate(SETTINGS, 1)
    k = kernels(SETTINGS)
    sent = []
    for round_, deltas in enumerate((
            {"a": (host_delta("a", 8, 0.01, 5), 8), "b": (host_delta("b", 24, 0.03, 9, ("w",)), 24)},
            {"a": (host_delta("a", 8, 0.02, 5), 8), "b": (host_delta("b", 24, 0.01, 9, ("w",)), 24)},
            {"a": (host_delta("a", 8, 0.02, 5, ("w",)), 8), "c": (host_delta("c", 0, 0.05, 1), 0)})):
        for message, samples in deltas.values():
            model.accumulate(Message.parse(message.buffer.clone()), samples)
        expected = {}
        for j, name in enumerate(("w", "b")):  # each tensor's mean over the deltas (with samples) that carried it
            carried = [(m, s) for m, s in deltas.values() if s and name in [t.name for t in m.meta.tensors]]
            total = torch.zeros(NAMED[j][1].numel())
            for m, s in carried:
                values = torch.empty(total.numel())
                position = [t.name for t in m.meta.tensors].index(name)
                decode_tensor(k, m.codes(position), m.scales(position), values)
                total += s * values
            if carried:
                expected[name] = total / sum(s for _, s in carried)
                torch.testing.assert_close(model.acc[j] * (1 / model.weights[j]), expected[name], rtol=1e-6,
                                           atol=1e-7)
        tensors.take_round()
        message = tensors.encode(tensors.live, MessageMeta("delta", round_, "siteA", model.hash, samples=model.weight),
                                 None).join()
        sent.append(([t.name for t in message.meta.tensors], message.meta.samples))
        if round_ == 0:  # no residual yet: q4 of each tensor's own mean
            for j, name in enumerate(("w", "b")):
                codes, scales = torch.empty_like(message.codes(j)), torch.empty_like(message.scales(j))
                encode_tensor(k, expected[name], codes, scales)
                assert torch.equal(codes, message.codes(j)) and torch.equal(scales, message.scales(j))
    assert sent == [(["w", "b", "steps"], 32), (["w", "b", "steps"], 32), (["b", "steps"], 8)]
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and said[0].startswith("nodeox relay siteA: the site's hosts sent different tensors: 1 of "
                                                 "the 3 tensors of its delta came from hosts with fewer than its 32 "
                                                 "samples (w: 8)")
    tensors.close()
    pool.close()


def test_the_roots_sync_passes_down_unchanged_and_the_sites_hosts_end_on_the_roots_model(tmp_path) -> None:
    """Also: every record of the relay's run log reaches the root, those from before it joined the root too."""
    root = LocalCoordinator(tmp_path / "root", 1)
    upstream = Upstream(RelayConfig(upstream="http://root", relay_id="site"), client=EventsClient(root, "site"))
    relay = LocalCoordinator(tmp_path / "relay", 2, site=Site(upstream))
    try:
        relay.tick()  # its memory sample: a record before the relay has joined the root, ...
        time.sleep(1.5)  # ... held past a shipping of the relay's records (every second)
        h0, h1 = hosts(relay, "0", "1")  # host 0 provides the model to the relay, ...
        assert relay.run.site.model.upstream_pending() and root.state.model is None
        relay.call(relay.run.site.model.join_upstream_with_model())  # ... the relay to the root (its ticker's work)
        assert root.state.model.hash == relay.state.model.hash == h0.model_hash
        start = [t.clone() for t in root.state.model.tensors]
        for r in range(2):
            train(h0, r)
            train(h1, r)
            exchange((h0, 8), (h1, 24))
            assert bits(relay.state.model.latest_sync.buffer).equal(bits(root.state.model.latest_sync.buffer))
            assert h0.model_hash == h1.model_hash == relay.state.model.hash == root.state.model.hash
        expected = root.state.model.tensors
        assert not all(torch.equal(a, b) for a, b in zip(start, expected))  # the rounds changed the model
        for h in (h0, h1):
            assert all(torch.equal(bits(t), bits(e)) for t, e in zip(h.tensors.live, expected))
            assert model_hash(h.tensors.named()) == root.state.model.hash
        assert relay.state.model.tensors[0].data_ptr() == upstream.round.tensors.base[0].data_ptr()  # one θ
        relay.tick()
        assert upstream.heartbeat.client.joined  # the relay's lease upstream is kept while its hosts train ...
        for h in (h0, h1):
            h.client.leave()
        relay.tick()
        assert not upstream.heartbeat.client.joined  # ... and runs out once none is left
    finally:
        relay.close()
        root.close()
    events = read_events(tmp_path / "root")
    own = [e for e in events if e["host"] == "coordinator"]
    assert [(e["round"], e["from_host"]) for e in own if e["phase"] == "receive"] == [(0, "site"), (1, "site")]
    assert [e["samples"] for e in own if e["phase"] == "aggregate"] == [32, 32]  # the site's sum, one delta
    relayed = [(e["host"], e["round"], e["phase"]) for e in read_events(tmp_path / "relay") if e["host"] != "site"]
    assert relayed[0] == ("coordinator", 0, "rss") and ("coordinator", 1, "sync_prepare") in relayed
    assert [(e["host"].removeprefix("site/"), e["round"], e["phase"]) for e in events
            if e["host"].startswith("site/")] == relayed  # all of them, in order, under the relay's name
    assert upstream.telemetry.dropped == 0  # none refused


def test_a_relay_under_a_relay_passes_the_roots_sync_down_two_levels_and_its_records_up_two(tmp_path) -> None:
    """Root <- relay "mid" <- relay "leaf" <- hosts 0 and 1: the model goes up two relays (host 0 provides it),
    each round's sync comes down them unchanged, the root takes one delta of the whole site's samples, and the
    leaf's records reach the root as mid/leaf/HOST."""
    root = LocalCoordinator(tmp_path / "root", 1)
    to_root = Upstream(RelayConfig(upstream="http://root", relay_id="mid"), client=EventsClient(root, "mid"))
    mid = LocalCoordinator(tmp_path / "mid", 1, site=Site(to_root))
    to_mid = Upstream(RelayConfig(upstream="http://mid", relay_id="leaf"), client=EventsClient(mid, "leaf"))
    leaf = LocalCoordinator(tmp_path / "leaf", 2, site=Site(to_mid))
    try:
        h0, h1 = hosts(leaf, "0", "1")
        leaf.call(leaf.run.site.model.join_upstream_with_model())  # the leaf provides it to mid (its ticker's work)
        mid.call(mid.run.site.model.join_upstream_with_model())  # ... mid to the root
        assert root.state.model.hash == mid.state.model.hash == leaf.state.model.hash == h0.model_hash
        for r in range(2):
            train(h0, r)
            train(h1, r)
            exchange((h0, 8), (h1, 24))
            root_sync = bits(root.state.model.latest_sync.buffer)
            assert bits(mid.state.model.latest_sync.buffer).equal(root_sync)
            assert bits(leaf.state.model.latest_sync.buffer).equal(root_sync)
            assert h0.model_hash == h1.model_hash == leaf.state.model.hash == root.state.model.hash
        for h in (h0, h1):
            assert all(torch.equal(bits(t), bits(e)) for t, e in zip(h.tensors.live, root.state.model.tensors))
    finally:
        leaf.close()
        mid.close()
        root.close()
    events = read_events(tmp_path / "root")
    own = [e for e in events if e["host"] == "coordinator"]
    assert [(e["round"], e["from_host"]) for e in own if e["phase"] == "receive"] == [(0, "mid"), (1, "mid")]
    assert [e["samples"] for e in own if e["phase"] == "aggregate"] == [32, 32]
    nested = {(e["round"], e["phase"]) for e in events if e["host"] == "mid/leaf/coordinator"}
    assert {(0, "aggregate"), (1, "aggregate"), (1, "sync_prepare")} <= nested


def test_a_relay_forwards_its_sites_records_under_its_own_name_and_no_one_elses() -> None:
    batch = parse_records(json.dumps({"records": [
        {"round": 0, "host": "siteA", "phase": "upload", "start": 1.0, "end": 2.0, "bytes": 9},  # its own
        {"round": 0, "host": "siteA/0", "phase": "train", "start": 1.0, "end": 2.0},  # its host's
        {"round": 0, "host": "siteA/coordinator", "phase": "aggregate", "start": 1.0, "end": 2.0, "hosts": "0,1"},
        {"round": 0, "host": "siteA/sub/3", "phase": "encode", "start": 1.0, "end": 2.0},  # a relay below it
        {"round": 0, "host": "siteA", "phase": "aggregate", "start": 1.0, "end": 2.0},  # not a host's own phase
    ]}).encode(), "siteA")
    assert [(r.host, r.phase) for r in batch.records] == [
        ("siteA", "upload"), ("siteA/0", "train"), ("siteA/coordinator", "aggregate"), ("siteA/sub/3", "encode")]
    assert batch.dropped == 1
    with pytest.raises(Refusal) as refused:  # another site's records: refused whole
        parse_records(json.dumps({"records": [{"round": 0, "host": "siteB/0", "phase": "train", "start": 1.0,
                                               "end": 2.0}]}).encode(), "siteA")
    assert refused.value.reason is Reason.FORBIDDEN
    assert not of_sender("siteAB/0", "siteA") and not of_sender("siteA/bad id", "siteA") and of_sender("siteA", "siteA")


def test_nodeox_relay_refuses_a_bad_upstream_or_id_naming_the_fix(tmp_path) -> None:
    for argv, said in (
        (["--upstream", "root:8470"], "--upstream 'root:8470' must look like http://HOST:8470"),
        (["--upstream", "http://root:8470", "--id", "site a"], "--id (the relay's host id upstream) 'site a' is not"),
    ):
        with pytest.raises(SystemExit) as stopped:
            main(["relay", *argv, "--hosts", "2", "--run-dir", str(tmp_path / "siteA")])
        assert said in str(stopped.value)
    assert RelayConfig.default_id(tmp_path / "siteA") == "siteA"  # the run directory's name, stable across restarts


def test_the_sites_hosts_may_download_theta_while_the_relay_waits_for_its_upstream(tmp_path) -> None:
    """The relay's round waits for the root's (host x there has not sent): θ does not change meanwhile, so a
    download may start; when the root's sync arrives, the download keeps the θ it started with (copy-on-publish)."""
    root = LocalCoordinator(tmp_path / "root", 2)
    upstream = Upstream(RelayConfig(upstream="http://root", relay_id="site"), client=LocalClient(root, "site"))
    relay = LocalCoordinator(tmp_path / "relay", 2, site=Site(upstream))
    try:
        (x,) = hosts(root, "x")  # the root's model comes from host x; the relay fetches it at its first join
        h0, h1 = hosts(relay, "0", "1")
        before = b"".join(bytes(v) for v in relay.state.model.model_chunks(0))
        for h in (h0, h1, x):
            train(h, 0)
        for h in (h0, h1):
            h.upload(h.encode(h.tensors.live, 8, False))
        wait_for(lambda: "site" in root.rounds.received, 10, "the relay's delta at the root")
        assert relay.rounds.closing
        relay.call(asyncio.wait_for(relay.rounds.wait_stable(), 2))  # a download may start now ...
        stream = relay.state.model.stream(0)
        relay.rounds.downloads.add(stream)
        chunks = stream.chunks(100)
        got = [next(chunks)]
        x.upload(x.encode(x.tensors.live, 8, False))  # ... the root closes, the relay applies its sync to θ
        for h in (h0, h1, x):
            assert h.synchronize().contributed
        got += list(chunks)
        assert b"".join(got) == before != b"".join(bytes(v) for v in relay.state.model.model_chunks(0))
        assert stream.kept_bytes > 0 and h0.model_hash == x.model_hash == root.state.model.hash
    finally:
        relay.close()
        root.close()


def test_every_site_flattens_the_upstreams_values_answer_into_the_same_list() -> None:
    """Two relays under a root, and a relay "sub" under relay B: each site names its own hosts as they are, the
    others' as RELAY/HOST, and every host gets the same payloads in the same order."""
    a = site_payload({"1": "a1", "0": "a0"})
    b = site_payload({"2": "b2", "sub": site_payload({"5": "s5"})})
    root = ValuesReply("k", ["3", "siteA", "siteB"], ["r3", a, b])
    at_a, at_b = flatten(root, "siteA"), flatten(root, "siteB")
    at_sub = flatten(at_b, "sub")  # relay B answers its hosts (relay "sub" among them) with its flattened answer
    assert at_a.payloads == at_b.payloads == at_sub.payloads == ["r3", "a0", "a1", "b2", "s5"]
    assert at_a.hosts == ["3", "0", "1", "siteB/2", "siteB/sub/5"]
    assert at_b.hosts == ["3", "siteA/0", "siteA/1", "2", "sub/5"]
    assert at_sub.hosts == ["3", "siteA/0", "siteA/1", "2", "5"]


def test_an_unreachable_upstream_names_the_relays_upstream_flag_not_the_hosts_variable() -> None:
    with socket_closed_port() as port:
        url = f"http://127.0.0.1:{port}"
        relay = RelayConfig(upstream=url, relay_id="siteA", retry_for=0.5)
        upstream = Upstream(relay, upstream_client(relay))
        with pytest.raises(Unreachable, match=r"did not answer .*Check `nodeox relay --upstream`") as raised:
            upstream.client.status()
        assert "NODEOX_COORDINATOR_URL" not in str(raised.value)
