"""Every codec behind the one interface: found by name, its byte counts and error text, and its no-op sync, which
leaves every host's bits (and so the model hash) as they were when the coordinator refuses a round."""

from __future__ import annotations

import pytest
import torch
from helpers import delta_message
from reference_q4 import kernels

from lightning_nodeox.coordinator.model import CoordinatorModel
from lightning_nodeox.core.codec import apply_sync
from lightning_nodeox.core.codecs import REGISTRY, Codec, codec_class, codec_for
from lightning_nodeox.core.hashing import model_hash
from lightning_nodeox.core.pool import WorkerPool
from lightning_nodeox.core.codecs.settings import (CODEC_NAMES, BF16Settings, CodecSettings, FP8Settings, FP32Settings,
                                                    Int8Settings, Q2Settings, Q4Settings, SparseSettings, setting_names,
                                                    settings_for)
from lightning_nodeox.core.specs import spec_of
from lightning_nodeox.core.wire import MessageLayout, Message
from lightning_nodeox.host.tensors import HostTensors

NOOP_BYTES = {"q4": (b"\x88", b"\x00\x80"), "q2": (b"\xaa", b"\x00\x80"), "int8": (b"\x00", b"\x00\x80"),
              "fp8": (b"\x00", b"\x00\x80"), "bf16": (b"\x00\x80", b""), "fp32": (b"\x00\x00\x00\x80", b"")}
INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
FIXED = tuple(name for name in REGISTRY if codec_class(name).fixed_size)  # sparse: tests/test_codec_sparse.py


def as_ints(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().view(-1).view(INTS[t.element_size()])


def awkward(dtype: torch.dtype, n: int = 300) -> torch.Tensor:
    """Values whose bits a careless no-op changes: signed zeros, the smallest subnormals, the dtype's extremes."""
    info = torch.finfo(dtype)
    special = torch.tensor([0.0, -0.0, info.smallest_normal, -info.smallest_normal, info.max, -info.max, 1.0])
    t = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(dtype)
    t[: len(special)] = special.to(dtype)
    ints = INTS[t.element_size()]
    sign = torch.iinfo(ints).min
    subnormals = torch.tensor([1, 2, sign + 1, sign + 3], dtype=ints).view(dtype)  # the smallest, both signs
    t[len(special) : len(special) + 4] = subnormals
    t[-20:] = 0.0
    return t


def model() -> list[tuple[str, torch.Tensor]]:
    """fp32, bf16 and fp16 tensors full of awkward values, and one tensor a round of +50000 overflows in fp16."""
    return [("f32", awkward(torch.float32)), ("b16", awkward(torch.bfloat16).view(15, 20)),
            ("f16", awkward(torch.float16)), ("big", torch.full((70,), 30000.0, dtype=torch.float16))]


def delta(specs, settings: CodecSettings, values: list[torch.Tensor]) -> Message:
    return delta_message(values, specs=specs, settings=settings)


def test_every_codec_is_found_by_its_name() -> None:
    assert tuple(REGISTRY) == ("q4", "q2", "int8", "fp8", "bf16", "fp32", "sparse")
    assert CODEC_NAMES == (*REGISTRY, "sparse3") and FIXED == ("q4", "q2", "int8", "fp8", "bf16", "fp32")
    for name in REGISTRY:
        knobs = {"block_size": 32} if "block_size" in setting_names(name) else {}
        codec = codec_for(settings_for(name, **knobs))
        assert codec.name == name and codec.settings == settings_for(name, **knobs)
    assert codec_for(Q2Settings(block_size=32)).settings.block_size == 32
    assert settings_for("sparse3") == SparseSettings(density=0.03) and codec_for(settings_for("sparse3")).k == 123
    with pytest.raises(ValueError, match=r"codec='int2' is not supported; use one of \('q4', 'q2', 'int8', 'fp8', "):
        settings_for("int2")


@pytest.mark.parametrize(("name", "scale_dtype", "scales", "codes", "alignment"), [
    ("q4", "fp16", 2, 64, 64), ("q4", "fp32", 2, 64, 64), ("q2", "fp16", 2, 32, 64), ("q2", "fp32", 2, 32, 64),
    ("int8", "fp16", 2, 128, 64), ("int8", "fp32", 2, 128, 64), ("fp8", "fp16", 2, 128, 64), ("fp8", "fp32", 2, 128, 64),
    ("bf16", "fp16", 0, 200, 1), ("fp32", "fp16", 0, 400, 1),
])
def test_each_codec_owns_its_byte_counts(name, scale_dtype, scales, codes, alignment) -> None:
    settings = settings_for(name, **({"scale_dtype": scale_dtype} if scales else {}))  # the raw codecs have no scales
    codec = codec_for(settings)
    assert (codec.scale_count(100), codec.code_bytes(100), codec.alignment) == (scales, codes, alignment)
    assert codec.scale_dtype == {"fp16": torch.float16, "fp32": torch.float32}[scale_dtype]
    layout = MessageLayout.of(spec_of([("t", torch.zeros(100))]), settings)
    region = layout.regions[0]
    assert region.scales[1] - region.scales[0] == scales * codec.scale_dtype.itemsize
    assert region.codes[1] - region.codes[0] == codes
    assert layout.codec.name == name


def test_only_the_blockwise_codecs_with_fp16_scales_have_a_finite_delta_they_cannot_hold() -> None:
    text = codec_for(Q4Settings()).too_large("fc.weight", 3)
    assert codec_for(Q2Settings()).too_large("fc.weight", 3) == text
    assert codec_for(Int8Settings()).too_large("fc.weight", 3) == codec_for(FP8Settings()).too_large("fc.weight", 3) == text
    assert text == ("the delta of parameter 'fc.weight' in round 3 is too large for fp16 scales; "
                    "start the coordinator with --scale-dtype fp32, or lower the learning rate")
    for settings in (Q4Settings(scale_dtype="fp32"), Q2Settings(scale_dtype="fp32"), Int8Settings(scale_dtype="fp32"),
                     FP8Settings(scale_dtype="fp32"), BF16Settings(),
                     FP32Settings()):
        assert codec_for(settings).too_large("fc.weight", 3) is None


@pytest.mark.parametrize("name", FIXED)
def test_a_codec_of_fixed_size_takes_no_capacity(name: str) -> None:
    specs = spec_of([("t", torch.zeros(10))])
    with pytest.raises(ValueError, match=f"codec '{name}' has messages of one size; its messages carry no capacity"):
        MessageLayout.of(specs, settings_for(name), capacity=8)
    layout = MessageLayout.of(specs, settings_for(name))
    assert layout.capacity is None and "capacity" not in Message.allocate(layout).meta.metadata("0")


@pytest.mark.parametrize("name", FIXED)
def test_the_noop_sync_is_minus_zero_in_every_value(name: str) -> None:
    settings = settings_for(name)
    message = Message.allocate(MessageLayout.of(spec_of([("t", torch.zeros(100))]), settings))
    message.data.fill_(0x11)
    codec: Codec = message.layout.codec
    codec.fill_noop(message.codes(0), message.scales(0))
    code, scale = NOOP_BYTES[name]
    assert bytes(message.codes(0).numpy()) == code * (codec.code_bytes(100) // len(code))
    assert bytes(message.scales(0).view(torch.uint8).numpy()) == scale * codec.scale_count(100)
    k = kernels(settings)
    decoded = k.dequantize(message.codes(0), message.scales(0), k.padded(100))[:100]
    assert torch.equal(as_ints(decoded), as_ints(torch.full((100,), -0.0)))


@pytest.mark.parametrize("name", FIXED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_noop_sync_changes_no_bit_of_any_model(name: str, dtype: torch.dtype) -> None:
    settings = settings_for(name)
    codec = codec_for(settings)
    values = awkward(dtype, 1000)
    codes = torch.empty(codec.code_bytes(1000), dtype=torch.uint8)
    scales = torch.empty(codec.scale_count(1000), dtype=codec.scale_dtype)
    codec.fill_noop(codes, scales)
    base, target = values.clone(), torch.empty_like(values)
    apply_sync(kernels(settings), codes, scales, base, target)
    assert torch.equal(as_ints(target), as_ints(values)) and torch.equal(as_ints(base), as_ints(values))


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_a_refused_round_leaves_every_hosts_bits_unchanged(name: str) -> None:
    """The coordinator refuses a round whose result overflows fp16; its sync, applied by a host as any sync is,
    changes no bit of the host's model (signed zeros and subnormals included), so the hash still matches."""
    settings = settings_for(name)
    named = model()
    pool = WorkerPool(settings, "cpu", 2)
    try:
        coordinator = CoordinatorModel(spec_of(named), [t.clone() for _, t in named], settings, pool)
        before, before_hash = [as_ints(t) for _, t in named], coordinator.hash
        step = [torch.full(t.shape, 50000.0 if n == "big" else 1.0) for n, t in named]
        coordinator.accumulate(delta(coordinator.specs, settings, step), 4)
        closed = coordinator.close_round(0)
        assert closed.not_finite == ["big"]
        assert closed.sync.meta.model_hash == closed.sync.meta.base_hash == before_hash == coordinator.hash
        assert all(torch.equal(as_ints(t), b) for t, b in zip(coordinator.tensors, before))

        host = HostTensors([(n, t.clone()) for n, t in named])
        host.allocate(settings, codec_threads=1)
        try:
            sync = Message.parse(closed.sync.buffer.clone())
            hashers = host.apply(sync, into_live=True)
            assert host.digest(hashers) == before_hash == model_hash(named)
            assert all(torch.equal(as_ints(t), b) for t, b in zip(host.live, before))
            assert all(torch.equal(as_ints(t), b) for t, b in zip(host.base, before))
        finally:
            host.close()
    finally:
        pool.close()
