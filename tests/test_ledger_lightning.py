"""The data ledger under Lightning, end to end: digits hosts of one device whose loaders get the ledger's sampler
(``Trainer(use_distributed_sampler=True)``), under a real coordinator."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from helpers import Coordinator, run_hosts
from lightning.pytorch import LightningModule, Trainer
from local_transport import LocalClient
from torch import nn
from torch.utils.data import DataLoader, Dataset, RandomSampler

from lightning_nodeox import NodeoxStrategy
from lightning_nodeox.core.phases import TRAIN
from lightning_nodeox.host.ledger_sampler import LedgerSampler

SAMPLES = 1797  # scikit-learn's digits


def _trained(out: Path, host: str) -> list[list[int]]:
    """[epoch, index] of each sample host ``host`` trained (``host`` may name a rank: ``0.rank1``)."""
    return json.loads((out / f"host{host}_indices.json").read_text())


def _first_epoch_committed(coord: Coordinator) -> int:
    """The samples the coordinator's ``data`` records committed up to the first epoch's end (all of epoch 0)."""
    records = [e for e in coord.events() if e["phase"] == "data"]
    ended = next(k for k, e in enumerate(records) if e["epoch_ended"] is not None)
    assert records[ended]["epoch_ended"] == 0 and records[ended]["epoch"] == 1
    assert all(e["epoch"] == 0 for e in records[:ended])
    return sum(e["published_samples"] for e in records[: ended + 1])


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("overlap", ["off", "eager"])
def test_two_hosts_train_every_sample_of_the_first_epoch_once_and_the_coordinator_commits_exactly_those(
        tmp_path: Path, overlap: str) -> None:
    """Each host's loader reads the spans the coordinator leases it; a pass ends where the ledger has nothing more
    for the host, and the round closing there reports what it trained. After the run the hosts' first epochs,
    joined, are every index once, and the coordinator committed the epoch's samples exactly once."""
    coord = Coordinator(tmp_path / "run", 2, "--data-unit", "128")
    out = tmp_path / "out"
    run_hosts(coord, out, "01", "--ledger", "--log-indices", "--max-epochs", "2", "--max-steps", "100000",
              "--local-steps", "6", "--batch-size", "32", "--overlap", overlap,
              timeout=90)
    first = [i for h in "01" for epoch, i in _trained(out, h) if epoch == 0]
    assert sorted(first) == list(range(SAMPLES))  # none lost, none twice
    assert all(_trained(out, h) for h in "01")  # both hosts trained
    assert _first_epoch_committed(coord) == SAMPLES == len(first)  # each committed once: those trained


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("overlap", ["off", "eager"])
def test_a_host_of_two_ranks_and_a_host_of_one_device_share_the_epoch(tmp_path: Path, overlap: str) -> None:
    """Host 0 is DDP over 2 CPU ranks (gloo): its rank 0 leases, rank 1 takes the answer, each reads its place in
    rows of 2; host 1 is one device. The first epoch's indices trained across the three ranks are every index
    once (but the pad of a short last row: an odd last unit read in rows of 2 repeats one sample on rank 1, as a
    DistributedSampler pads), and the coordinator committed exactly the epoch before it ended."""
    coord = Coordinator(tmp_path / "run", 2, "--data-unit", "128")
    out = tmp_path / "out"
    run_hosts(coord, out, "01", "--ledger", "--log-indices", "--max-epochs", "2", "--max-steps", "100000",
              "--local-steps", "6", "--batch-size", "32", "--devices", "2,1", "--overlap", overlap,
              timeout=150)
    ranks = ["0", "0.rank1", "1"]
    first = {r: [i for epoch, i in _trained(out, r) if epoch == 0] for r in ranks}
    times = Counter(i for r in ranks for i in first[r])
    assert sorted(times) == list(range(SAMPLES))  # none lost
    padded = [i for i, n in times.items() if n > 1]
    assert len(padded) <= 1 and all(times[i] == 2 and i in first["0"] and i in first["0.rank1"] for i in padded)
    assert sum(times.values()) == SAMPLES + len(padded)
    assert all(first.values())  # every rank trained
    assert len(first["0"]) == len(first["0.rank1"])  # one sample of each row per rank
    assert _first_epoch_committed(coord) == SAMPLES


class Indices(Dataset):
    """Sample i is (i as a feature, 0.0): the batch says which samples it trained."""

    def __len__(self) -> int:
        return 100

    def __getitem__(self, i: int):
        return torch.tensor([float(i)]), torch.tensor([0.0])


class Recording(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(1, 1)
        self.seen: list[tuple[int, int]] = []  # (epoch, index)

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.seen += [(self.current_epoch, int(i)) for i in x[:, 0]]
        return nn.functional.mse_loss(self.net(x * 0.0), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-2)


def _fit(local_coordinator, tmp_path, **trainer_args):
    c = local_coordinator(1, data_unit=30)
    strategy = NodeoxStrategy(coordinator_url="http://unused.invalid", host_id="solo", local_steps=100,
                              client=lambda conn: LocalClient(c, conn.host_id))
    module = Recording()
    trainer = Trainer(strategy=strategy, default_root_dir=tmp_path, logger=False, enable_progress_bar=False,
                      enable_checkpointing=False, enable_model_summary=False, max_epochs=2, **trainer_args)
    trainer.fit(module, DataLoader(Indices(), batch_size=10, shuffle=True))
    trained = [(r.extra["steps"], r.extra["samples"]) for r in strategy.phase_records if r.phase == TRAIN]
    return c, trainer, module, trained


def test_a_map_style_loader_gets_the_ledgers_sampler_and_each_pass_ends_its_round(local_coordinator,
                                                                                  tmp_path) -> None:
    c, trainer, module, trained = _fit(local_coordinator, tmp_path)
    assert isinstance(trainer.train_dataloader.sampler, LedgerSampler)
    assert trainer.train_dataloader.batch_size == 10
    for epoch in (0, 1):  # one host: each Lightning epoch is the ledger's whole epoch, each sample once
        assert sorted(i for e, i in module.seen if e == epoch) == list(range(100))
    assert [i for e, i in module.seen if e == 0] != list(range(100))  # shuffled
    assert trained == [(10, 100), (10, 100)]  # local_steps=100 never came: each pass's end closed its round
    assert c.state.data.ledger.epoch == 2  # both epochs committed


def test_use_distributed_sampler_false_leaves_the_loader_alone(local_coordinator, tmp_path) -> None:
    c, trainer, module, trained = _fit(local_coordinator, tmp_path, use_distributed_sampler=False)
    assert isinstance(trainer.train_dataloader.sampler, RandomSampler)
    assert c.state.data.ledger is None
    assert trained == [(20, 200)]  # one round, at fit's end


def test_a_pass_end_under_gradient_accumulation_still_ends_its_round(local_coordinator, tmp_path) -> None:
    """10 batches a pass, accumulated by 3: Lightning steps on a pass's last batch whatever the count (it knows
    the batch is the last: the loop fetches one ahead), so that batch closes the pass's round."""
    c, trainer, module, trained = _fit(local_coordinator, tmp_path, accumulate_grad_batches=3)
    for epoch in (0, 1):
        assert sorted(i for e, i in module.seen if e == epoch) == list(range(100))
    assert trained == [(4, 100), (4, 100)]  # steps after batches 3, 6, 9 and the last, 10
    assert c.state.data.ledger.epoch == 2


def test_limit_train_batches_ends_each_pass_and_its_round_and_the_next_pass_reads_on(local_coordinator,
                                                                                     tmp_path) -> None:
    """limit_train_batches=4: each pass trains 4 batches, as under DDP, and its end closes a round that reports
    them, so the next pass reads on (fresh samples); what a pass read ahead but did not train is read again."""
    c, trainer, module, trained = _fit(local_coordinator, tmp_path, limit_train_batches=4)
    passes = [[i for e, i in module.seen if e == epoch] for epoch in (0, 1)]
    assert [len(p) for p in passes] == [40, 40] and len(set(passes[0] + passes[1])) == 80  # none twice
    assert trained == [(4, 40), (4, 40)]
    assert c.state.data.ledger.status()["epoch_committed_samples"] == 80
