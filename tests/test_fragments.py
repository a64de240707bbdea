"""Streaming fragments (NodeoxStrategy(fragments=F)): the cut, the settings, rounds of one fragment each against the
in-process coordinator (every fragment's sync applied once a cycle, hosts bit-identical, a fragment's message a
fragment's bytes, the final round all), a host that missed a fragment's sync, overlap's snapshot of one fragment,
hosts behind a relay; and one Lightning run under `nodeox launch` with EarlyStopping mid-cycle and a skipped sync. The coordinator restart
in the middle of a cycle is in test_restart.py."""

from __future__ import annotations

import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from helpers import HOSTS, assert_on_the_run_model, bits, launch, load, model, read_events, train_on_model, upload
from local_transport import LocalClient, LocalCoordinator

from lightning_nodeox import NodeoxStrategy
from lightning_nodeox.core.hashing import model_hash
from lightning_nodeox.core.phases import PhaseLog
from lightning_nodeox.core.codecs.settings import Q4Settings
from lightning_nodeox.core.protocol import Upload
from lightning_nodeox.core.specs import spec_of
from lightning_nodeox.core.wire import MessageLayout
from lightning_nodeox.host.fragments import Fragments
from lightning_nodeox.host.round import HostRound
from lightning_nodeox.host.settings import HostSettings
from lightning_nodeox.host.tensors import HostTensors
from lightning_nodeox.relay.config import RelayConfig
from lightning_nodeox.relay.run import Site
from lightning_nodeox.relay.upstream import Upstream

SHAPES = {"a.weight": (32, 32), "a.bias": (32,), "b.weight": (32, 32), "b.bias": (32,), "c.weight": (32, 32),
          "c.bias": (32,), "d.weight": (32, 32), "norm.running_mean": (32,)}


def test_the_cut_is_runs_of_consecutive_tensors_of_about_equal_bytes_and_rounds_take_them_in_turn() -> None:
    sizes = [4800, 160, 4800, 120, 6400, 160]
    fragments = Fragments(3, sizes)
    everything = tuple(range(6))
    cut = fragments.cut(everything)
    assert cut == ((0, 1), (2, 3), (4, 5))
    assert all(sum(sizes[i] for i in f) <= sum(sizes) / 3 + max(sizes) for f in cut)
    assert [fragments.of_round(everything, r) for r in range(7)] == [cut[0], cut[1], cut[2]] * 2 + [cut[0]]
    assert fragments.cut((1, 3, 5)) == ((1,), (3,), (5,))  # of the tensors that move (frozen ones stay out)
    assert Fragments(4, [10, 10]).cut((0, 1)) == ((0,), (1,))  # fewer tensors than fragments: fewer fragments
    assert Fragments(2, [5, 0, 5]).cut((0, 1, 2)) in (((0,), (1, 2)), ((0, 1), (2,)))
    assert Fragments(1, sizes).of_round(everything, 5) == everything
    with pytest.raises(ValueError, match="at least 1"):
        Fragments(0, sizes)


def fragment_bytes(sizes: list[int], count: int) -> list[int]:
    return [sum(sizes[i] for i in f) for f in Fragments(count, sizes).cut(tuple(range(len(sizes))))]


def test_fragments_hold_about_equal_bytes_and_no_small_tensor_stands_alone_beside_large_ones() -> None:
    assert fragment_bytes([4096] + [256] * 40, 4) == [4096, 3328, 3328, 3584]  # within 1.25x of each other
    # the 2560 bytes before the big tensor cannot join it (4096 is a fragment's most): within 1.6x
    assert fragment_bytes([256] * 10 + [4096] + [256] * 30, 4) == [2560, 4096, 3584, 4096]
    over_a_share = [16384] + [256] * 100 + [1024] * 5
    cut = fragment_bytes(over_a_share, 4)  # the big tensor alone, as small as a fragment can be; the rest even
    assert len(cut) == 4 and max(cut) == 16384 and max(cut[1:]) <= 1.1 * min(cut[1:]), cut
    digits = [16384, 256, 256, 256, 256, 256, 2560, 40]  # Linear(64, 64), BatchNorm1d(64), Linear(64, 10)
    assert fragment_bytes(digits, 4) == [16384, 512, 512, 2856]  # four fragments, no lone 256-byte bias


DIGITS = {"net.0.weight": (64, 64), "net.0.bias": (64,), "net.1.weight": (64,), "net.1.bias": (64,),
          "net.1.running_mean": (64,), "net.1.running_var": (64,), "net.3.weight": (10, 64), "net.3.bias": (10,)}


def run_bytes(c, fragments: int, cycles: int) -> tuple[int, int]:
    """Host a's upload bytes (its phase records) and values bytes over ``cycles`` x ``fragments`` rounds and the
    final one, with two hosts of the digits model."""
    hosts = [HostRound(HostTensors(model(seed=i, shapes=DIGITS), fragments=fragments), LocalClient(c, h),
                       PhaseLog(h)) for i, h in enumerate("ab")]
    uploads = []
    hosts[0].phases.listeners.append(lambda r: uploads.append(r.bytes) if r.phase == "upload" else None)
    for h in hosts:
        h.join()
    values = 0
    for r in range(cycles * fragments + 1):
        final = r == cycles * fragments
        values += one_round(hosts, r, final=final)[0]
    for h in hosts:
        h.close()
    return sum(uploads), values


def test_fragments_send_q4s_value_bytes_over_a_run_and_a_header_more_a_message(local_coordinator) -> None:
    cycles, count = 4, 4
    whole, whole_values = run_bytes(local_coordinator(), 1, cycles)
    split, split_values = run_bytes(local_coordinator(), count, cycles)
    assert split_values == whole_values  # the same values over the run: each fragment once every local_steps
    header = MessageLayout.of(tuple(spec_of(model(shapes=DIGITS))), Q4Settings()).data_start
    assert header > 4096 and split - whole <= (count - 1) * cycles * header  # the rest is headers
    print(f"digits model, {cycles} cycles: fragments={count} send {split / whole:.2f}x q4's bytes "
          f"({split} vs {whole}); header {header} B a message")


def test_fragments_must_split_local_steps_and_the_error_names_a_fix() -> None:
    with pytest.raises(ValueError, match=r"choose local_steps a multiple of fragments \(e.g. local_steps=8\)"):
        NodeoxStrategy(local_steps=10, fragments=4)
    with pytest.raises(ValueError, match="at least 1"):
        HostSettings(fragments=0)
    assert HostSettings(local_steps=20, fragments=4).round_steps == 5
    budget = HostSettings(local_steps=10, round_seconds=8.0, fragments=4)  # a time budget need not split steps
    assert budget.round_budget == 2.0
    assert NodeoxStrategy(local_steps=20, fragments=4).settings.fragments == 4


def fragment_hosts(c, fragments: int = 4) -> list[HostRound]:
    hosts = [HostRound(HostTensors(model(seed=i, shapes=SHAPES), fragments=fragments), LocalClient(c, h), PhaseLog(h))
             for i, h in enumerate("ab")]
    for h in hosts:
        h.join()
    return hosts


def one_round(hosts: list[HostRound], r: int, *, final: bool = False) -> list[int]:
    """Hosts train and exchange round ``r``; returns the bytes of values (codes and scales) each sent."""
    sent = []
    for k, h in enumerate(hosts, 1):
        train_on_model(h, k, r)
        h.tensors.boundary(h.round, final=final)
        reader = h.encode(h.tensors.live, 16, final)
        sent.append(values_bytes(reader.message.layout))
        assert h.upload(reader) is Upload.TAKEN
    for h in hosts:
        assert h.synchronize(follow_to_end=final).contributed
    return sent


def values_bytes(layout) -> int:
    return sum(r.codes[1] - r.codes[0] + r.scales[1] - r.scales[0] for r in layout.regions)


def test_each_round_exchanges_one_fragment_every_fragment_syncs_once_a_cycle_and_hosts_stay_bit_identical(
        local_coordinator) -> None:
    c = local_coordinator()
    a, b = fragment_hosts(c)
    cut = a.tensors.fragments.cut(tuple(range(len(SHAPES))))
    assert len(cut) == 4
    applied: dict[int, list[str]] = {}
    original = a.tensors.apply_piece

    def counting(applying, k):
        piece = applying.sync.layout.pieces[k]
        applied.setdefault(applying.sync.meta.round, []).extend(
            s.name for s in applying.sync.meta.tensors[piece.first:piece.stop])
        original(applying, k)

    a.tensors.apply_piece = counting
    whole = values_bytes(a.tensors.layout)
    for r in range(8):
        sent = one_round([a, b], r)
        fragment = [a.tensors.names[i] for i in cut[r % 4]]
        assert applied[r] == fragment  # the round's sync is the fragment's, each tensor applied once
        theta = c.rounds.model.tensors
        assert a.model_hash == b.model_hash == c.rounds.model.hash == model_hash(c.rounds.model.named())
        for h in (a, b):
            assert all(torch.equal(base, t) for base, t in zip(h.tensors.base, theta))  # base is θ, whole
            for i, (live, t) in enumerate(zip(h.tensors.live, theta)):
                # the fragment just synced is θ's; the fragments synced before trained on since
                assert torch.equal(live, t) == (i in cut[r % 4]), (r, h.host, i)
        assert max(sent) <= 0.3 * whole  # a fragment's bytes (4 fragments of about equal bytes)
    cycle = sorted(n for r in range(4) for n in applied[r])
    assert cycle == sorted(a.tensors.names) == sorted(n for r in range(4, 8) for n in applied[r])
    sent = one_round([a, b], 8, final=True)
    assert sent == [whole, whole] and applied[8] == a.tensors.names  # the final round exchanges every tensor
    assert c.run.status()["complete"]
    assert_on_the_run_model(c, a, b)  # live models equal to θ, bit for bit
    for h in (a, b):
        h.close()


def test_a_host_that_missed_a_fragments_sync_fetches_the_model_and_sends_the_rounds_fragment_empty(
        local_coordinator) -> None:
    c = local_coordinator(round_timeout=0.2, min_hosts=1)
    a, b = fragment_hosts(c)
    cut = a.tensors.fragments.cut(tuple(range(len(SHAPES))))
    for r in range(2):  # b sleeps through rounds 0 and 1 (fragments 0 and 1)
        train_on_model(a, 1, r)
        a.tensors.boundary(a.round)
        upload(a)
        time.sleep(0.3)
        c.tick()
        a.synchronize()
    train_on_model(b, 2, 0)
    b.tensors.boundary(b.round)
    assert upload(b) is Upload.STALE_BASE  # b fetched the model and sent an empty delta for round 2 ...
    assert b.round == a.round == 2 and b.tensors.part.indices == cut[2]  # ... of round 2's fragment
    train_on_model(a, 1, 2)
    a.tensors.boundary(a.round)
    upload(a)
    a.synchronize(), b.synchronize()
    assert [s.name for s in c.rounds.model.latest_sync.meta.tensors] == [a.tensors.names[i] for i in cut[2]]
    assert a.model_hash == b.model_hash == c.rounds.model.hash
    one_round([a, b], 3)
    one_round([a, b], 4, final=True)
    assert_on_the_run_model(c, a, b)
    for h in (a, b):
        h.close()


def test_overlap_snapshots_one_fragment_and_folds_the_rest_of_training_on_top_of_its_sync(local_coordinator) -> None:
    c = local_coordinator()
    a, b = fragment_hosts(c)
    cut = a.tensors.fragments.cut(tuple(range(len(SHAPES))))
    one_round([a, b], 0)
    for h in (a, b):
        h.tensors.take_snapshot(restart_from_base=False, round_=h.round)
        kept = [i for i, s in enumerate(h.tensors.snapshot) if s is not None]
        assert kept == list(cut[1])  # the snapshot holds round 1's fragment alone
    before = [[t.clone() for t in h.tensors.live] for h in (a, b)]
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda h: h.run_overlapped(16, False), (a, b)))
    assert [r.round for r in results] == [1, 1] and a.model_hash == b.model_hash == c.rounds.model.hash
    for h, live0 in zip((a, b), before):
        train_on_model(h, 3, 99)  # training went on meanwhile
        progress = [t - s for t, s in zip(h.tensors.live, live0)]
        h.tensors.fold()
        theta = c.rounds.model.tensors
        for i in cut[1]:  # θ_{r+1} plus the progress made since the snapshot
            assert torch.allclose(h.tensors.live[i], theta[i] + progress[i], atol=1e-6)
        for i in set(range(len(SHAPES))) - set(cut[1]):  # the other fragments: untouched by the fold
            assert torch.equal(h.tensors.live[i], live0[i] + progress[i]) or torch.allclose(
                h.tensors.live[i], live0[i] + progress[i], atol=1e-7)
    one_round([a, b], 2, final=True)
    assert_on_the_run_model(c, a, b)
    for h in (a, b):
        h.close()


def test_hosts_behind_a_relay_exchange_fragments_and_end_on_the_roots_model(tmp_path) -> None:
    """A relay passes fragments through as any set: its delta upstream is its site's fragment, the root's sync of
    it comes down unchanged, and the hosts end bit-identical to the root after the final round of every tensor."""
    root = LocalCoordinator(tmp_path / "root", 1)
    upstream = Upstream(RelayConfig(upstream="http://root", relay_id="site"), client=LocalClient(root, "site"))
    relay = LocalCoordinator(tmp_path / "relay", 2, site=Site(upstream))
    try:
        hosts = [HostRound(HostTensors(model(seed=0, shapes=SHAPES), fragments=4), LocalClient(relay, h), PhaseLog(h))
                 for h in "ab"]
        for h in hosts:
            h.join()
        relay.call(relay.run.site.model.join_upstream_with_model())
        cut = hosts[0].tensors.fragments.cut(tuple(range(len(SHAPES))))
        for r in range(5):
            one_round(hosts, r, final=r == 4)
            synced = [s.name for s in root.state.model.latest_sync.meta.tensors]
            assert synced == (hosts[0].tensors.names if r == 4 else [hosts[0].tensors.names[i] for i in cut[r % 4]])
            assert bits(relay.state.model.latest_sync.buffer).equal(bits(root.state.model.latest_sync.buffer))
            assert hosts[0].model_hash == hosts[1].model_hash == relay.state.model.hash == root.state.model.hash
        for h in hosts:
            assert all(torch.equal(bits(t), bits(e)) for t, e in zip(h.tensors.live, root.state.model.tensors))
            h.client.leave()
            h.close()
    finally:
        relay.close()
        root.close()


STEPS_PER_EPOCH = 56  # 1797 digits in batches of 32, the last one dropped


@pytest.mark.slow
def test_a_lightning_run_in_fragments_stops_together_mid_cycle_and_a_host_that_skipped_a_sync_catches_up(
        tmp_path) -> None:
    """Digits under `nodeox launch`, fragments=4, local_steps=12 (a round every 3 steps); the digits net's first
    weight holds 81% of its bytes, so it is a fragment alone and the other tensors make the other 3. Host 1 does not apply round 5's sync
    (it fetches the model), and EarlyStopping ends host 1 at its first epoch end (step 56, inside round 18): host 0
    stops at its next boundary, the final round carries every tensor and both end on the coordinator's final
    model."""
    run_dir, out = tmp_path / "run", tmp_path / "out"
    result = launch(run_dir, 2, [sys.executable, str(HOSTS / "digits_host.py"), "--out", str(out), "--max-steps", "200",
                                 "--local-steps", "12", "--fragments", "4", "--stop-host", "1",
                                 "--skip-sync-round", "5"])
    assert result.returncode == 0, result.stdout[-5000:]
    assert result.stdout.count("nodeox: 4 fragments of 0.0164/") == 2 and "fragments=4 asked" not in result.stdout
    events = read_events(run_dir)
    published = {e["round"]: e["model_hash"] for e in events if e["phase"] == "sync_prepare"}
    assert sorted(published) == list(range(19))  # a round every 3 steps; the stop's round is the last
    t0, m0 = load(out / "host0_final.safetensors")
    t1, m1 = load(out / "host1_final.safetensors")
    assert m0["model_hash"] == m1["model_hash"] == published[18]
    assert all(torch.equal(bits(t0[k]), bits(t1[k])) for k in t0)
    fetched = [e["round"] for e in events if e["phase"] == "fallback_fetch" and e["host"] == "1"]
    assert [r for r in fetched if r > 0] == [6]  # (and maybe at join) after the sync of round 5 it did not apply
    sent = {(e["round"], e["host"]): e["bytes"] for e in events if e["phase"] == "upload" and not e.get("empty")}
    whole = max(sent.values())
    steady = {r: b for (r, h), b in sent.items() if r < 18 and h == "0"}
    cycle = [steady[r] for r in range(4)]  # the first weight, then three runs of the rest
    assert all(b == cycle[r % 4] for r, b in steady.items()) and sum(cycle) > whole > max(cycle)
    assert sent[18, "1"] == whole  # host 1's final delta: every tensor
    assert sent[18, "0"] == cycle[18 % 4]  # host 0 learned of the end from the round's sync: it had sent its fragment
    samples = {e["round"]: e["samples"] for e in events if e["phase"] == "aggregate"}
    assert samples[10] == 2 * 4 * 3 * 32  # a fragment's delta weighs what it trained since its own last sync
