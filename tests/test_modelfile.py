"""The full-model file streams from and into tensors without a full-size copy."""

from __future__ import annotations

import io

import pytest
import torch

from lightning_nodeox.core.modelfile import ModelFileReader, model_header, read_model, read_model_into
from lightning_nodeox.core.protocol import TransferBroken
from lightning_nodeox.core.specs import PayloadError, spec_of

NAMED = [("a", torch.randn(1000, 3)), ("b", torch.randn(7).to(torch.bfloat16)), ("c", torch.randn(5))]


def file_bytes(named=NAMED, round_=4, model_hash="ee" * 16) -> bytes:
    reader = ModelFileReader(model_header(spec_of(named), round_, model_hash), [t for _, t in named])
    out = bytearray()
    while chunk := reader.read(1000):
        out += chunk
    assert len(out) == len(reader)
    return bytes(out)


def test_reader_and_read_model_agree() -> None:
    data = file_bytes()
    round_, h, specs, tensors = read_model(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    assert (round_, h, specs) == (4, "ee" * 16, spec_of(NAMED))
    assert all(torch.equal(x, y) for x, (_, y) in zip(tensors, NAMED))


def test_read_into_tensors_in_place() -> None:
    targets = [torch.zeros_like(t) for _, t in NAMED]
    round_, h = read_model_into(io.BytesIO(file_bytes()), spec_of(NAMED), targets)
    assert (round_, h) == (4, "ee" * 16)
    assert all(torch.equal(x, y) for x, (_, y) in zip(targets, NAMED))


def test_read_into_refuses_another_model_and_truncation() -> None:
    other = [("a", torch.randn(1000, 4)), *NAMED[1:]]
    with pytest.raises(PayloadError, match="'a' float32 \\[1000, 4\\] does not match"):
        read_model_into(io.BytesIO(file_bytes(other)), spec_of(NAMED), [torch.zeros_like(t) for _, t in NAMED])
    with pytest.raises(TransferBroken, match="broke off"):
        read_model_into(io.BytesIO(file_bytes()[:-5]), spec_of(NAMED), [torch.zeros_like(t) for _, t in NAMED])
