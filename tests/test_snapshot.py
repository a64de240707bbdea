"""Overlap's snapshot and fold (host/snapshot.py): the live model becomes θ_{r+1} plus the progress since the
snapshot, for the tensors the round sent; a fetched model in base is folded in whole."""

from __future__ import annotations

import torch

from lightning_nodeox.host.snapshot import Snapshot


def tensors() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    live = [torch.full((4,), 1.0), torch.full((3,), 2.0), torch.tensor([5])]
    return live, [t.clone() for t in live]


def test_the_fold_adds_the_progress_since_the_snapshot_to_the_synced_base() -> None:
    live, base = tensors()
    snap = Snapshot(live, base, raw=[2])
    assert snap.tensors is None
    live[0].add_(0.5)
    snap.take((0, 2), restart_from_base=False)
    assert snap.tensors[1] is None and torch.equal(snap.tensors[0], torch.full((4,), 1.5))
    live[0].add_(0.25), live[1].add_(1.0), live[2].add_(1)  # training goes on
    base[0].add_(0.125)  # the sync, into base alone
    base[2].fill_(9)
    assert list(snap.folding()) == [0, 2]
    snap.fold()
    assert torch.equal(live[0], torch.full((4,), 1.0 + 0.125 + 0.25))  # θ_{r+1} + progress since the snapshot
    assert torch.equal(live[1], torch.full((3,), 3.0))  # not sent, not synced: as trained
    assert torch.equal(live[2], torch.tensor([9]))  # raw: θ_{r+1}'s values


def test_delayed_overlap_restarts_from_base_and_the_snapshot_becomes_base() -> None:
    live, base = tensors()
    snap = Snapshot(live, base, raw=[2])
    live[0].add_(0.5)
    snap.take((0,), restart_from_base=True)
    assert torch.equal(live[0], base[0]) and torch.equal(snap.tensors[0], torch.full((4,), 1.5))
    snap.to_base()
    assert torch.equal(snap.tensors[0], base[0])


def test_a_tensor_synced_but_not_sent_is_set_aside_and_a_fetched_model_is_folded_whole() -> None:
    live, base = tensors()
    snap = Snapshot(live, base, raw=[2])
    snap.set_aside((1,))
    assert snap.tensors is None  # no snapshot taken: nothing to set aside
    snap.take((0,), restart_from_base=False)
    snap.set_aside((0, 1))
    assert torch.equal(snap.tensors[1], base[1]) and list(snap.folding()) == [0, 1]
    snap.fetched(into_live=False)
    assert list(snap.folding()) == [0, 1, 2]
    base[1].fill_(7.0)
    snap.fold()
    assert torch.equal(live[1], torch.full((3,), 7.0)) and list(snap.folding()) == []
