"""HostExchange pieces that need no coordinator: refusing non-finite deltas before anything is sent."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lightning_nodeox.codec import NonFiniteDeltaError
from lightning_nodeox.exchange import HostExchange, shared_tensors
from lightning_nodeox.phases import PhaseLog
from lightning_nodeox.settings import Q4Settings


def exchange_for(model: torch.nn.Module, settings: Q4Settings = Q4Settings()) -> HostExchange:
    ex = HostExchange(shared_tensors(model), SimpleNamespace(host="h", url="http://unused"), PhaseLog("h"))
    ex._allocate(settings)
    return ex


def test_nan_delta_is_refused_naming_the_parameter() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    ex = exchange_for(model)
    with torch.no_grad():
        model[1].running_var[1] = float("nan")
    with pytest.raises(NonFiniteDeltaError, match=r"parameter '1.running_var' in round 0 holds NaN or Inf"):
        ex.encode(samples=8, final=False)
    ex.close()


def test_delta_beyond_fp16_scales_names_the_fix() -> None:
    model = torch.nn.Linear(4, 3)
    ex = exchange_for(model)
    with torch.no_grad():
        model.weight[0, 0] += 1e6
    with pytest.raises(NonFiniteDeltaError, match=r"'weight' .* too large for fp16 scales; .*--scale-dtype fp32"):
        ex.encode(samples=8, final=False)
    ex.close()
    fp32 = exchange_for(model := torch.nn.Linear(4, 3), Q4Settings(scale_dtype="fp32"))
    with torch.no_grad():
        model.weight[0, 0] += 1e6
    message = fp32.encode(samples=8, final=False)
    assert message.meta.samples == 8 and bool(torch.isfinite(message.scales(0)).all())
    fp32.close()


def test_shared_tensors_take_float_parameters_and_buffers_once() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 4))
    model[2].weight = model[0].weight  # tied
    names = [n for n, _ in shared_tensors(model)]
    assert names == ["0.weight", "0.bias", "1.weight", "1.bias", "1.running_mean", "1.running_var", "2.bias"]
