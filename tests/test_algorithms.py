"""The algorithms against references computed by hand: the Nesterov outer step, the overlap fold, and the
sample-weighted mean of hosts that took different numbers of steps. In-process, with the real round object.

With the unquantized fp32 codec every value is exact, so the references can be matched bit for bit; with q4
the hosts and the coordinator must still agree bit for bit."""

from __future__ import annotations

import torch
from helpers import assert_on_the_run_model, both, deltas, exchange, hosts, train
from local_transport import LocalCoordinator

from lightning_nodeox.coordinator.config import OuterSettings
from lightning_nodeox.core.codecs.settings import FP32Settings

FP32 = FP32Settings()


def test_nesterov_outer_step_matches_the_reference_for_two_rounds(tmp_path) -> None:
    c = LocalCoordinator(tmp_path, 2, codec=FP32, outer=OuterSettings("nesterov", lr=0.7, momentum=0.9))
    try:
        a, b = hosts(c, "a", "b")
        theta = [t.clone() for t in a.tensors.live]
        momentum = [torch.zeros(t.numel()) for t in theta]
        for r in range(2):
            train(a, r), train(b, r)
            da, db = deltas(a), deltas(b)
            exchange((a, 8), (b, 24))
            for i, t in enumerate(theta):  # the coordinator's operations, in its order
                acc = torch.mul(da[i].reshape(-1), 8.0)
                acc.add_(db[i].reshape(-1), alpha=24.0)
                mean = torch.mul(acc, 1.0 / 32)
                momentum[i].mul_(0.9).add_(mean)
                mean.add_(momentum[i], alpha=0.9).mul_(0.7)
                t.add_(mean.view(t.shape))
            assert all(torch.equal(x, y) for x, y in zip(a.tensors.live, theta)), f"round {r}"
            assert_on_the_run_model(c, a, b)
        state = c.rounds.model.outer.state
        assert all(torch.equal(state[f"momentum/{n}"], m) for n, m in zip(a.tensors.names, momentum))
    finally:
        c.close()


def test_nesterov_with_q4_keeps_hosts_and_coordinator_bit_identical(tmp_path) -> None:
    c = LocalCoordinator(tmp_path, 2, outer=OuterSettings("nesterov"))
    try:
        a, b = hosts(c, "a", "b")
        for r in range(3):
            train(a, r), train(b, r)
            exchange((a, 8), (b, 8))
            assert_on_the_run_model(c, a, b)
    finally:
        c.close()


def test_hosts_with_different_step_counts_give_the_sample_weighted_mean(tmp_path) -> None:
    c = LocalCoordinator(tmp_path, 2, codec=FP32)
    try:
        a, b = hosts(c, "a", "b")
        theta = [t.clone() for t in a.tensors.live]
        train(a, 0)  # a takes one step of 8 samples ...
        for step in range(3):  # ... b three, 48 samples in all
            train(b, step)
        da, db = deltas(a), deltas(b)
        exchange((a, 8), (b, 48))
        for i, t in enumerate(theta):
            acc = torch.mul(da[i].reshape(-1), 8.0)
            acc.add_(db[i].reshape(-1), alpha=48.0)
            t.add_(torch.mul(acc, 1.0 / 56).view(t.shape))
        assert all(torch.equal(x, y) for x, y in zip(a.tensors.live, theta))
        assert_on_the_run_model(c, a, b)
    finally:
        c.close()


def test_overlap_folds_the_sync_into_live_progress_and_hosts_end_bit_identical(tmp_path) -> None:
    for delayed in (False, True):
        c = LocalCoordinator(tmp_path / f"delayed{delayed}", 2)
        try:
            a, b = hosts(c, "a", "b")
            for r in range(2):
                train(a, r), train(b, r)
                theta_r = [t.clone() for t in a.tensors.base]
                for h in (a, b):
                    h.tensors.take_snapshot(restart_from_base=delayed)
                if delayed:
                    assert all(torch.equal(t, x) for t, x in zip(a.tensors.live, theta_r))
                reference = [s.clone() for s in (theta_r if delayed else a.tensors.snapshot)]
                both(lambda: a.run_overlapped(8, delayed), lambda: b.run_overlapped(8, delayed))
                assert a.tensors.base[0].data_ptr() != a.tensors.live[0].data_ptr()
                assert a.model_hash == b.model_hash == c.rounds.model.hash  # θ_{r+1} in base, verified
                train(a, 10 + r)  # progress made while the exchange was in flight
                live = [t.clone() for t in a.tensors.live]
                a.tensors.fold(), b.tensors.fold()
                for t, x, base, ref in zip(a.tensors.live, live, a.tensors.base, reference):
                    assert torch.equal(t, x + (base - ref)), "fold = live + (θ_{r+1} - snapshot)"
            both(lambda: a.run_round(8, True), lambda: b.run_round(8, True))  # the last round: not overlapped
            assert_on_the_run_model(c, a, b)
        finally:
            c.close()
