"""``--merge async`` in-process, with the real round objects: a round closes on its quorum, a late delta is merged
into the round open when it arrives with its staleness rule's weight (checked against the same operations done
by hand, in fp32 where every value is exact), its host applies the syncs it missed and ends bit-identical, a retry
of it is not merged twice, and one beyond ``--max-staleness`` is refused and its host fetches the model."""

from __future__ import annotations

import json

import torch
from helpers import assert_on_the_run_model, deltas, hosts, train
from local_transport import LocalCoordinator

from lightning_nodeox.coordinator.merging import MergeSettings
from lightning_nodeox.core.codecs.settings import FP32Settings
from lightning_nodeox.core.protocol import Upload
from lightning_nodeox.tools import merge_report
from lightning_nodeox.tools.status import render_merge

FP32 = FP32Settings()


def coordinator(tmp_path, rule: str = "age", max_staleness: int = 4) -> LocalCoordinator:
    return LocalCoordinator(tmp_path, 3, codec=FP32, merge=MergeSettings("async", min_quorum=2, grace=0.0,
                                                                         max_staleness=max_staleness,
                                                                         staleness_rule=rule))


def send(host, samples: int) -> Upload:
    return host.upload(host.encode(host.tensors.live, samples, False))


def mean_step(theta: list[torch.Tensor], contributions: list[tuple[list[torch.Tensor], float]]) -> None:
    """The coordinator's operations on ``theta``, in its order: the weighted sum, times one over the weights."""
    total = sum(w for _, w in contributions)
    for i, t in enumerate(theta):
        acc = torch.mul(contributions[0][0][i].reshape(-1), contributions[0][1])
        for d, w in contributions[1:]:
            acc.add_(d[i].reshape(-1), alpha=w)
        t.add_(torch.mul(acc, 1.0 / total).view(t.shape))


def aggregates(c: LocalCoordinator) -> dict[int, dict]:
    lines = (c.config.run_dir / "events.jsonl").read_text().splitlines()
    return {r["round"]: r for r in map(json.loads, lines) if r["phase"] == "aggregate"}


def test_a_delta_one_round_late_is_merged_by_the_rules_formula_and_its_host_catches_up(tmp_path) -> None:
    c = coordinator(tmp_path)
    try:
        a, b, cc = hosts(c, "a", "b", "c")
        theta = [t.clone() for t in a.tensors.live]
        train(a, 0), train(b, 0), train(cc, 0)
        da0, db0, dc0 = deltas(a), deltas(b), deltas(cc)
        assert send(a, 8) is Upload.TAKEN and send(cc, 24) is Upload.TAKEN  # the quorum: round 0 closes without b
        a.synchronize(), cc.synchronize()
        mean_step(theta, [(da0, 8.0), (dc0, 24.0)])
        assert all(torch.equal(x, y) for x, y in zip(a.tensors.live, theta))
        train(a, 1)
        da1 = deltas(a)
        assert send(a, 8) is Upload.TAKEN
        assert send(b, 12) is Upload.TAKEN  # of round 0, while round 1 is open: merged into it, 1 round late
        a.synchronize()
        assert b.round == 0
        b.synchronize()  # round 0's sync (kept), then round 1's, which carries its delta (its close had begun)
        mean_step(theta, [(da1, 8.0), (db0, 12 / (1 + 1))])  # age: samples / (1 + staleness)
        assert all(torch.equal(x, y) for x, y in zip(a.tensors.live, theta))
        assert a.round == b.round == 2
        assert_on_the_run_model(c, a, b)
        records = aggregates(c)
        assert (records[0]["quorum"], records[0]["late"], records[0]["stale"]) == (2, ["b"], {})
        assert (records[1]["hosts"], records[1]["stale"], records[1]["late"]) == (["a", "b"], {"b": 1}, ["c"])
        said = c.run.status()["merge"]  # GET /v1/status, nodeox status and the status page
        assert (said["late_deltas"], said["last"]) == (1, {"round": 1, "quorum": 2, "late": ["c"], "stale": {"b": 1}})
        assert render_merge(said).endswith("round 1 closed without c, late deltas in it: b (1 round late)")
        merge = merge_report.build(list(records.values()))  # nodeox report
        assert merge["hosts"] == {"b": {"rounds_missed": 1, "late_deltas": 1, "staleness_mean": 1, "staleness_max": 1},
                                  "c": {"rounds_missed": 1, "late_deltas": 0, "staleness_mean": None,
                                        "staleness_max": None}}
        assert merge_report.render(merge)[0].startswith("async merge: 2 of 2 rounds closed without every live host")
    finally:
        c.close()


def test_a_retried_late_delta_is_not_merged_twice_and_the_samples_rule_takes_it_whole(tmp_path) -> None:
    c = coordinator(tmp_path, rule="samples")
    try:
        a, b, cc = hosts(c, "a", "b", "c")
        train(a, 0), train(b, 0), train(cc, 0)
        send(a, 8), send(cc, 8)
        a.synchronize(), cc.synchronize()
        train(a, 1)
        send(a, 8)
        late = b.encode(b.tensors.live, 12, False)
        assert b.upload(late) is Upload.TAKEN  # round 1 closes on it (c is not due)
        assert b.client.post_delta(0, late.message.view()) is Upload.TAKEN  # a retry: taken already
        assert c.rounds.received == {} and c.state.round == 2  # not merged again into round 2
        a.synchronize(), b.synchronize()
        assert aggregates(c)[1]["samples"] == 8 + 12 and c.rounds.history.get(1).meta.samples == 20  # whole
        assert_on_the_run_model(c, a, b)
    finally:
        c.close()


def test_a_delta_beyond_max_staleness_is_refused_and_its_host_fetches_the_model(tmp_path) -> None:
    c = coordinator(tmp_path, max_staleness=1)
    try:
        a, b, cc = hosts(c, "a", "b", "c")
        for r in range(2):  # a and c close rounds 0 and 1; b trains from round 0's model all along
            train(a, r), train(cc, r)
            send(a, 8), send(cc, 8)
            a.synchronize(), cc.synchronize()
        train(b, 0)
        assert send(b, 8) is Upload.STALE_BASE  # 2 rounds late: it fetched the model, sent an empty delta
        assert b.round == 2 and b.model_hash == a.model_hash
        assert c.rounds.received == {"b": 0}
    finally:
        c.close()


def test_a_relay_closes_its_sites_round_on_a_quorum_and_merges_a_late_hosts_delta(tmp_path) -> None:
    """A site relay under --merge async (in-process, its root in-process too): round 0 closes on hosts 0 and 1,
    host 2's delta of round 0 goes into round 1, and every host ends on the root's model."""
    from test_site_relay_parts import EventsClient

    from lightning_nodeox.relay.config import RelayConfig
    from lightning_nodeox.relay.run import Site
    from lightning_nodeox.relay.upstream import Upstream

    root = LocalCoordinator(tmp_path / "root", 1)
    upstream = Upstream(RelayConfig(upstream="http://root", relay_id="site"), client=EventsClient(root, "site"))
    relay = LocalCoordinator(tmp_path / "relay", 3, site=Site(upstream),
                             merge=MergeSettings("async", min_quorum=2, grace=0.0))
    try:
        h0, h1, h2 = hosts(relay, "0", "1", "2")
        relay.call(relay.run.site.model.join_upstream_with_model())
        train(h0, 0), train(h1, 0), train(h2, 0)
        send(h0, 8), send(h1, 8)  # the quorum: the site's round 0 goes upstream without host 2
        h0.synchronize(), h1.synchronize()
        train(h0, 1)
        send(h0, 8)
        assert send(h2, 8) is Upload.TAKEN  # of round 0: merged into round 1
        h0.synchronize(), h2.synchronize()
        assert h0.round == h2.round == 2
        assert h0.model_hash == h2.model_hash == relay.state.model.hash == root.state.model.hash
        merged = {r: e for r, e in aggregates(relay).items()}
        assert (merged[0]["late"], merged[1]["stale"]) == (["2"], {"2": 1})
    finally:
        relay.close()
        root.close()


def test_a_late_host_trains_on_and_its_next_delta_waits_for_the_round_holding_its_late_one(tmp_path) -> None:
    """Host b's delta of round 0 is held in round 1 (open: its quorum is not in); b applies round 0's sync and trains
    from round 1's model without waiting; its next delta, sent while round 1 is still open, is not a duplicate of
    the one held: it waits for round 1 to close and goes into round 2, one round late."""
    import asyncio
    import threading

    c = LocalCoordinator(tmp_path, 3, codec=FP32, merge=MergeSettings("async", min_quorum=2, grace=0.0))
    try:
        a, b, cc = hosts(c, "a", "b", "c")
        train(a, 0), train(b, 0), train(cc, 0)
        send(a, 8), send(cc, 8)  # round 0 closes without b
        a.synchronize(), cc.synchronize()
        assert send(b, 8) is Upload.TAKEN  # into round 1, which waits for one more delta
        b.synchronize()
        assert b.round == 1 and c.state.round == 1  # round 0's sync applied; round 1's not waited for
        try:  # a delta of b's of round 1 would wait, while round 1 holds its late one
            c.call(asyncio.wait_for(c.rounds.deltas.wait_open(1, "b"), 0.3))
            raise AssertionError("b's next delta did not wait for the round holding its late one")
        except (TimeoutError, asyncio.TimeoutError):
            pass
        train(b, 1)
        sent = {}
        thread = threading.Thread(target=lambda: sent.setdefault("b", send(b, 8)))
        thread.start()
        train(a, 1)
        send(a, 8)  # round 1's quorum: b's late delta and a's
        thread.join(30)
        assert sent == {"b": Upload.TAKEN}
        a.synchronize(), b.synchronize()
        train(cc, 1)
        send(cc, 8)  # of round 1, into round 2 with b's: round 2's quorum
        for h in (a, b, cc):
            while h.round < 3:
                h.synchronize()
        assert_on_the_run_model(c, a, b, cc)
        records = aggregates(c)
        assert (records[1]["hosts"], records[1]["stale"]) == (["a", "b"], {"b": 1})
        assert (records[2]["hosts"], records[2]["stale"]) == (["b", "c"], {"b": 1, "c": 1})
    finally:
        c.close()
