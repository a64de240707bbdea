"""A host's delta encode (host/encoding.py): the codes carry live - base and the residual keeps what they could
not; raw tensors carry their values; NaN is refused naming the parameter; the q4 error of a sample."""

from __future__ import annotations

import pytest
import torch
from reference_q4 import kernels

from lightning_nodeox.core.codec import NonFiniteDeltaError, decode_tensor
from lightning_nodeox.core.pool import WorkerPool
from lightning_nodeox.core.codecs.settings import Q4Settings
from lightning_nodeox.core.specs import spec_of
from lightning_nodeox.core.wire import MessageLayout, MessageMeta
from lightning_nodeox.host.encoding import DeltaEncoder
from lightning_nodeox.host.parts import Parts
from lightning_nodeox.host.staging import Staging

SETTINGS = Q4Settings()


def setup(feedback: bool = True):
    gen = torch.Generator().manual_seed(0)
    named = [("w", torch.randn(700, generator=gen)), ("n", torch.tensor([4, 5]))]
    specs = spec_of(named)
    base = [t.clone() for _, t in named]
    live = [t.clone() for _, t in named]
    residual = [torch.zeros(s.coded, dtype=torch.bfloat16) for s in specs] if feedback else None
    layout = MessageLayout.of(specs, SETTINGS)
    pool = WorkerPool(SETTINGS, "cpu", 1)
    encoder = DeltaEncoder(["w", "n"], specs, base, residual, pool, Staging(torch.device("cpu"), layout, 64),
                           layout.codec)
    parts = Parts(["w", "n"], specs, [None, None], 1)
    parts.allocate(SETTINGS, pin_memory=False)
    return encoder, parts.boundary(None), live, base, pool


def test_the_codes_carry_the_change_and_the_residual_what_they_could_not() -> None:
    encoder, part, live, base, pool = setup()
    live[0].add_(torch.linspace(-0.1, 0.1, 700))
    live[1].copy_(torch.tensor([6, 7]))
    message = encoder.encode(part, live, MessageMeta("delta", 3, "h", "", samples=8), None).join()
    assert message.meta.round == 3 and message.meta.samples == 8
    sent = torch.empty(700)
    decode_tensor(kernels(SETTINGS), message.codes(0), message.scales(0), sent)
    assert torch.equal(encoder.residual[0], (live[0] - base[0] - sent).to(torch.bfloat16))
    assert torch.equal(message.raw(1).clone().view(torch.int64), torch.tensor([6, 7]))
    error = encoder.estimate_error(part, live)
    assert 0 < error < 0.2
    pool.close()


def test_a_nan_in_the_delta_is_refused_naming_the_parameter_and_the_fix() -> None:
    encoder, part, live, _, pool = setup(feedback=False)
    live[0][5] = float("nan")
    with pytest.raises(NonFiniteDeltaError, match=r"parameter 'w' in round 2 holds NaN or Inf.*gradient_clip_val"):
        encoder.encode(part, live, MessageMeta("delta", 2, "h", "", samples=8), None).join()
    pool.close()
