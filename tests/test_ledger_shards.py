"""Streaming data under the data ledger (host/ledger_shards.py): the ledger leases shards, a round reports only the
shards its training steps consumed completely."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import Coordinator, run_hosts
from local_transport import LocalClient
from torch.utils.data import DataLoader

from lightning_nodeox import LedgerShards, NodeoxStrategy
from lightning_nodeox.core.ledger_order import DataOrder
from lightning_nodeox.core.ledger_terms import EpochEnd, Lease, Span
from lightning_nodeox.core.phases import TRAIN
from lightning_nodeox.host.ledger_shards import ShardData
from test_ledger_lightning import SAMPLES, Recording, _first_epoch_committed, _trained
from lightning.pytorch import Trainer

SIZES = [7, 3, 5, 9, 4, 6]  # shard k holds SIZES[k] samples


def _shards() -> LedgerShards:
    """Shard ``"k"``'s samples are (1000 * k + j, 0.0) for j < SIZES[k]: each says its shard and place."""
    def read(name: str):
        k = int(name)
        for j in range(SIZES[k]):
            yield torch.tensor([float(1000 * k + j)]), torch.tensor([0.0])
    return LedgerShards([str(k) for k in range(len(SIZES))], read)


def _one_unit_each(shards: int):
    """A ledger source of one epoch of ``shards`` units of one shard, leased one at a time."""
    replies = [Lease(0, 0, (Span(u, u, u + 1),)) for u in range(shards)] + [EpochEnd(0, 1)]
    return lambda epoch: replies.pop(0) if replies else EpochEnd(0, 1)


def test_a_round_reports_only_the_shards_consumed_completely() -> None:
    dataset = _shards()
    data = ShardData(_spec(), _one_unit_each(len(SIZES)), lambda: True)
    data.loader(DataLoader(dataset, batch_size=None))
    order = DataOrder(len(SIZES), 0, True).epoch(0).indices(0, len(SIZES)).tolist()
    it = iter(dataset)
    read = [int(next(it)[0]) for _ in range(10)]  # shard order[0] whole, 10 - its size of order[1]
    assert read[0] // 1000 == order[0] and {x // 1000 for x in read} <= set(order[:3])
    data.consumed(0, 10)
    covered = data.covered(False)
    whole = 1 + (SIZES[order[0]] + SIZES[order[1]] <= 10)
    assert covered.samples == whole  # only whole shards
    rest = [int(x[0]) for x in it]
    data.consumed(0, len(rest))
    assert data.covered(True).samples == len(SIZES) - whole  # the rest, the partly read one included
    assert sorted(read + rest) == sorted(1000 * k + j for k, n in enumerate(SIZES) for j in range(n))


def _spec():
    from lightning_nodeox.core.protocol import DataSpec
    return DataSpec(samples=len(SIZES), seed=0, shuffle=True)


def test_a_void_lease_abandons_the_shard_being_read() -> None:
    dataset = _shards()
    data = ShardData(_spec(), _one_unit_each(len(SIZES)), lambda: True)
    data.loader(DataLoader(dataset, batch_size=None))
    it = iter(dataset)
    first = int(next(it)[0]) // 1000
    data.consumed(0, 1)
    data.void()  # the round's delta was not taken
    assert data.read_under_void(0) is True  # until the reader moves on, what it reads may be of the void shard
    after = [int(next(it)[0]) // 1000]
    assert data.read_under_void(0) is False  # the void shard ended at the one sample consumed: train on
    after += [int(x[0]) // 1000 for x in it]
    assert first not in after  # the rest of that shard is never read


def _fit(local_coordinator, tmp_path, **loader_args):
    c = local_coordinator(1, data_unit=1)
    strategy = NodeoxStrategy(coordinator_url="http://unused.invalid", host_id="solo", local_steps=4,
                              client=lambda conn: LocalClient(c, conn.host_id))
    module = Recording()
    trainer = Trainer(strategy=strategy, default_root_dir=tmp_path, logger=False, enable_progress_bar=False,
                      enable_checkpointing=False, enable_model_summary=False, max_epochs=2)
    trainer.fit(module, DataLoader(_shards(), batch_size=4, **loader_args))
    return c, module, strategy


def test_one_host_trains_every_shard_once_an_epoch_and_the_ledger_commits_them(local_coordinator, tmp_path) -> None:
    c, module, strategy = _fit(local_coordinator, tmp_path)
    everything = sorted(1000 * k + j for k, n in enumerate(SIZES) for j in range(n))
    for epoch in (0, 1):
        assert sorted(i for e, i in module.seen if e == epoch) == everything
    rounds = [r for r in strategy.phase_records if r.phase == TRAIN]
    assert len(rounds) > 2  # rounds closed mid-pass (local_steps=4), partly read shards carried on
    assert c.state.data.ledger.epoch == 2  # both epochs' shards committed


def test_workers_are_refused_naming_the_fix(local_coordinator, tmp_path) -> None:
    with pytest.raises(ValueError, match="num_workers=0"):
        _fit(local_coordinator, tmp_path, num_workers=1)


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize("overlap", ["off", "eager"])
def test_two_hosts_train_every_shard_of_the_first_epoch_once_and_the_coordinator_commits_the_shards(
        tmp_path: Path, overlap: str) -> None:
    """The digits as 20 shards of 90 samples (the last 87), ``--data-unit 1``: the hosts' first epochs, joined, are
    every sample once, each shard trained by one host only, and the coordinator committed exactly 20 positions
    (shards) before the epoch ended. Batches of 30: a pass (whole shards) never ends in a batch of one, which the
    model's BatchNorm refuses."""
    coord = Coordinator(tmp_path / "run", 2, "--data-unit", "1")
    out = tmp_path / "out"
    run_hosts(coord, out, "01", "--ledger", "--log-indices", "--shards", "20", "--max-epochs", "2",
              "--max-steps", "100000", "--local-steps", "4", "--batch-size", "30", "--overlap", overlap,
              timeout=120)
    first = {h: [i for epoch, i in _trained(out, h) if epoch == 0] for h in "01"}
    assert sorted(first["0"] + first["1"]) == list(range(SAMPLES))  # none lost, none twice
    shards = {h: {i // 90 for i in first[h]} for h in "01"}  # the shards each host consumed
    assert shards["0"] and shards["1"] and not shards["0"] & shards["1"]  # each shard read by one host
    assert shards["0"] | shards["1"] == set(range(20))
    assert _first_epoch_committed(coord) == 20  # positions are shards: each committed once
