"""The coordinator publishes only finite models, and its model and hash agree whatever happens in a round's close."""

from __future__ import annotations

import pytest
import torch
from helpers import delta_message
from reference_q4 import kernels

from lightning_nodeox.coordinator import model as model_module
from lightning_nodeox.coordinator.model import CoordinatorModel
from lightning_nodeox.coordinator.outer import OuterSettings
from lightning_nodeox.core.codec import apply_sync, encode_sync_and_apply
from lightning_nodeox.core.hashing import model_hash
from lightning_nodeox.core.pool import WorkerPool
from lightning_nodeox.core.codecs.settings import Q4Settings
from lightning_nodeox.core.specs import spec_of
from lightning_nodeox.core.wire import Message

SETTINGS = Q4Settings()


def fp16_model() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(300, 70, generator=g) * 1000).to(torch.float16)
    w[0, :5] = -0.0  # signed zeros must survive a refused round bit for bit
    return [("w", w), ("b", torch.full((70,), 30000.0, dtype=torch.float16)), ("s", torch.randn(9, generator=g))]


def make(named, pool, outer=OuterSettings()) -> CoordinatorModel:
    return CoordinatorModel(spec_of(named), [t.clone() for _, t in named], SETTINGS, pool, outer)


def delta(specs, values: list[torch.Tensor]) -> Message:
    return delta_message(values, specs=specs)


def bits(tensors) -> list[torch.Tensor]:
    return [t.detach().clone().view(-1).view(torch.uint8) for t in tensors]


@pytest.fixture
def pool():
    p = WorkerPool(SETTINGS, "cpu", 2)
    yield p
    p.close()


@pytest.mark.parametrize("outer", [OuterSettings(), OuterSettings("nesterov", 0.7, 0.9)], ids=["average", "nesterov"])
def test_a_round_that_would_overflow_fp16_is_refused_and_changes_nothing(pool, outer) -> None:
    named = fp16_model()
    model = make(named, pool, outer)
    before, before_hash = bits(model.tensors), model.hash
    momentum = [t.clone() for t in model.outer.state.values()]
    model.accumulate(delta(model.specs, [torch.full(t.shape, 50000.0) for _, t in named]), 4)  # finite, yet 30000 +
    closed = model.close_round(0)                                                               # 50000 > fp16's max
    assert "b" in closed.not_finite  # w stays below 65504 under plain averaging
    assert model.hash == before_hash == closed.sync.meta.model_hash == closed.sync.meta.base_hash
    assert all(torch.equal(x, y) for x, y in zip(bits(model.tensors), before))
    assert all(torch.equal(x, y) for x, y in zip(model.outer.state.values(), momentum))
    # a host applying the refused round's sync keeps its model bit for bit (-0.0 included) and its hash
    host = [t.clone() for _, t in named]
    sync = Message.parse(closed.sync.buffer.clone())
    for i, t in enumerate(host):
        apply_sync(kernels(SETTINGS), sync.codes(i), sync.scales(i), t.view(-1), t.view(-1))
    assert all(torch.equal(x, y) for x, y in zip(bits(host), before))
    assert model_hash(list(zip([n for n, _ in named], host))) == before_hash


def test_the_round_after_a_refused_one_applies_normally(pool) -> None:
    named = fp16_model()
    model = make(named, pool)
    model.accumulate(delta(model.specs, [torch.full(t.shape, 50000.0) for _, t in named]), 4)
    model.close_round(0)
    small = [torch.full(t.shape, 0.5) for _, t in named]
    model.accumulate(delta(model.specs, small), 4)
    closed = model.close_round(1)
    assert not closed.not_finite and closed.sync.meta.samples == 4
    model.publish(closed.sync)
    assert model.hash == model_hash(model.named()) != model_hash(named)
    assert all(torch.isfinite(t).all() for t in model.tensors)


def test_two_passes_give_the_bytes_of_the_fused_pass(pool) -> None:
    """Checking before applying changes no bit of the result (plain averaging and Nesterov alike)."""
    g = torch.Generator().manual_seed(3)
    named = [("w", torch.randn(300, 200, generator=g)), ("b", torch.randn(77, generator=g))]
    deltas = [[torch.randn(t.shape, generator=g) * 0.01 for _, t in named] for _ in range(2)]
    for outer in (OuterSettings(), OuterSettings("nesterov", 0.7, 0.9)):
        model = make(named, pool, outer)
        reference = [t.clone().view(-1) for _, t in named]
        momentum = [torch.zeros(t.numel()) for _, t in named]
        for round_, values in enumerate(deltas):
            message = delta(model.specs, values)
            model.accumulate(message, 3)
            model.publish(model.close_round(round_).sync)
            for i, theta in enumerate(reference):
                acc = torch.zeros(theta.numel())
                accumulate = model_module.accumulate_tensor
                accumulate(kernels(SETTINGS), message.codes(i), message.scales(i), acc, 3.0, assign=True)

                def nesterov(x, a, b, m=momentum[i]):
                    m[a:b].mul_(0.9).add_(x)
                    x.add_(m[a:b], alpha=0.9).mul_(0.7)

                codes, scales = torch.empty_like(message.codes(i)), torch.empty_like(message.scales(i))
                encode_sync_and_apply(kernels(SETTINGS), acc, 1 / 3, theta, codes, scales,
                                      outer_step=nesterov if outer.name == "nesterov" else None)
            assert all(torch.equal(t.view(-1), r) for t, r in zip(model.tensors, reference)), outer.name


def test_a_failure_half_way_through_applying_leaves_model_and_hash_agreeing(pool, monkeypatch) -> None:
    g = torch.Generator().manual_seed(4)
    named = [(f"t{i}", torch.randn(200_000, generator=g)) for i in range(4)]
    model = make(named, pool)
    calls = []

    def failing_apply(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("disk on fire")
        return apply_sync(*args, **kwargs)

    monkeypatch.setattr(model_module, "apply_sync", failing_apply)
    model.accumulate(delta(model.specs, [torch.full(t.shape, 0.25) for _, t in named]), 1)
    with pytest.raises(RuntimeError, match="disk on fire"):
        model.close_round(0)
    assert model.hash == model_hash(model.named())
    assert model.hash != model_hash(named)  # part of the round was applied, and the hash says so


def test_a_failure_before_applying_leaves_the_model_untouched_and_the_round_retryable(pool, monkeypatch) -> None:
    g = torch.Generator().manual_seed(5)
    named = [("w", torch.randn(300_000, generator=g)), ("b", torch.randn(10, generator=g))]
    model = make(named, pool)
    before, before_hash = bits(model.tensors), model.hash
    model.accumulate(delta(model.specs, [torch.full(t.shape, 0.25) for _, t in named]), 2)
    real = model_module.encode_sync
    monkeypatch.setattr(model_module, "encode_sync", lambda *a, **k: (_ for _ in ()).throw(MemoryError("no room")))
    with pytest.raises(MemoryError):
        model.close_round(0)
    assert model.hash == before_hash and all(torch.equal(x, y) for x, y in zip(bits(model.tensors), before))
    monkeypatch.setattr(model_module, "encode_sync", real)
    closed = model.close_round(0)  # the round's deltas are still there
    clean = make(named, pool)
    clean.accumulate(delta(clean.specs, [torch.full(t.shape, 0.25) for _, t in named]), 2)
    assert closed.sync.meta.model_hash == clean.close_round(0).sync.meta.model_hash != before_hash


def test_a_result_close_to_the_dtype_limit_but_finite_is_taken(pool) -> None:
    """Where the quick bound cannot tell (max|θ| + 7·scale near 65504), the sum itself decides."""
    named = [("w", torch.full((1000,), 65400.0, dtype=torch.float16))]
    model = make(named, pool)
    model.accumulate(delta(model.specs, [torch.full((1000,), 50.0)]), 1)
    closed = model.close_round(0)
    assert not closed.not_finite
    model.publish(closed.sync)
    reference = named[0][1].clone()
    message = delta(model.specs, [torch.full((1000,), 50.0)])
    acc = torch.zeros(1000)
    model_module.accumulate_tensor(kernels(SETTINGS), message.codes(0), message.scales(0), acc, 1.0, assign=True)
    codes, scales = torch.empty_like(message.codes(0)), torch.empty_like(message.scales(0))
    encode_sync_and_apply(kernels(SETTINGS), acc, 1.0, reference, codes, scales)
    assert torch.isfinite(model.tensors[0]).all() and torch.equal(model.tensors[0], reference)
    assert float(model.tensors[0][0]) > 65400
