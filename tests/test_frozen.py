"""Frozen parameters do not travel: a delta carries the tensors that moved, the coordinator averages each tensor
over the deltas that carried it and steps only those, and every host applies the round's set (in this process);
BackboneFinetuning under `nodeox launch` (one slow run)."""

from __future__ import annotations

import importlib.util
import json
import logging
import sys
import time

import pytest
import torch
from helpers import HOSTS, SETTINGS, assert_on_the_run_model, both, launch, load, read_events
from local_transport import LocalClient
from reference_q4 import kernels
from torch import nn

from lightning_nodeox.coordinator.model import CoordinatorModel
from lightning_nodeox.coordinator.outer import OuterSettings
from lightning_nodeox.core.codec import accumulate_tensor, encode_sync_and_apply, encode_tensor
from lightning_nodeox.core.hashing import model_hash
from lightning_nodeox.core.phases import PhaseLog
from lightning_nodeox.core.pool import WorkerPool
from lightning_nodeox.core.protocol import Upload
from lightning_nodeox.core.recent import Recent
from lightning_nodeox.core.specs import ModelMismatchError, spec_of
from lightning_nodeox.core.wire import MessageLayout, Message, MessageMeta
from lightning_nodeox.host.agreement import disagreement
from lightning_nodeox.host.round import HostRound
from lightning_nodeox.host.tensors import HostTensors, shared_tensors


def net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 40), nn.BatchNorm1d(40), nn.Linear(40, 3))


def exchange_for(module: nn.Module) -> HostTensors:
    tensors = HostTensors.of_module(module)
    tensors.allocate(SETTINGS, codec_threads=1)
    return tensors


def names(message: Message) -> list[str]:
    return [s.name for s in message.meta.tensors]


def layout_size(tensors: HostTensors, keep) -> int:
    return MessageLayout.of(tuple(s for s in tensors.specs if keep(s.name)), SETTINGS).total


def test_a_frozen_backbone_stays_out_of_the_delta_which_is_the_size_of_the_rest() -> None:
    module = net()
    module[0].requires_grad_(False)
    ex = exchange_for(module)
    message = ex.encode(ex.live, MessageMeta("delta", 0, "h", "", samples=8), seed=None).join()
    assert names(message) == [n for n, _ in shared_tensors(module) if not n.startswith("0.")]  # BatchNorm stats move
    assert len(message) == layout_size(ex, lambda n: not n.startswith("0.")) < ex.layout.total
    assert Message.parse(message.buffer.clone()).meta.tensors == message.meta.tensors
    ex.close()


def test_the_set_follows_requires_grad_at_each_boundary_and_a_tensor_frozen_mid_round_sends_once() -> None:
    module = net()
    module[0].requires_grad_(False)
    ex = exchange_for(module)
    everything = tuple(range(len(ex.specs)))
    head = tuple(i for i, n in enumerate(ex.names) if not n.startswith("0."))
    assert ex.part.indices == head
    with torch.no_grad():
        ex.residual[0].fill_(0.25)  # a frozen tensor's residual waits for it to move again
    ex.encode(ex.live, MessageMeta("delta", 0, "h", "", samples=8), seed=None).join()
    assert bool((ex.residual[0] == 0.25).all())
    module[0].requires_grad_(True)  # unfrozen during round 1: it moves from round 1 on
    assert ex.boundary().indices == everything
    module[0].requires_grad_(False)  # frozen during round 2: round 2 still sends its change, round 3 no more
    assert ex.boundary().indices == everything
    first = ex.part.message
    assert ex.boundary().indices == head
    module[0].requires_grad_(True)
    assert ex.boundary().indices == everything and ex.part.message is first  # each set's message is kept
    ex.close()


def test_a_frozen_parameter_written_anyway_is_named_when_the_run_ends() -> None:
    module = net()
    module[0].requires_grad_(False)
    ex = exchange_for(module)
    assert ex.frozen_changed() == []
    with torch.no_grad():
        module[0].weight.mul_(0.5)  # an EMA teacher's update: frozen, yet written
        module[2].weight.add_(1.0)  # a trained tensor: its change travels with the next round
    assert ex.frozen_changed() == ["0.weight"]
    text = disagreement("1", "aaaa", "bbbb", ["SomeCallback (on_train_end)"], ex.frozen_changed())
    assert "1 frozen parameter(s) (requires_grad=False) differ from it, e.g. '0.weight'" in text
    assert "register_buffer" in text and "SomeCallback" not in text
    ex.close()


def test_the_last_few_sets_are_kept_and_the_least_recently_used_is_forgotten() -> None:
    made: list[str] = []
    recent = Recent(2)

    def get(key: str) -> str:
        return recent.get(key, lambda: made.append(key) or key.upper())

    assert [get("a"), get("b"), get("a"), get("c"), get("a"), get("b")] == ["A", "B", "A", "C", "A", "B"]
    assert made == ["a", "b", "c", "b"]  # "b" was the least recently used when "c" came
    with pytest.raises(ValueError, match="at least one"):
        Recent(0)


def two_hosts(local_coordinator, frozen_head: str) -> tuple:
    c = local_coordinator()
    modules = [net(0), net(0)]
    modules["ab".index(frozen_head)][2].requires_grad_(False)
    hosts = [HostRound(HostTensors.of_module(m), LocalClient(c, h), PhaseLog(h)) for m, h in zip(modules, "ab")]
    for h in hosts:
        h.join()
    return c, modules, hosts


def nudge(module: nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in module.state_dict().values():
            if t.is_floating_point():
                t.add_(torch.randn(t.shape, generator=gen) * 0.01)


def test_two_hosts_sending_different_sets_get_each_tensors_mean_over_its_senders_and_equal_hashes(
        local_coordinator) -> None:
    c, (ma, mb), (a, b) = two_hosts(local_coordinator, frozen_head="b")  # a's head trains
    theta = [t.clone() for t in c.rounds.model.tensors]
    nudge(ma, 1)
    with torch.no_grad():
        mb[0].weight.add_(0.02)
        mb[1].running_mean.add_(0.5)
    sent = []
    for host, samples in ((a, 8), (b, 24)):  # this arrival order: the sums round as the coordinator's
        host.tensors.boundary()
        message = host.encode(host.tensors.live, samples, False)
        sent.append((Message.parse(message.join().buffer.clone()), samples))
        assert host.upload(message) is Upload.TAKEN
    assert len(names(sent[1][0])) == len(a.tensors.specs) - 2 and "2.weight" not in names(sent[1][0])
    for host in (a, b):
        assert host.synchronize().contributed
    model = c.rounds.model
    sync = model.latest_sync
    assert names(sync) == a.tensors.names  # the union of the two sets
    k = kernels(SETTINGS)
    for i, spec in enumerate(model.specs):
        senders = [(m, w) for m, w in sent if spec in m.meta.tensors]
        if spec.raw:
            continue
        acc = torch.empty(spec.numel)
        for n, (m, w) in enumerate(senders):
            j = m.meta.tensors.index(spec)
            accumulate_tensor(k, m.codes(j), m.scales(j), acc, float(w), assign=n == 0)
        expected = theta[i].clone().view(-1)
        codes, scales = torch.empty_like(sync.codes(i)), torch.empty_like(sync.scales(i))
        encode_sync_and_apply(k, acc, 1 / sum(w for _, w in senders), expected, codes, scales)
        assert torch.equal(model.tensors[i].view(-1), expected), spec.name
        assert len(senders) == (1 if spec.name.startswith("2.") else 2)
    assert a.model_hash == b.model_hash == model.hash == model_hash(model.named())
    assert model_hash(a.tensors.named()) == model_hash(b.tensors.named()) == model.hash  # live models too
    assert torch.equal(mb[2].weight, ma[2].weight)  # b's frozen head took a's change
    for h in (a, b):
        h.close()


def test_overlapped_hosts_that_disagree_fold_the_rounds_set_and_are_told_once(local_coordinator, caplog) -> None:
    c, (ma, mb), (a, b) = two_hosts(local_coordinator, frozen_head="a")
    caplog.set_level(logging.WARNING, logger="lightning_nodeox.host.moving")
    nudge(ma, 1), nudge(mb, 2)
    with torch.no_grad():
        ma[2].weight.copy_(a.tensors.base[a.tensors.names.index("2.weight")])  # a's head is frozen: unchanged
        ma[2].bias.copy_(a.tensors.base[a.tensors.names.index("2.bias")])
    for h in (a, b):
        h.tensors.take_snapshot(restart_from_base=False)
    snapshot = [None if s is None else s.clone() for s in a.tensors.snapshot]
    assert [s is None for s in snapshot] == [n.startswith("2.") for n in a.tensors.names]  # frozen: no copy
    both(lambda: a.run_overlapped(8, False), lambda: b.run_overlapped(8, False))
    assert a.model_hash == b.model_hash == c.rounds.model.hash
    with torch.no_grad():
        ma[0].weight.add_(0.01)  # progress made while the exchange was in flight
    live = [t.clone() for t in a.tensors.live]
    a.tensors.fold(), b.tensors.fold()
    for name, t, x, base, s in zip(a.tensors.names, a.tensors.live, live, a.tensors.base, snapshot):
        if name.startswith("2."):
            assert torch.equal(t, base), name  # b's change of the head, which a did not send
        elif name != "1.num_batches_tracked":
            assert torch.equal(t, x + (base - s)), name
    both(lambda: a.run_round(8, True), lambda: b.run_round(8, True))
    assert_on_the_run_model(c, a, b)
    told = [r.getMessage() for r in caplog.records if r.name == "lightning_nodeox.host.moving"]
    assert len(told) == 1 and "2 tensor(s) another host trained and this host did not send (e.g. '2.weight')" in told[0]
    for h in (a, b):
        h.close()


def test_a_late_host_drops_what_the_round_did_not_take(local_coordinator) -> None:
    c = local_coordinator(round_timeout=0.2, min_hosts=1)
    modules = [net(0), net(0)]
    modules[0][2].requires_grad_(False)  # a sends no head; b's head delta comes too late
    a, b = [HostRound(HostTensors.of_module(m), LocalClient(c, h), PhaseLog(h)) for m, h in zip(modules, "ab")]
    a.join(), b.join()
    nudge(modules[0], 1), nudge(modules[1], 2)
    with torch.no_grad():
        modules[0][2].weight.copy_(a.tensors.base[a.tensors.names.index("2.weight")])
        modules[0][2].bias.copy_(a.tensors.base[a.tensors.names.index("2.bias")])
    a.tensors.boundary(), b.tensors.boundary()
    assert a.upload(a.encode(a.tensors.live, 8, False)) is Upload.TAKEN
    time.sleep(0.3)
    c.tick()  # the round closes on its timeout without b
    assert b.upload(b.encode(b.tensors.live, 8, False)) is Upload.LATE
    a.synchronize(), b.synchronize()
    assert "2.weight" not in names(c.rounds.model.latest_sync)
    assert_on_the_run_model(c, a, b)  # b's head is back on the run's model, as its other tensors
    for h in (a, b):
        h.close()


def test_the_outer_step_moves_only_the_rounds_set_and_a_delta_of_foreign_tensors_is_refused() -> None:
    named = [("w", torch.randn(64, 8)), ("v", torch.randn(64)), ("n", torch.tensor(3))]
    specs = spec_of(named)
    pool = WorkerPool(SETTINGS, "cpu", 1)
    model = CoordinatorModel(specs, [t.clone() for _, t in named], SETTINGS, pool,
                             OuterSettings("nesterov", lr=0.7, momentum=0.9))
    v0 = model.tensors[1].clone()
    subset = (specs[0], specs[2])
    message = Message.allocate(MessageLayout.of(subset, SETTINGS))
    k = kernels(SETTINGS)
    encode_tensor(k, torch.full((512,), 0.01), message.codes(0), message.scales(0))
    message.raw(1).copy_(torch.tensor(7).view(-1).view(torch.uint8))
    message.write_header(MessageMeta("delta", 0, "h", model.hash, samples=4))
    model.accumulate(Message.parse(message.buffer.clone()), 4)
    closed = model.close_round(0)
    assert closed.sync.meta.tensors == subset and len(closed.sync) == message.layout.total
    model.publish(closed.sync)
    assert bool((model.outer.buffers[0] != 0).all()) and bool((model.outer.buffers[1] == 0).all())
    assert torch.equal(model.tensors[1], v0) and int(model.tensors[2]) == 7
    assert model.hash == model_hash(model.named())
    assert model.weights == [0, 0, 0] and not model.moving
    stream = model.stream(1)
    assert [i for i, _ in stream.unsent({0, 2})] == [1, 3]  # a download in flight keeps copies of these alone
    for bad, match in (((specs[2], specs[0]), "out of the model's order"),
                       ((spec_of([("x", torch.zeros(2))])[0],), "'x' is not one of the model's 3 tensors")):
        with pytest.raises(ModelMismatchError, match=match):
            model.positions(bad)
    pool.close()


def finetune_module() -> nn.Module:
    spec = importlib.util.spec_from_file_location("finetune_host", HOSTS / "finetune_host.py")
    host = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(host)
    return host.Finetune()


@pytest.mark.slow
def test_backbone_finetuning_sends_the_head_alone_until_the_backbone_unfreezes_and_hosts_stay_equal(tmp_path) -> None:
    out, run = tmp_path / "out", tmp_path / "run"
    result = launch(run, 2, [sys.executable, str(HOSTS / "finetune_host.py"), "--out", str(out),
                             "--unfreeze-at-epoch", "2"], timeout=180)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    module = finetune_module()
    head = MessageLayout.of(spec_of([(n, p) for n, p in module.named_parameters() if n.startswith("head.")]),
                       SETTINGS).total
    whole = MessageLayout.of(spec_of(shared_tensors(module)), SETTINGS).total
    events = read_events(run)
    uploads = {(e["round"], e["host"]): e["bytes"] for e in events if e["phase"] == "upload"}
    assert uploads == {(r, h): head if r < 2 else whole for r in range(4) for h in "01"}  # epoch 2 = round 2
    assert head < whole
    syncs = {e["round"]: e for e in events if e["phase"] == "sync_prepare"}
    assert [syncs[r]["bytes"] for r in range(4)] == [head, head, whole, whole]
    hosts = [json.loads((out / f"host{h}.json").read_text()) for h in "01"]
    for r in range(4):
        assert hosts[0]["rounds"][str(r)] == hosts[1]["rounds"][str(r)] == syncs[r]["model_hash"], r
    assert hosts[0]["final_hash"] == hosts[1]["final_hash"] == syncs[3]["model_hash"]
    finals = [load(out / f"host{h}_final.safetensors")[0] for h in "01"]
    assert finals[0].keys() == finals[1].keys() and all(torch.equal(finals[0][k], finals[1][k]) for k in finals[0])
    assert not torch.equal(finals[0]["backbone.0.weight"], module.backbone[0].weight.detach())  # it trained


def test_a_frozen_parameter_written_in_the_first_round_moves_from_then_on_and_a_fixed_set_is_not_checked_again(
        caplog) -> None:
    module = net()
    module[0].requires_grad_(False)  # a frozen backbone, never written
    teacher = module[2]
    teacher.requires_grad_(False)  # an EMA teacher: frozen, yet written every step
    ex = exchange_for(module)
    head = tuple(i for i, n in enumerate(ex.names) if n.startswith("1."))  # BatchNorm moves; both Linears frozen
    assert ex.part.indices == head
    with torch.no_grad():
        teacher.weight.mul_(0.5)
    with caplog.at_level(logging.WARNING, logger="lightning_nodeox.host.tensors"):
        part = ex.boundary()
    assert [ex.names[i] for i in part.indices] == ["1.weight", "1.bias", "1.running_mean", "1.running_var",
                                                   "1.num_batches_tracked", "2.weight"]
    assert "1 frozen parameter(s) (requires_grad=False) changed during the round, e.g. '2.weight'" in caplog.text
    assert ex.moving.to_watch() == []  # the flags did not change: nothing is compared at later boundaries
    with torch.no_grad():
        module[0].weight.add_(1.0)  # written later, with the set unchanged: not seen per round (named at the end)
    assert "0.weight" not in [ex.names[i] for i in ex.boundary().indices]
    assert ex.frozen_changed() == ["0.weight"]
    ex.close()
