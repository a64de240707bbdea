"""NodeoxFabricStrategy: Fabric's way in (registry, refusals), a Fabric loop in this process against the in-process
coordinator, and two hosts under `nodeox launch`."""

from __future__ import annotations

import json
import os
import re
import signal
import sys

import pytest
import torch
from helpers import HOSTS, REPO, launch, read_events
from lightning.fabric import Fabric
from lightning.fabric.strategies import STRATEGY_REGISTRY
from lightning.pytorch.utilities.exceptions import SIGTERMException
from local_transport import LocalClient, LocalCoordinator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_nodeox import NodeoxFabricStrategy, NodeoxStrategy
from lightning_nodeox.coordinator.hosts import HostState
from lightning_nodeox.core.hashing import model_hash
from lightning_nodeox.core.phases import TRAIN
from lightning_nodeox.host.ledger_sampler import LedgerSampler
from lightning_nodeox.host.tensors import shared_tensors


def test_fabric_takes_the_strategy_by_name() -> None:
    assert STRATEGY_REGISTRY["nodeox"]["strategy"] is NodeoxFabricStrategy
    fabric = Fabric(strategy="nodeox", accelerator="cpu", devices=1)
    assert isinstance(fabric.strategy, NodeoxFabricStrategy)
    assert fabric.device == torch.device("cpu") and fabric.world_size == 1 and fabric.is_global_zero


def test_what_fabric_cannot_take_names_the_fix() -> None:
    with pytest.raises(TypeError, match=r"Fabric\(strategy=NodeoxFabricStrategy\(local_steps=7, \.\.\.\)\)"):
        Fabric(strategy=NodeoxStrategy(local_steps=7), accelerator="cpu")
    with pytest.raises(ValueError, match=r"one device, got Fabric\(devices=2\).*Fabric\(devices=1"):
        Fabric(strategy=NodeoxFabricStrategy(), accelerator="cpu", devices=2)
    for strategy in ("nodeox", NodeoxFabricStrategy()):  # each machine would join as a host of its own
        with pytest.raises(ValueError, match=r"got Fabric\(num_nodes=2\).*Fabric\(devices=1, num_nodes=1, .*"
                                             r"Trainer\(devices=K, num_nodes=M, .*A host that spans machines"):
            Fabric(strategy=strategy, accelerator="cpu", devices=1, num_nodes=2)
    assert Fabric(strategy="nodeox", accelerator="cpu", devices=1, num_nodes=1).strategy.num_nodes == 1
    with pytest.raises(ValueError, match="local_steps must be at least 1"):
        NodeoxFabricStrategy(local_steps=0)
    with pytest.raises(ValueError, match="max_steps must be at least 1"):
        NodeoxFabricStrategy(max_steps=0)
    with pytest.raises(TypeError, match="local_step"):
        NodeoxFabricStrategy(local_step=5)


def _fabric(coordinator: LocalCoordinator, local_steps: int, **settings) -> tuple[Fabric, nn.Module, object]:
    strategy = NodeoxFabricStrategy(coordinator_url="http://unused.invalid", host_id="solo", local_steps=local_steps,
                                    client=lambda conn: LocalClient(coordinator, conn.host_id), **settings)
    fabric = Fabric(strategy=strategy, accelerator="cpu", devices=1)
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    return fabric, model, optimizer


def _step(fabric: Fabric, model, optimizer) -> torch.Tensor:
    loss = model(torch.ones(3, 4)).square().mean()
    fabric.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


def test_a_fabric_loop_closes_rounds_in_optimizer_steps_and_finishes_on_the_run_model(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("NODEOX_RUN_DIR", str(tmp_path / "run"))
    c = LocalCoordinator(tmp_path / "run", 1)
    try:
        fabric, model, optimizer = _fabric(c, local_steps=3)
        strategy = fabric.strategy
        own, shared = [], []
        for _ in range(7):  # rounds close at steps 3 and 6; the final round holds step 7
            own.append(float(_step(fabric, model, optimizer)))
            shared.append(float(fabric.all_reduce(torch.tensor(own[-1]))))
            pair = fabric.all_reduce({"a": torch.tensor(1.0), "b": torch.tensor(2.0)})  # one call, two values
        line = sys._getframe().f_lineno
        assert strategy.last_result.round == 1 and not strategy.should_stop
        # one host: the run's value is this host's value sent with the last round (until then its own)
        assert shared == [own[0], own[1], own[1], own[1], own[1], own[4], own[4]]
        assert sorted(strategy.metrics.local) == [f"all_reduce@test_fabric.py:{line - 2}",
                                                  f"all_reduce@test_fabric.py:{line - 1}",
                                                  f"all_reduce@test_fabric.py:{line - 1}[1]"]
        assert {k: float(v) for k, v in pair.items()} == {"a": 1.0, "b": 2.0}
        final = strategy.finish()
        assert strategy.last_result.round == 2 and strategy.should_stop and strategy.steps == 7
        assert final == c.rounds.model.hash == model_hash(shared_tensors(model))
        before = [t.clone() for t in model.parameters()]
        _step(fabric, model, optimizer)  # after the run completed: skipped, the model stays the run's
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        fabric.save("final.ckpt", {"model": model})  # the host's own folder under nodeox launch
        saved = torch.load(tmp_path / "run" / "hosts" / "hostsolo" / "final.ckpt")["model"]
        assert all(torch.equal(saved[k], v) for k, v in model.state_dict().items())
    finally:
        c.close()


def test_a_fabric_train_loader_reads_the_ledger_and_each_pass_ends_its_round(local_coordinator, tmp_path,
                                                                             monkeypatch) -> None:
    """One host: the shuffled loader set up gets the ledger's sampler, an unshuffled one keeps its order; each pass
    is the ledger's whole epoch, each sample once, and its end closes a round though local_steps never came."""
    monkeypatch.setenv("NODEOX_RUN_DIR", str(tmp_path / "run"))
    c = local_coordinator(1, data_unit=30)
    fabric, model, optimizer = _fabric(c, local_steps=100)
    data = TensorDataset(torch.arange(100.0).unsqueeze(1).expand(100, 4).contiguous())
    train, held_out = fabric.setup_dataloaders(DataLoader(data, batch_size=10, shuffle=True), DataLoader(data, 10))
    assert isinstance(train.sampler, LedgerSampler) and train.batch_size == 10
    assert [int(i) for (x,) in held_out for i in x[:, 0]] == list(range(100))  # every host evaluates all of it
    with pytest.raises(ValueError, match="shares out one train loader.*use_distributed_sampler=False"):
        fabric.setup_dataloaders(DataLoader(data, batch_size=10, shuffle=True))
    assert not isinstance(fabric.setup_dataloaders(DataLoader(data, batch_size=10, shuffle=True),
                                                   use_distributed_sampler=False).sampler, LedgerSampler)
    seen = []
    for _ in range(2):
        seen.append([])
        for (x,) in train:
            seen[-1] += [int(i) for i in x[:, 0]]
            fabric.backward(model(x * 0.0).square().mean())
            optimizer.step()
            optimizer.zero_grad()
    assert [sorted(s) for s in seen] == [list(range(100))] * 2 and seen[0] != list(range(100))  # shuffled
    trained = [(r.extra["steps"], r.extra["samples"]) for r in fabric.strategy.phase_records if r.phase == TRAIN]
    assert trained == [(10, 10), (10, 10)]  # each pass's end closed its round (a Fabric step weighs as one sample)
    assert c.state.data.ledger.epoch == 2  # both epochs committed
    with pytest.raises(ValueError, match="after this host joined the run"):
        fabric.setup_dataloaders(DataLoader(data, batch_size=10, shuffle=True))
    fabric.strategy.finish()


def test_short_fabric_rounds_fold_their_progress_lines(tmp_path, monkeypatch, caplog) -> None:
    monkeypatch.setenv("NODEOX_RUN_DIR", str(tmp_path / "run"))
    c = LocalCoordinator(tmp_path / "run", 1)
    try:
        fabric, model, optimizer = _fabric(c, local_steps=1)
        with caplog.at_level("INFO", logger="lightning_nodeox.host.fabric"):
            for _ in range(4):  # four rounds well within EVERY_S: the first line shown, the others folded
                _step(fabric, model, optimizer)
            fabric.strategy.finish()  # the round that completes the run is always shown
        lines = [r.getMessage() for r in caplog.records if r.name == "lightning_nodeox.host.fabric"]
        assert [line.split(",")[0] for line in lines] == ["nodeox: host solo round 0",
                                                          "nodeox: host solo rounds 1-4"]
        assert lines[-1].endswith("(the run is complete)")
    finally:
        c.close()


def test_teardown_without_finish_finishes_unless_an_exception_is_on_its_way(tmp_path) -> None:
    for failing in (False, True):
        c = LocalCoordinator(tmp_path / f"run{failing}", 1)
        try:
            fabric, model, optimizer = _fabric(c, local_steps=3)
            for _ in range(4):
                _step(fabric, model, optimizer)
            try:
                if failing:
                    raise RuntimeError("the loop failed")
            except RuntimeError:
                fabric.strategy.teardown()  # as in a finally: leaves without a final round
            else:
                fabric.strategy.teardown()
            assert fabric.strategy.last_result.round == (0 if failing else 1)
            assert fabric.strategy.should_stop is not failing
            assert c.rounds.model.hash == model_hash(shared_tensors(model)) or failing
        finally:
            c.close()


def test_a_host_joins_at_its_first_step_and_max_steps_makes_the_round_closing_there_final(tmp_path) -> None:
    c = LocalCoordinator(tmp_path / "run", 1)
    try:
        fabric, model, optimizer = _fabric(c, local_steps=3, max_steps=5)
        strategy = fabric.strategy
        with torch.no_grad():  # weights loaded after fabric.setup (LitGPT's order) are the ones the host joins with
            model.weight.fill_(0.5)
        loaded = model_hash(shared_tensors(model))
        assert strategy.model_hash is None
        _step(fabric, model, optimizer)
        assert strategy.model_hash == loaded  # the run's model, as this host provided it at its first step
        for _ in range(4):
            assert not strategy.should_stop
            _step(fabric, model, optimizer)
        assert strategy.should_stop and strategy.last_result.round == 1  # rounds of 3 and 2 steps, no empty third
        assert strategy.finish() == c.rounds.model.hash == model_hash(shared_tensors(model))
        assert strategy.last_result.round == 1
    finally:
        c.close()


def test_sigterm_leaves_the_run_at_the_next_step_and_exits_143_and_a_tensor_is_refused(tmp_path) -> None:
    c, previous = LocalCoordinator(tmp_path / "run", 1), signal.getsignal(signal.SIGTERM)
    try:
        fabric, model, optimizer = _fabric(c, local_steps=3)
        _step(fabric, model, optimizer)
        with pytest.raises(ValueError, match=r"shape \(2,\): reduce it to a scalar first"):
            fabric.all_reduce(torch.ones(2))
        os.kill(os.getpid(), signal.SIGTERM)  # the strategy's handler notes it; the next step leaves
        with pytest.raises(SIGTERMException) as raised:
            _step(fabric, model, optimizer)
        assert raised.value.code == 143 and fabric.strategy.last_result is None
        assert c.state.hosts["solo"].state is HostState.LEFT  # it said goodbye
    finally:
        signal.signal(signal.SIGTERM, previous)
        c.close()


@pytest.mark.slow
def test_two_fabric_hosts_share_values_stop_together_and_end_on_one_model(tmp_path) -> None:
    out, run_dir = tmp_path / "out", tmp_path / "run"
    result = launch(run_dir, 2, [sys.executable, str(HOSTS / "fabric_host.py"), "--out", str(out),
                                 "--local-steps", "5", "--max-steps", "40", "--stop-host", "1", "--stop-step", "12"],
                    timeout=120)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    hosts = {h: json.loads((out / f"host{h}.json").read_text()) for h in "01"}
    # host 1 stopped after 12 steps (its final round 2); host 0 learned it at its next boundary, step 15
    assert (hosts["0"]["steps"], hosts["1"]["steps"]) == (15, 12)
    assert hosts["0"]["last_round"] == hosts["1"]["last_round"] == 2 and hosts["0"]["should_stop"]
    assert hosts["0"]["model_hash"] == hosts["1"]["model_hash"]
    saved = [torch.load(run_dir / "hosts" / f"host{h}" / "final.ckpt")["model"] for h in "01"]  # each its own
    assert saved[0].keys() == saved[1].keys() and all(torch.equal(saved[0][k], saved[1][k]) for k in saved[0])

    def closed(h: str, round_: int) -> int:
        """The step where host h closed round ``round_`` (its last step, for its final round)."""
        return next((r["step"] for r in hosts[h]["records"] if r["round"] == round_), hosts[h]["steps"])

    def sent(h: str, round_: int) -> tuple[float, int]:
        """Host h's value that round ``round_`` carried (its last before closing it), and its steps in it."""
        before = [r for r in hosts[h]["records"] if r["round"] == round_ - 1]
        return before[-1]["own"], closed(h, round_) - (closed(h, round_ - 1) if round_ else 0)

    for round_ in (0, 1, 2):  # 2: host 1's final round of 2 steps against host 0's 5
        pairs = [sent(h, round_) for h in "01"]
        mean = sum(v * n for v, n in pairs) / sum(n for _, n in pairs)
        seen = {r["shared"] for h in "01" for r in hosts[h]["records"] if r["round"] == round_}
        assert len(seen) == 1 and seen.pop() == pytest.approx(mean, rel=1e-6), round_
    assert all(r["shared"] == r["own"] for h in "01" for r in hosts[h]["records"] if r["round"] == -1)


@pytest.mark.slow
def test_the_fabric_example_ends_every_host_on_one_model(tmp_path) -> None:
    result = launch(tmp_path / "run", 2, [sys.executable, str(REPO / "examples" / "fabric_finetune.py"), "--max-steps",
                                          "20", "--local-steps", "10", "--eval-interval", "20"], timeout=120)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ends = {h: (int(n), m) for h, n, m in re.findall(r"\[host (\d)\] host \d: (\d+) steps, final model ([0-9a-f]{32})",
                                                   result.stdout)}
    assert sorted(ends) == ["0", "1"] and ends["0"][1] == ends["1"][1]  # one final model
    assert 20 in (ends["0"][0], ends["1"][0]) and all(n <= 20 for n, _ in ends.values())  # max_steps ended the run
    assert all((tmp_path / "run" / "hosts" / f"host{h}" / "final.ckpt").is_file() for h in "01")


@pytest.mark.slow
@pytest.mark.parametrize("overlap", ["off", "eager"])
def test_two_fabric_hosts_share_the_epoch_through_the_data_ledger(tmp_path, overlap) -> None:
    """``fabric.setup_dataloaders(loader)`` gives each host the ledger's sampler; a pass ends where the ledger has
    nothing more for the host, and its round closes there by itself. The hosts' first passes, joined, are every
    index once, and the coordinator committed exactly the epoch before it ended."""
    out, run_dir = tmp_path / "out", tmp_path / "run"
    result = launch(run_dir, 2, [sys.executable, str(HOSTS / "fabric_host.py"), "--out", str(out), "--ledger",
                                 "--log-indices", "--passes", "2", "--max-steps", "100000", "--local-steps", "6",
                                 "--overlap", overlap], "--data-unit", "128", timeout=120)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    first = {h: [i for p, i in json.loads((out / f"host{h}_indices.json").read_text()) if p == 0] for h in "01"}
    assert sorted(first["0"] + first["1"]) == list(range(1797))  # none lost, none twice
    assert first["0"] and first["1"]
    records = [e for e in read_events(run_dir) if e["phase"] == "data"]
    ended = next(k for k, e in enumerate(records) if e["epoch_ended"] is not None)
    assert records[ended]["epoch_ended"] == 0 and all(e["epoch"] == 0 for e in records[:ended])
    assert sum(e["published_samples"] for e in records[: ended + 1]) == 1797
    hosts = {h: json.loads((out / f"host{h}.json").read_text()) for h in "01"}
    assert hosts["0"]["model_hash"] == hosts["1"]["model_hash"]
