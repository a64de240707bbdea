"""Outer optimizers as registered kinds: a kind with a step but no state is stepped, a kind whose ``has_step``
disagrees with its methods is refused, and the outer settings are saved and read back whole."""

from __future__ import annotations

from dataclasses import fields

import pytest
import torch
from helpers import assert_on_the_run_model, deltas, exchange, hosts, train
from local_transport import LocalCoordinator

from lightning_nodeox.coordinator.config import CoordinatorConfig, OuterSettings
from lightning_nodeox.coordinator.outer import OuterOptimizer, make_outer, outer_names, register
from lightning_nodeox.coordinator.state import RunStore, SavedRun, take_up
from lightning_nodeox.core.codecs.settings import (REGISTRY, FP8Settings, FP32Settings, Int8Settings, Q2Settings,
                                                    SparseSettings)


@register
class Scaled(OuterOptimizer):
    """sync = lr * mean: a step, and no state (so ``bool(state)`` would never step it)."""

    name = "scaled-for-tests"

    def step(self, i: int, mean: torch.Tensor, start: int, stop: int) -> None:
        mean.mul_(self.settings.lr)


def test_an_outer_optimizer_with_a_step_but_no_state_is_stepped(tmp_path) -> None:
    c = LocalCoordinator(tmp_path, 2, codec=FP32Settings(), outer=OuterSettings(Scaled.name, lr=0.25))
    try:
        a, b = hosts(c, "a", "b")
        assert isinstance(c.rounds.model.outer, Scaled) and not c.rounds.model.outer.has_state
        theta = [t.clone() for t in a.tensors.live]
        train(a, 0), train(b, 0)
        da, db = deltas(a), deltas(b)
        exchange((a, 8), (b, 24))
        for i, t in enumerate(theta):  # the coordinator's operations, in its order
            acc = torch.mul(da[i].reshape(-1), 8.0)
            acc.add_(db[i].reshape(-1), alpha=24.0)
            t.add_(torch.mul(acc, 1.0 / 32).mul_(0.25).view(t.shape))  # moved by lr * mean, not by the mean
        assert all(torch.equal(x, y) for x, y in zip(a.tensors.live, theta))
        assert_on_the_run_model(c, a, b)
    finally:
        c.close()


def test_a_kind_whose_has_step_disagrees_with_its_step_is_refused() -> None:
    class Silent(OuterOptimizer):
        name, has_step = "silent-for-tests", False

        def step(self, i: int, mean: torch.Tensor, start: int, stop: int) -> None:
            mean.mul_(2)

    class Stepless(OuterOptimizer):
        name = "stepless-for-tests"

    for kind in (Silent, Stepless):
        with pytest.raises(TypeError, match="make them agree"):
            register(kind)
        assert kind.name not in outer_names()


def test_the_package_kinds_say_what_they_do() -> None:
    specs = ()
    average, nesterov = make_outer(OuterSettings("average"), specs), make_outer(OuterSettings("nesterov"), specs)
    assert (average.name, average.has_step, nesterov.name, nesterov.has_step) == ("average", False, "nesterov", True)
    with pytest.raises(ValueError, match="--outer-optimizer 'adam' is not known; use one of"):
        OuterSettings("adam")


def test_every_outer_and_codec_setting_survives_a_restart(tmp_path) -> None:
    """The settings saved with a run come back whole, over the restarted command line's (tests/test_restart.py
    runs the same with real processes, tuned settings included)."""
    tuned = OuterSettings("nesterov", lr=0.5, momentum=0.8)
    codecs = (Q2Settings(block_size=128, scale_dtype="fp32"), Int8Settings(block_size=32, scale_dtype="fp32"),
              FP8Settings(block_size=256, scale_dtype="fp32"),
              SparseSettings(density=0.02, scale_dtype="fp32", chunking="tiles", levels="q2", error_decay=0.9,
                             mean="deltas"))
    for settings in (tuned, *codecs):
        untuned = [f.name for f in fields(settings) if getattr(settings, f.name) == f.default]
        assert not untuned, f"give {untuned} a value other than its default here"
    assert {s.name for s in codecs} | {"q4", "bf16", "fp32"} == set(REGISTRY)  # every codec with settings
    for codec in codecs:
        saved = SavedRun(round=3, model_hash="0" * 128, complete=False, hosts={}, codec=codec, outer=tuned)
        RunStore(tmp_path).save(saved, sync=None, outer={}, model_chunks=None)
        assert (RunStore(tmp_path).load().outer, RunStore(tmp_path).load().codec) == (tuned, codec)
        config, resumed = take_up(CoordinatorConfig(hosts=2, run_dir=tmp_path))  # the defaults: average, q4
        assert config.outer == resumed.outer == tuned and config.codec == resumed.codec == codec
