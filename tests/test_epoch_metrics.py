"""Epoch values across hosts, as under DDP, under `nodeox launch --hosts 2` (tests/hosts/metrics_host.py: each
host its own data and batch size; `loss` on_step and on_epoch, `val_loss`, a torchmetrics Accuracy, all with
sync_dist=True; ReduceLROnPlateau on `val_loss`). The test computes every cross-host value itself from what each
host saw of its own batches."""

from __future__ import annotations

import json
import sys
import time

import pytest
import torch
from helpers import HOSTS, launch

pytestmark = pytest.mark.slow  # every test here starts processes

EPOCHS = 4


def _run(tmp_path, *args: str) -> dict[int, dict]:
    out = tmp_path / "out"
    result = launch(tmp_path / "run", 2, [sys.executable, str(HOSTS / "metrics_host.py"), "--out", str(out), *args],
                    timeout=120)
    assert result.returncode == 0, result.stdout[-5000:]
    return {h: json.loads((out / f"host{h}.json").read_text()) for h in (0, 1)}


def _mean(pairs: list[tuple[float, int]]) -> float:
    return sum(v * n for v, n in pairs) / sum(n for _, n in pairs)


def _plateau(values: list[float]) -> list[float]:
    """The learning rates ReduceLROnPlateau (as metrics_host.py sets it) gives for these epoch values."""
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.5)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="min", factor=0.5, patience=0, threshold=0.1)
    rates = [0.5]
    for v in values:
        plateau.step(v)
        rates.append(opt.param_groups[0]["lr"])
    return rates


@pytest.mark.parametrize("overlap", [(), ("--overlap", "--lag", "0.2")], ids=["blocking", "overlapped"])
def test_epoch_values_are_the_epoch_just_ended_across_hosts_and_callbacks_decide_on_them(tmp_path, overlap) -> None:
    """Overlapped: host 1 reaches each epoch's end while host 0's delta is in, its own not yet, and host 0 still
    trains: the epoch's values wait for host 0's (metrics_host.py --lag)."""
    hosts = _run(tmp_path, "--epochs", str(EPOCHS), *overlap)
    train = {h: hosts[h]["seen"]["train"] for h in (0, 1)}  # [epoch, loss, batch size, correct]
    val = {h: hosts[h]["seen"]["val"] for h in (0, 1)}  # [epoch, loss, batch size]
    loss, acc, val_loss = [], [], []
    for e in range(EPOCHS):
        batches = [b for h in (0, 1) for b in train[h] if b[0] == e]
        loss.append(_mean([(b[1], b[2]) for b in batches]))  # over both hosts' samples, weighted by batch size
        acc.append(sum(b[3] for b in batches) / sum(b[2] for b in batches))
        val_loss.append(_mean([(b[1], b[2]) for h in (0, 1) for b in val[h] if b[0] == e]))
        own = [_mean([(b[1], b[2]) for b in train[h] if b[0] == e]) for h in (0, 1)]
        assert abs(own[0] - own[1]) > 1e-3  # the hosts' own means differ: the cross-host one is not either's
        for h in (0, 1):
            seen = hosts[h]["epochs"][e]  # callback_metrics at the end of epoch e
            assert seen["loss_epoch"] == pytest.approx(loss[e], rel=1e-6)
            assert seen["loss_step"] != seen["loss_epoch"]  # the two forms are shared apart
            assert seen["acc"] == pytest.approx(acc[e], rel=1e-6)
            assert seen["val_loss"] == pytest.approx(val_loss[e], rel=1e-6)
        for name in ("loss_epoch", "acc", "val_loss"):  # the same bits on every host
            assert hosts[0]["epochs"][e][name] == hosts[1]["epochs"][e][name]
    for h in (0, 1):  # after fit: the last epoch, not the one before it
        after = hosts[h]["after_fit"]
        assert after["loss_epoch"] == hosts[h]["epochs"][-1]["loss_epoch"] == pytest.approx(loss[-1], rel=1e-6)
        assert after["acc"] == pytest.approx(acc[-1], rel=1e-6) and after["val_loss"] == pytest.approx(val_loss[-1])
    # ReduceLROnPlateau stepped on the cross-host val_loss, as under DDP, on both hosts ...
    expected = _plateau(val_loss)
    assert hosts[0]["seen"]["lr"] == hosts[1]["seen"]["lr"] == expected and expected[-1] < expected[0]
    # ... which is not what each host's own val_loss would have decided
    own = {h: [_mean([(b[1], b[2]) for b in val[h] if b[0] == e]) for e in range(EPOCHS)] for h in (0, 1)}
    assert any(_plateau(own[h]) != expected for h in (0, 1))
    assert hosts[0]["model_hash"] == hosts[1]["model_hash"]


def test_hosts_with_uneven_batches_per_epoch_do_not_wait_for_each_other_and_agree(tmp_path) -> None:
    """Host 1 has 11 batches an epoch, host 0 8 (rounds of 3 steps): host 0's epoch ends while host 1 waits in a
    round for it. The exchange does not hold either: host 0's epoch values are its own, and host 1, reaching its
    epoch's end later, takes them (one value on every host)."""
    start = time.monotonic()
    hosts = _run(tmp_path, "--epochs", "2", "--extra-batches", "3")
    assert time.monotonic() - start < 90
    train0 = hosts[0]["seen"]["train"]
    for e in range(2):
        for name in ("loss_epoch", "acc", "val_loss"):
            assert hosts[0]["epochs"][e][name] == hosts[1]["epochs"][e][name]
        assert hosts[0]["epochs"][e]["loss_epoch"] == pytest.approx(
            _mean([(b[1], b[2]) for b in train0 if b[0] == e]), rel=1e-6)
    assert hosts[0]["model_hash"] == hosts[1]["model_hash"]
