"""Every host really holds the same state under one hash: integer and boolean buffers are made equal (taken from
one host each round) and hashed, and a callback that changes the weights after the final round is reported, never
hidden behind the run's hash. In-process rounds, and real `nodeox launch` runs with Lightning's SWA and EMA."""

from __future__ import annotations

import json
import re
import sys
import warnings
from types import SimpleNamespace

import pytest
import torch
from helpers import HOSTS, launch, load, read_events
from lightning.pytorch import Callback, LightningModule
from lightning.pytorch.callbacks import EMAWeightAveraging, ModelCheckpoint, StochasticWeightAveraging
from local_transport import LocalClient, LocalCoordinator

from lightning_nodeox.coordinator.model import CoordinatorModel, raw_source_key
from lightning_nodeox.coordinator.outer import OuterSettings
from lightning_nodeox.core.hashing import model_hash
from lightning_nodeox.core.modelfile import model_header, read_model
from lightning_nodeox.core.phases import PhaseLog
from lightning_nodeox.core.pool import WorkerPool
from lightning_nodeox.core.codecs.settings import Q4Settings
from lightning_nodeox.core.specs import spec_of
from lightning_nodeox.host.agreement import FinalHash, averages_weights, suspects
from lightning_nodeox.host.round import HostRound
from lightning_nodeox.host.tensors import HostTensors

COUNTER, MASK = "norm.num_batches_tracked", "mask"


def model() -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    return [("w", torch.randn(50, 40, generator=gen)), (COUNTER, torch.tensor(0)),
            (MASK, torch.zeros(5, dtype=torch.bool)), ("b", torch.randn(50, generator=gen))]


def counted(host: HostRound, count: int) -> None:
    """Local training: the floats move, the counter and the mask take host-specific values."""
    with torch.no_grad():
        live = dict(host.tensors.named())
        live["w"].add_(0.01 * (count % 7))
        live[COUNTER].fill_(count)
        live[MASK].copy_(torch.arange(5) < count % 6)


@pytest.fixture
def coordinator(tmp_path):
    c = LocalCoordinator(tmp_path / "run", 3)
    yield c
    c.close()


def run_round(c: LocalCoordinator, hosts: list[HostRound], counts: dict[str, int], samples: dict[str, int]) -> None:
    for h in hosts:  # uploads in the order given: the choice must not depend on it
        counted(h, counts[h.host])
        assert h.upload(h.encode(h.tensors.live, samples[h.host], False)).value == "taken"
    for h in hosts:
        h.synchronize()


def test_integer_and_boolean_buffers_are_taken_from_the_first_host_id_the_round_took_and_hashed(coordinator) -> None:
    hosts = [HostRound(HostTensors(model()), LocalClient(coordinator, h), PhaseLog(h)) for h in ("b", "10", "9")]
    for h in hosts:
        h.join()
    assert sorted(["b", "10", "9", "x1"], key=raw_source_key) == ["9", "10", "b", "x1"]

    def held(h: HostRound, name: str) -> torch.Tensor:
        return dict(h.tensors.named())[name]

    run_round(coordinator, hosts, {"b": 5, "10": 3, "9": 4}, {"b": 8, "10": 8, "9": 8})
    for h in hosts:  # host "9" sorts first (numeric ids by number), whatever the arrival order
        assert int(held(h, COUNTER)) == 4 and held(h, MASK).tolist() == [True] * 4 + [False]
        assert int(dict(h.tensors.named(h.tensors.base))[COUNTER]) == 4
        assert h.model_hash == coordinator.rounds.model.hash == model_hash(h.tensors.named())
    run_round(coordinator, hosts, {"b": 11, "10": 9, "9": 10}, {"b": 8, "10": 8, "9": 0})
    assert [int(held(h, COUNTER)) for h in hosts] == [9, 9, 9]  # "9" sent no samples: "10" is the first taken
    run_round(coordinator, hosts, {"b": 20, "10": 21, "9": 22}, {"b": 0, "10": 0, "9": 0})
    assert [int(held(h, COUNTER)) for h in hosts] == [9, 9, 9]  # no host trained: the model's values stay
    assert len({h.model_hash for h in hosts}) == 1
    named = hosts[0].tensors.named()
    before = model_hash(named)
    held(hosts[0], COUNTER).add_(1)  # the hash covers the counter
    assert model_hash(named) != before
    for h in hosts:
        h.close()


def test_raw_tensors_have_no_outer_state_and_survive_the_model_file() -> None:
    named = model()
    specs = spec_of(named)
    assert [s.raw for s in specs] == [False, True, True, False]
    pool = WorkerPool(Q4Settings(), "cpu", 1)
    try:
        nesterov = CoordinatorModel(specs, [t.clone() for _, t in named], Q4Settings(), pool,
                                    OuterSettings("nesterov"))
        assert sorted(nesterov.outer.state) == ["momentum/b", "momentum/w"]
    finally:
        pool.close()
    body = bytearray(model_header(specs, 3, "ab" * 16))
    for _, t in named:
        body += t.reshape(-1).view(torch.uint8).numpy().tobytes()
    _, _, got_specs, tensors = read_model(torch.frombuffer(body, dtype=torch.uint8))
    assert got_specs == specs and all(torch.equal(a, b) for a, (_, b) in zip(tensors, named))
    assert tensors[1].dtype == torch.int64 and tensors[2].dtype == torch.bool


class WritesAtTheEnd(Callback):
    def on_train_end(self, trainer, pl_module):
        pass


def test_the_callbacks_that_could_change_the_weights_after_the_final_round_are_named() -> None:
    trainer = SimpleNamespace(lightning_module=LightningModule(), callbacks=[
        StochasticWeightAveraging(swa_lrs=0.1), EMAWeightAveraging(), WritesAtTheEnd(), ModelCheckpoint()])
    found = suspects(trainer)  # the weight-averaging ones write before the final round: never suspects
    assert [f.split(" ")[0] for f in found] == ["WritesAtTheEnd"]
    assert "(on_train_end)" in found[0]
    assert averages_weights(trainer) and not averages_weights(SimpleNamespace(callbacks=[WritesAtTheEnd()]))


def test_a_host_whose_weights_changed_after_the_final_round_reports_their_hash_and_warns_once() -> None:
    class Module(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(3, 2)

    module = Module()
    trainer = SimpleNamespace(lightning_module=module, callbacks=[WritesAtTheEnd()])
    final = FinalHash()
    run_hash = model_hash([(n, t.detach()) for n, t in module.state_dict(keep_vars=True).items()])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert final.check(trainer, "0", run_hash) == run_hash == final.value  # agreed: no warning
    with torch.no_grad():
        module.layer.weight.add_(1.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        held = final.check(trainer, "0", run_hash)
        assert final.check(trainer, "0", run_hash) == held  # the same weights again: no second warning
    assert len(caught) == 1 and held == final.value != run_hash
    assert re.search(rf"host 0 ends fit holding model {held}, NOT the run's final model {run_hash}.*"
                     r"WritesAtTheEnd \(on_train_end\)", str(caught[0].message))


# -- real runs: `nodeox launch --hosts 2` ----------------------------------------------------------------------------
def agree_run(tmp_path, *args: str):
    run_dir, out = tmp_path / "run", tmp_path / "out"
    result = launch(run_dir, 2, [sys.executable, str(HOSTS / "agree_host.py"), "--out", str(out), *args])
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-5000:]
    published = {e["round"]: e["model_hash"] for e in read_events(run_dir) if e["phase"] == "sync_prepare"}
    hosts = {}
    for h in (0, 1):
        after = json.loads((out / f"host{h}_after_fit.json").read_text())
        saved = {}
        for when in ("fit_end", "final"):
            tensors, meta = load(out / f"host{h}_{when}.safetensors")
            named = [(k, tensors[k]) for k in json.loads(meta["order"])]
            saved[when] = (named, meta["model_hash"], model_hash(named))
        hosts[h] = after, saved
    return result, published, hosts


def tensors_of(path) -> dict[str, torch.Tensor]:
    return load(path)[0]


@pytest.mark.slow
@pytest.mark.parametrize("callback", ["swa", "ema"])
@pytest.mark.parametrize("local_steps, rounds", [(5, 4), (7, 3)])  # 20 steps: the last batch on a boundary, or not
def test_weight_averaging_is_sent_in_the_final_round_so_every_host_ends_on_one_model(
        tmp_path, callback, local_steps, rounds) -> None:
    result, published, hosts = agree_run(tmp_path, "--callback", callback, "--local-steps", str(local_steps))
    assert sorted(published) == list(range(rounds))
    final = published[rounds - 1]
    for h, (after, saved) in hosts.items():
        assert after["global_step"] == 20 and after["last_round"] == rounds - 1
        for when, (_, reported, actual) in saved.items():
            assert reported == actual == final, (h, when)  # every host holds the run's final model, bit for bit
        assert after["model_hash"] == final
    assert "ends fit holding model" not in result.stdout + result.stderr
    finals = [dict(hosts[h][1]["final"][0]) for h in (0, 1)]
    assert all(torch.equal(finals[0][k], finals[1][k]) for k in finals[0])
    out = tmp_path / "out"
    trained, averaged = ([tensors_of(out / f"host{h}_{when}.safetensors") for h in (0, 1)]
                         for when in ("trained", "train_end"))
    for name in ("net.0.weight", "net.3.weight"):  # the final round carried the hosts' averages, not what they trained
        to_averaged = (finals[0][name] - (averaged[0][name] + averaged[1][name]) / 2).norm()
        to_trained = (finals[0][name] - (trained[0][name] + trained[1][name]) / 2).norm()
        assert to_averaged < 0.5 * to_trained, name


@pytest.mark.slow
def test_a_host_stopped_by_the_runs_end_drops_its_own_average_and_ends_on_the_final_model(tmp_path) -> None:
    result, published, hosts = agree_run(tmp_path, "--callback", "swa", "--max-steps", "20,13")
    assert sorted(published) == [0, 1, 2]  # host 1 ends inside round 2, host 0 stops at its boundary (step 15)
    for h, (after, saved) in hosts.items():
        assert after["model_hash"] == saved["final"][1] == saved["final"][2] == published[2], h
    assert "ends fit holding model" not in result.stdout + result.stderr
    output = result.stdout + result.stderr
    assert output.count(f"this host ends on the run's final model {published[2]}") == 1
    assert "host 0: the run completed (another host's training ended) before this host's" in output


@pytest.mark.slow
def test_batchnorm_counters_are_equal_on_every_host_after_uneven_steps_and_hashed(tmp_path) -> None:
    result, published, hosts = agree_run(tmp_path, "--max-steps", "20,13")  # host 1 ends inside round 2
    assert hosts[0][0]["global_step"] == 15 and hosts[1][0]["global_step"] == 13  # host 0 stopped with it
    assert sorted(published) == [0, 1, 2]
    finals = {}
    for h, (after, saved) in hosts.items():
        named, reported, actual = saved["final"]
        assert after["model_hash"] == reported == actual == published[2]
        finals[h] = dict(named)
    assert int(finals[0]["net.1.num_batches_tracked"]) == int(finals[1]["net.1.num_batches_tracked"]) == 15
    assert all(torch.equal(finals[0][k].reshape(-1).view(torch.uint8), finals[1][k].reshape(-1).view(torch.uint8))
               for k in finals[0])
    named = hosts[0][1]["final"][0]
    changed = [(k, t + 1 if k == "net.1.num_batches_tracked" else t) for k, t in named]
    assert model_hash(changed) != published[2]  # the hash covers the counter
    assert "ends fit holding model" not in result.stdout
    assert result.stdout.count("integer and boolean tensors, equal on every host from each round on") == 2


def test_overlap_folds_the_runs_raw_values_into_the_live_model() -> None:
    tensors = HostTensors(model())
    tensors.allocate(Q4Settings(), 1)
    try:
        live = dict(tensors.named())
        tensors.take_snapshot(restart_from_base=False)  # the round's boundary: its exchange goes on meanwhile
        with torch.no_grad():
            live["w"].add_(1.0)  # training after the boundary
            live[COUNTER].fill_(7)
            base = dict(tensors.named(tensors.base))
            base[COUNTER].fill_(5)  # the round's sync arrived: θ_{r+1}
            base["w"].add_(0.5)
        expected_w = base["w"] + 1.0
        tensors.fold()
        assert int(live[COUNTER]) == 5 and torch.allclose(live["w"], expected_w)
    finally:
        tensors.close()
