"""The int8 and fp8 codecs: their kernels against plain whole-tensor definitions (fp8's written from the e4m3 format's
bits, not torch's cast), the error bounds their docstrings state, error feedback (on and off), bit-identical syncs,
their malformed messages refused, and a real run with each."""

from __future__ import annotations

import json
import math

import pytest
import torch
from helpers import (MODEL, SPECS, bits, blockwise_round_trip, codec_run, delta_message, encode_flat, feedback_errors,
                     host_delta, refused_then_published, synced_on_both_sides)
from reference_q4 import chunk_noise

from lightning_nodeox.core.codec import decode_tensor, relative_error
from lightning_nodeox.core.codecs import codec_for
from lightning_nodeox.core.codecs.settings import CodecSettings, FP8Settings, Int8Settings, Q4Settings
from lightning_nodeox.core.specs import spec_of
from lightning_nodeox.core.wire import Message, MessageLayout

INT8, FP8 = Int8Settings(), FP8Settings()
TOP = {"int8": 127.0, "fp8": 448.0}
SIZES = [0, 1, 2, 31, 63, 64, 65, 255, 256, 257, 1000, 4099]


def e4m3_values() -> torch.Tensor:
    """The value of each of the 256 e4m3fn bytes by the format's definition: sign, 4 exponent bits (bias 7), 3
    mantissa bits; exponent 0 is subnormal (``m * 2**-9``); ``0x7f`` and ``0xff`` are NaN, there is no infinity."""
    values = []
    for byte in range(256):
        sign = -1.0 if byte & 0x80 else 1.0
        exponent, mantissa = byte >> 3 & 0xF, byte & 7
        if exponent == 15 and mantissa == 7:
            values.append(math.nan)
        elif exponent == 0:
            values.append(sign * mantissa * 2.0**-9)
        else:
            values.append(sign * (1 + mantissa / 8) * 2.0 ** (exponent - 7))
    return torch.tensor(values, dtype=torch.float64)


E4M3 = e4m3_values()


def e4m3_bytes(y: torch.Tensor) -> torch.Tensor:
    """The e4m3 byte nearest each of ``y`` (|y| <= 448), ties to the even byte, the sign kept (-0.0 too)."""
    grid = E4M3[:127]  # bytes 0x00..0x7e: the values 0 .. 448, increasing
    a = y.abs().double()
    hi = torch.searchsorted(grid, a).clamp(max=126)
    lo = (hi - 1).clamp(min=0)
    below, above = a - grid[lo], grid[hi] - a
    pick = torch.where((above < below) | ((above == below) & (hi % 2 == 0)), hi, lo)
    return (pick | torch.signbit(y).long() << 7).to(torch.uint8)


def scales_of(x: torch.Tensor, settings: CodecSettings) -> torch.Tensor:
    """absmax / top of each block, rounded up to fp16 where scales are (torch.nextafter, not the kernels' bits)."""
    bs, n = settings.block_size, x.numel()
    nb = -(-n // bs)
    padded = torch.zeros(nb * bs)
    padded[:n] = x.float()
    scale = padded.view(nb, bs).abs().amax(dim=1) / TOP[settings.name]
    if settings.scale_dtype == "fp32":
        return scale
    half = scale.half()
    return torch.where(half.float() < scale, torch.nextafter(half, torch.tensor(math.inf, dtype=torch.float16)), half)


def reference(x: torch.Tensor, settings: CodecSettings, *, seed: int | None = None, chunk: int = 0):
    """(codes, scales) of flat ``x`` by the definitions in int8's and fp8's docstrings, one whole tensor at a time."""
    bs, n = settings.block_size, x.numel()
    nb = -(-n // bs)
    padded = torch.zeros(nb * bs)
    padded[:n] = x.float()
    scales = scales_of(x, settings)
    y = padded.view(nb, bs) * (1.0 / scales.float().clamp_min(1e-30))[:, None]
    if seed is not None:  # stochastic rounding (int8), with the kernels' own noise
        y = (y + chunk_noise(n, bs, seed, chunk).view(nb, bs)).clamp(-127, 127)
    y = y.reshape(-1)
    if settings.name == "fp8":
        return e4m3_bytes(y), scales
    return (torch.round(y).to(torch.int64) & 0xFF).to(torch.uint8), scales


def decoded_reference(codes: torch.Tensor, scales: torch.Tensor, n: int, settings: CodecSettings) -> torch.Tensor:
    unscaled = E4M3[codes.long()].float() if settings.name == "fp8" else codes.view(torch.int8).float()
    return (unscaled.view(-1, settings.block_size) * scales.float()[:, None]).view(-1)[:n]


def wide(n: int, seed: int = 4) -> torch.Tensor:
    """Values over twelve decades (e4m3 subnormals in most blocks), outliers, blocks of zeros, of equal values, of
    -0.0, and of magnitudes whose fp16 scale is subnormal or would round to zero."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen) * 10 ** (torch.rand(n, generator=gen) * 12 - 10)
    x[::97] *= 40
    if n >= 64 * 12:
        x[64 * 2 : 64 * 3] = 0.0
        x[64 * 3 : 64 * 4] = -0.0
        x[64 * 4 : 64 * 5] = 0.25
        x[64 * 5 : 64 * 6] = torch.randn(64, generator=gen) * 1e-4  # fp16 scale subnormal
        x[64 * 6 : 64 * 7] = torch.randn(64, generator=gen) * 1e-11  # absmax / top below fp16's smallest
    return x


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize(("settings", "seed"), [
    (INT8, None), (Int8Settings(block_size=32, scale_dtype="fp32"), None), (Int8Settings(block_size=256), None),
    (INT8, 7), (Int8Settings(block_size=128, scale_dtype="fp32"), 7),  # a seed: stochastic rounding
    (FP8, None), (FP8Settings(block_size=32, scale_dtype="fp32"), None), (FP8Settings(block_size=256), None),
])
def test_kernels_match_the_definition(n: int, settings: CodecSettings, seed: int | None) -> None:
    x = wide(n, seed=n) if n < 1000 else wide(n)
    k, codes, scales = encode_flat(x, settings, seed=seed)
    ref_codes, ref_scales = reference(x, settings, seed=seed, chunk=k.chunk)
    assert torch.equal(codes, ref_codes) and torch.equal(scales, ref_scales)
    out = torch.empty(n)
    decode_tensor(k, codes, scales, out)
    assert torch.equal(bits(out), bits(decoded_reference(codes, scales, n, settings)))


def test_the_e4m3_definition_is_torchs_float8_e4m3fn() -> None:
    """Every finite byte widens to the value the format defines; 0x7f and 0xff are NaN."""
    every = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).double()
    finite = ~E4M3.isnan()
    assert torch.equal(every[finite], E4M3[finite]) and bool(every[~finite].isnan().all())
    assert E4M3[0x7E] == 448 and E4M3[1] == 2.0**-9 and E4M3[8] == 2.0**-6


@pytest.mark.parametrize("settings", [INT8, FP8])
def test_chunking_does_not_change_codes(settings: CodecSettings) -> None:
    x = wide(10_000)
    _, a, sa = encode_flat(x, settings, chunk=64)
    _, b, sb = encode_flat(x, settings, chunk=4096)
    assert torch.equal(a, b) and torch.equal(sa, sb)


@pytest.mark.parametrize("scale_dtype", ["fp16", "fp32"])
def test_fp16_scales_round_up_so_nothing_is_clipped(scale_dtype: str) -> None:
    """Each scale is at least absmax / top and the next fp16 below it is not: the top value is sent whole."""
    n = 64 * 400
    x = wide(n)
    for settings in (Int8Settings(scale_dtype=scale_dtype), FP8Settings(scale_dtype=scale_dtype)):
        _, _, scales = encode_flat(x, settings)
        exact = x.view(-1, 64).abs().amax(dim=1) / TOP[settings.name]
        assert bool((scales.float() >= exact).all())
        if scale_dtype == "fp16":
            down = torch.nextafter(scales, torch.tensor(-math.inf, dtype=torch.float16)).float()
            assert bool(((down < exact) | (exact == 0)).all())
            assert bool((exact.half().float() < exact).any()), "some scales were rounded up"
            assert bool((scales[5] > 0) & (scales[6] > 0)), "a subnormal scale, not zero"


@pytest.mark.parametrize("scale_dtype", ["fp16", "fp32"])
def test_int8_nearest_rounding_keeps_the_error_bound_of_the_docstring(scale_dtype: str) -> None:
    """``|x - d| <= s / 2`` per value (s the scale as sent), up to ``2**-22 |x|``; the bound is reached."""
    x = wide(64 * 400 + 21)  # a partial last block
    d, s = blockwise_round_trip(x, Int8Settings(scale_dtype=scale_dtype))
    err = (x - d).abs()
    assert bool(err.le(s / 2 + x.abs() * 2**-22).all())
    assert float((err / s.clamp_min(1e-38)).max()) > 0.49
    assert bool((d[64 * 2 : 64 * 4] == 0).all()), "zeros stay zero"


def test_int8_stochastic_rounding_keeps_its_bound_and_is_unbiased() -> None:
    x = wide(64 * 400 + 21)
    d, s = blockwise_round_trip(x, Int8Settings(scale_dtype="fp32"), seed=5)
    err = (x - d).abs()
    assert bool(err.le(s + x.abs() * 2**-22).all()) and float((err / s.clamp_min(1e-38)).max()) > 0.6
    y = torch.full((64 * 512,), 0.3)
    y[::64] = 127.0  # s = 1: 0.3 sits between codes 0 and 1
    out, _ = blockwise_round_trip(y, Int8Settings(scale_dtype="fp32"), seed=3)
    mask = y != 127.0
    assert abs(out[mask].mean().item() - 0.3) < 0.01
    assert torch.equal(blockwise_round_trip(y, Int8Settings(scale_dtype="fp32"))[0][mask], torch.zeros(int(mask.sum())))


@pytest.mark.parametrize("scale_dtype", ["fp16", "fp32"])
def test_fp8_keeps_the_error_bound_of_the_docstring(scale_dtype: str) -> None:
    """``|x - d| <= max(2**-4 |x|, 2**-10 s)`` per value, up to ``2**-22 |x|``; both parts of the bound are
    reached (normal values near 2**-4 relative, subnormals near the floor)."""
    x = wide(64 * 400 + 21)
    d, s = blockwise_round_trip(x, FP8Settings(scale_dtype=scale_dtype))
    err = (x - d).abs()
    assert bool(err.le(torch.maximum(x.abs() * 2**-4, s * 2**-10) + x.abs() * 2**-22).all())
    normal = (x.abs() >= s * 2**-6) & (x != 0)
    assert float((err[normal] / x[normal].abs()).max()) > 0.9 * 2**-4
    assert float((err[~normal] / s[~normal].clamp_min(1e-38)).max()) > 0.9 * 2**-10
    assert bool((d[~normal] != 0).any()), "some values were sent as e4m3 subnormals"
    assert torch.equal(bits(d[64 * 2 : 64 * 4]), bits(x[64 * 2 : 64 * 4])), "zeros stay zeros, -0.0 included"


def test_fp8_refuses_stochastic_rounding_naming_the_fix() -> None:
    with pytest.raises(ValueError, match="codec 'fp8' rounds to nearest only: use rounding='nearest'"):
        codec_for(FP8).check_rounding("stochastic")
    codec_for(INT8).check_rounding("stochastic")


def test_a_non_finite_value_makes_its_block_scale_non_finite() -> None:
    """What every codec's check refuses (a host's NaN delta, a coordinator's overflowing sync); the finite blocks
    around it are sent as usual, and no finite block yields a NaN byte."""
    x = torch.randn(64 * 4)
    x[70], x[140] = math.nan, math.inf
    for settings in (INT8, FP8):
        codec = codec_for(settings)
        _, codes, scales = encode_flat(x, settings)
        assert math.isnan(scales[1]) and math.isinf(scales[2]) and bool(scales[[0, 3]].isfinite().all())
        assert not math.isfinite(codec.magnitude(codes, scales))
        assert codec.malformed(torch.cat([codes[:64], codes[192:]]), scales[[0, 3]], 128) is None
    _, big, big_scales = encode_flat(torch.full((64,), 1e9), FP8)  # absmax / 448 beyond fp16's range
    assert math.isinf(big_scales[0]) and codec_for(FP8).too_large("w", 0) is not None


@pytest.mark.parametrize("block_size", [64, 256])
def test_error_and_size_against_q4(block_size: int) -> None:
    """Gaussian values: int8 about 0.006 relative error, fp8 about 0.025 (q4: 0.11); values whose magnitudes span
    decades (log-normal, sigma 2): fp8 is the more accurate, its relative steps the same at every magnitude."""
    n = 1 << 18
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, generator=gen)
    spread = torch.randn(n, generator=gen) * torch.exp(2 * torch.randn(n, generator=gen))
    int8, fp8 = Int8Settings(block_size=block_size), FP8Settings(block_size=block_size)
    error = {(s.name, name): relative_error(v, blockwise_round_trip(v, s)[0])
             for s in (int8, fp8, Q4Settings(block_size=block_size)) for name, v in (("gauss", x), ("spread", spread))}
    assert 0.005 < error["int8", "gauss"] < 0.0075 and 0.024 < error["fp8", "gauss"] < 0.027
    assert error["q4", "gauss"] > 0.1
    assert error["fp8", "spread"] < 0.7 * error["int8", "spread"] < 0.7 * 0.016
    specs = spec_of([("t", x)])
    data = {s.name: MessageLayout.of(specs, s(block_size=block_size)).regions[-1].codes[1]  # the tensor's data
            for s in (Int8Settings, FP8Settings, Q4Settings)}
    assert data["int8"] == data["fp8"] == n // block_size * (block_size + 2)  # a byte a value, an fp16 scale a block
    assert data["q4"] == n // block_size * (block_size // 2 + 2)
    assert data["int8"] / data["q4"] == {64: 66 / 34, 256: 258 / 130}[block_size]


@pytest.mark.parametrize("settings", [INT8, FP8])
@pytest.mark.parametrize("feedback", [True, False])
def test_error_feedback_bounds_accumulated_error(settings: CodecSettings, feedback: bool) -> None:
    """Over 50 rounds of Gaussian deltas, the sum of what was sent tracks the sum of the true deltas with error
    feedback (the residual holds the difference, up to its bf16 rounding), and drifts without."""
    errors, behind, residual = feedback_errors(settings, error_feedback=feedback)
    if feedback:
        assert max(errors) <= 2 * errors[0]
        assert relative_error(behind, residual.float()) < 0.03
    else:
        assert errors[-1] > 4 * errors[0]


@pytest.mark.parametrize("settings", [INT8, FP8])
@pytest.mark.parametrize("feedback", [True, False])
def test_a_host_keeps_a_residual_only_with_error_feedback(settings: CodecSettings, feedback: bool) -> None:
    as_run, parts = host_delta(settings, error_feedback=feedback)
    assert as_run and (parts is None) == (not feedback)
    for delta, sent, residual in parts or []:
        assert bool((delta != sent).any())
        assert torch.allclose(residual.float(), delta - sent, atol=1e-7, rtol=1e-2)


@pytest.mark.parametrize("settings", [INT8, FP8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_coordinator_and_host_reach_identical_bytes(settings: CodecSettings, dtype: torch.dtype) -> None:
    n = 3001
    model = (torch.randn(n) * 2).to(dtype)
    contributions = [(torch.randn(n) * 1e-2, 30), (wide(n) * 1e-2, 10)]
    coordinator_model, host_live, host_base = synced_on_both_sides(settings, model, contributions)
    assert torch.equal(bits(host_live), bits(coordinator_model)) and torch.equal(host_base, host_live)
    if dtype == torch.float32:
        mean = sum(d * s for d, s in contributions) / 40
        assert relative_error(mean, coordinator_model - model) < {"int8": 0.02, "fp8": 0.04}[settings.name]


# Malformed messages, through the coordinator's own checks (the in-process transport)

_gen = torch.Generator().manual_seed(9)
GOOD_A = [torch.randn(t.shape, generator=_gen) * 0.01 for _, t in MODEL]
GOOD_B = [torch.randn(t.shape, generator=_gen) * 0.01 for _, t in MODEL]


def body(settings: CodecSettings, host: str, base: str, values=GOOD_B, samples: int = 10, specs=SPECS) -> bytearray:
    message = delta_message(values, host=host, base_hash=base, samples=samples, settings=settings, specs=specs)
    return bytearray(message.view())


def resealed(settings: CodecSettings, base: str, change) -> bytearray:
    """Host b's delta with ``change(message)`` made to its data, then every CRC made right again."""
    message = Message.parse(body(settings, "b", base))
    change(message)
    message.write_header(message.meta)
    return bytearray(message.view())


def set_scale(value: float):
    def change(message: Message) -> None:
        message.scales(0)[2] = value
    return change


def set_code(byte: int):
    def change(message: Message) -> None:
        message.codes(1)[5] = byte
    return change


def bad_deltas(settings: CodecSettings) -> dict:
    """name: (body of the base hash, what the refusal says)."""
    other = FP8 if settings.name == "int8" else INT8
    said = f"payload uses {other}; this run uses {settings}"
    return {
        "truncated": (lambda b: body(settings, "b", b)[:-16], f"bytes but this model's {settings.name} delta is"),
        "a NaN scale": (lambda b: resealed(settings, b, set_scale(math.nan)), "NaN or Inf scales for tensor 'fc.weight'"),
        "an Inf scale": (lambda b: resealed(settings, b, set_scale(math.inf)), "NaN or Inf scales for tensor 'fc.weight'"),
        "a code no encoder writes": (
            lambda b: resealed(settings, b, set_code({"int8": 0x80, "fp8": 0xFF}[settings.name])),
            {"int8": "payload tensor 'fc.bias' has code -128 (byte 0x80; int8 codes span -127..127)",
             "fp8": "payload tensor 'fc.bias' has NaN codes (e4m3 bytes 0x7f or 0xff)"}[settings.name]),
        "a q4 delta": (lambda b: body(Q4Settings(), "b", b), f"payload uses q4 (block_size 64, scale_dtype fp16); this run uses {settings}"),
        "the other 8-bit codec, same size": (lambda b: body(other, "b", b), said),
        f"{settings.name} at another block size": (
            lambda b: body(type(settings)(block_size=32), "b", b, GOOD_B[:1], specs=SPECS[:1]),
            f"payload uses {settings.name} (block_size 32, scale_dtype fp16); this run uses {settings}"),
    }


@pytest.mark.parametrize("settings", [INT8, FP8])
def test_malformed_deltas_are_refused_and_change_nothing(settings: CodecSettings, tmp_path) -> None:
    """Host a's delta, then every bad one of host b (each refused, naming why), then b's good delta: the published
    model is exactly the one computed here from a's and b's deltas."""
    assert MessageLayout.of(SPECS, INT8).total == MessageLayout.of(SPECS, FP8).total
    refused_then_published(tmp_path, settings, bad_deltas(settings), GOOD_A, GOOD_B)


@pytest.mark.slow
@pytest.mark.parametrize("codec", ["int8", "fp8"])
def test_a_real_run_keeps_hosts_bit_identical(codec: str, tmp_path) -> None:
    """``nodeox launch --codec int8|fp8``: two digits hosts, host 1 without error feedback; after every round both
    hold the published model bit for bit, each upload is the layout's size (1.9x q4's data), and the loss falls."""
    events, named, out = codec_run(tmp_path, "--codec", codec)
    settings = {"int8": INT8, "fp8": FP8}[codec]
    size = MessageLayout.of(spec_of(named), settings).total
    assert {e["bytes"] for e in events if e["phase"] == "upload"} == {size}
    ours, q4 = (layout.total - layout.data_start for layout in (MessageLayout.of(spec_of(named), s)
                                                                 for s in (settings, Q4Settings())))
    assert 1.8 * q4 < ours < 2.0 * q4
    for host in (0, 1):
        losses = json.loads((out / f"host{host}_losses.json").read_text())
        assert sum(losses[-5:]) / 5 < 0.6 * sum(losses[:5]) / 5
