"""The q2 codec: its kernels against a plain whole-tensor definition, the error bound its docstring states, error
feedback (on and off), bit-identical syncs, its malformed messages refused, and a real run with ``--codec q2``."""

from __future__ import annotations

import json
import math

import pytest
import torch
from helpers import (MODEL, SPECS, bits, blockwise_round_trip, codec_run, delta_message, encode_flat, feedback_errors,
                     host_delta, refused_then_published, synced_on_both_sides)
from reference_q4 import chunk_noise, kernels

from lightning_nodeox.core.codec import apply_sync, decode_tensor, encode_tensor, relative_error
from lightning_nodeox.core.codecs import codec_for
from lightning_nodeox.core.codecs.q2 import SCALE, code_bytes
from lightning_nodeox.core.codecs.settings import CodecSettings, Q2Settings, Q4Settings
from lightning_nodeox.core.specs import spec_of
from lightning_nodeox.core.wire import MessageLayout, Message

Q2 = Q2Settings()
SIZES = [0, 1, 2, 31, 63, 64, 65, 255, 256, 257, 1000, 4099]


def mean_scales(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """``s0 = 0.7 * mean|x|`` of each block, over the block's own values."""
    n = x.numel()
    nb = -(-n // block_size)
    padded = torch.zeros(nb * block_size)
    padded[:n] = x.float()
    counts = [min(block_size, n - i * block_size) for i in range(nb)]
    return torch.stack([padded.view(nb, block_size)[i].abs().sum() * (SCALE / counts[i]) for i in range(nb)]
                       ) if nb else torch.zeros(0)


def reference(x: torch.Tensor, settings: CodecSettings, *, seed: int | None = None, chunk: int = 0):
    """(packed codes, scales) of flat ``x`` by the definition in q2's docstring, one whole tensor at a time."""
    bs, n = settings.block_size, x.numel()
    nb = -(-n // bs)
    padded = torch.zeros(nb * bs)
    padded[:n] = x.float()
    blocks = padded.view(nb, bs)
    scale = mean_scales(x, bs)
    stochastic = seed is not None
    if stochastic and settings.scale_dtype == "fp16":
        scale = scale.half().float()
    t = blocks * (0.5 / scale.clamp_min(1e-30))[:, None] + 1.5
    if stochastic:
        t = t + chunk_noise(n, bs, seed, chunk).view(nb, bs)
    c = torch.round(t.clamp(0, 3)).to(torch.int64)
    if not stochastic:
        levels = (2 * c - 3).float()
        num = torch.stack([(blocks[i] * levels[i]).sum() for i in range(nb)]) if nb else scale
        den = torch.stack([(levels[i] * levels[i]).sum() for i in range(nb)]) if nb else scale
        if n % bs:
            den[-1] -= bs - n % bs
        scale = num / den
    c = c.view(-1)
    packed = (c[0::4] | c[1::4] << 2 | c[2::4] << 4 | c[3::4] << 6).to(torch.uint8)
    return packed, scale.to(codec_for(settings).scale_dtype)


def decoded_reference(packed: torch.Tensor, scales: torch.Tensor, n: int, block_size: int) -> torch.Tensor:
    p = packed.to(torch.int64)
    c = torch.stack([p & 3, p >> 2 & 3, p >> 4 & 3, p >> 6 & 3], dim=1).view(-1)
    return ((2 * c - 3).float().view(-1, block_size) * scales.float()[:, None]).view(-1)[:n]


def encode(x: torch.Tensor, settings: CodecSettings = Q2, chunk: int = 256, seed: int | None = None):
    return encode_flat(x, settings, chunk=chunk, seed=seed)


def round_trip(x: torch.Tensor, settings: CodecSettings = Q2, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    return blockwise_round_trip(x, settings, **kw)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize(("settings", "seed"), [
    (Q2, None), (Q2Settings(block_size=32, scale_dtype="fp32"), None), (Q2Settings(block_size=256), None),
    (Q2, 7), (Q2Settings(block_size=128, scale_dtype="fp32"), 7),  # a seed: stochastic rounding
])
def test_kernels_match_the_definition(n: int, settings: CodecSettings, seed: int | None) -> None:
    x = torch.randn(n, generator=torch.Generator().manual_seed(n)) * 3
    if n >= 512:
        x[256:512] = 0  # an all-zero block at every block size
    k, codes, scales = encode(x, settings, seed=seed)
    ref_codes, ref_scales = reference(x, settings, seed=seed, chunk=k.chunk)
    assert torch.equal(codes, ref_codes) and torch.equal(scales, ref_scales)
    out = torch.empty(n)
    decode_tensor(k, codes, scales, out)
    assert torch.equal(out, decoded_reference(codes, scales, n, settings.block_size))
    if n >= 512:
        assert torch.equal(out[256:512], torch.zeros(256)), "a block of zeros stays zero"


def test_chunking_does_not_change_codes() -> None:
    x = torch.randn(10_000)
    _, a, sa = encode(x, Q2Settings(block_size=32), chunk=64)
    _, b, sb = encode(x, Q2Settings(block_size=32), chunk=4096)
    assert torch.equal(a, b) and torch.equal(sa, sb)


def outliers(n: int) -> torch.Tensor:
    x = torch.randn(n, generator=torch.Generator().manual_seed(4))
    x[::97] *= 40  # clipped to 3 s0
    x[64 * 7 : 64 * 8] = 0.25  # a block of equal values
    return x


def test_nearest_rounding_keeps_the_error_bound_of_the_docstring() -> None:
    """Per block ``||x - d|| <= ||x - d0||``, ``d0 = l * s0``, and ``|x - d0| <= max(s0, |x| - 3 s0)`` per value."""
    n = 64 * 400 + 21  # a partial last block
    x = outliers(n)
    for scale_dtype, slack in (("fp32", 1e-6), ("fp16", 2e-3)):
        settings = Q2Settings(scale_dtype=scale_dtype)
        _, codes, scales = encode(x, settings)
        levels = decoded_reference(codes, torch.ones(scales.numel()), n, 64)
        d = decoded_reference(codes, scales, n, 64)
        s0 = mean_scales(x, 64).repeat_interleave(64)[:n]
        d0 = levels * s0
        assert bool((x - d0).abs().le(torch.maximum(s0, x.abs() - 3 * s0) * (1 + 1e-6)).all())
        assert bool((x.abs() - 3 * s0 > s0).any()), "some values were clipped"
        pad = -n % 64
        err, err0 = ((torch.nn.functional.pad(v, (0, pad)).view(-1, 64) ** 2).sum(1) for v in (x - d, x - d0))
        assert bool(err.le(err0 * (1 + slack) + 1e-12).all())
        assert torch.equal(d[64 * 7 : 64 * 8], torch.full((64,), 0.25)), "equal values come back exact"
        assert s0[-1].item() == pytest.approx(0.7 * x[-21:].abs().mean().item(), rel=1e-6)  # its own 21 values


def test_stochastic_rounding_keeps_the_error_bound_of_the_docstring() -> None:
    """``|x - d| <= max(2s, |x| - 3s)`` per value, with s = s0 (nothing refit)."""
    n = 64 * 400 + 21
    x = outliers(n)
    settings = Q2Settings(scale_dtype="fp32")
    d, s = round_trip(x, settings, seed=5)  # a seed: stochastic rounding
    assert torch.equal(s, mean_scales(x, 64).repeat_interleave(64)[:n])
    assert bool((x - d).abs().le(torch.maximum(2 * s, x.abs() - 3 * s) * (1 + 1e-6)).all())
    assert bool(((x - d).abs() > 1.5 * s).any())


@pytest.mark.parametrize("block_size", [64, 128])
def test_gaussian_error_and_size_against_q4(block_size: int) -> None:
    n = 1 << 18
    x = torch.randn(n, generator=torch.Generator().manual_seed(0))
    q2, q4 = Q2Settings(block_size=block_size), Q4Settings(block_size=block_size)
    error = relative_error(x, round_trip(x, q2)[0])
    q4_error = relative_error(x, round_trip(x, q4)[0])
    assert 0.33 < error < 0.36 and 0.10 < q4_error < 0.12
    layouts = [MessageLayout.of(spec_of([("t", x)]), s) for s in (q2, q4, Q4Settings())]
    data = [layout.regions[-1].codes[1] for layout in layouts]  # the tensor data (one piece: its CRC and the trailer after)
    assert code_bytes(n, block_size) == n // 4
    assert data[0] == n // 4 + 2 * n // block_size  # four codes a byte, one fp16 scale a block
    assert data[2] == n // 2 + 2 * n // 64
    if block_size == 128:
        assert data[0] * 2 == data[2]  # half the bytes of q4 at its default block size


def test_stochastic_rounding_is_unbiased() -> None:
    x = torch.full((64 * 512,), 0.3)
    x[::64] = 10.0  # each block's mean: about 0.45, s about 0.31; 0.3 sits between -s and s
    out, s = round_trip(x, Q2, seed=3)  # a seed: stochastic rounding
    mask = torch.ones_like(x, dtype=torch.bool)
    mask[::64] = False
    assert abs(out[mask].mean().item() - 0.3) < 0.01
    nearest, s = round_trip(x, Q2)  # 0.3 / 2s + 1.5 is about 1.97: code 2, +s, every time, 10 is 3s
    assert torch.equal(nearest[mask], s[mask]) and torch.equal(nearest[~mask], 3 * s[~mask])
    assert s[0].item() == pytest.approx((63 * 0.3 + 30) / (63 + 9), rel=1e-3)  # least squares for those codes


@pytest.mark.parametrize("feedback", [True, False])
def test_error_feedback_bounds_accumulated_error(feedback: bool) -> None:
    """Over 50 rounds of Gaussian deltas, the sum of what was sent tracks the sum of the true deltas with error
    feedback (a residual per host, as ``error_feedback=True`` keeps it), and drifts without."""
    errors, _, _ = feedback_errors(Q2, error_feedback=feedback)
    if feedback:
        assert max(errors) <= 2 * errors[0]
    else:
        assert errors[-1] > 4 * errors[0]


@pytest.mark.parametrize("feedback", [True, False])
def test_a_host_keeps_a_residual_only_with_error_feedback(feedback: bool) -> None:
    as_run, parts = host_delta(Q2, error_feedback=feedback)
    assert as_run and (parts is None) == (not feedback)
    for delta, sent, residual in parts or []:
        assert torch.allclose(residual.float(), delta - sent, atol=1e-4, rtol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_coordinator_and_host_reach_identical_bytes(dtype: torch.dtype) -> None:
    n = 3001
    model = (torch.randn(n) * 2).to(dtype)
    contributions = [(torch.randn(n) * 1e-2, 30), (torch.randn(n) * 1e-2, 10)]
    coordinator_model, host_live, host_base = synced_on_both_sides(Q2, model, contributions)
    assert torch.equal(bits(host_live), bits(coordinator_model)) and torch.equal(host_base, host_live)
    if dtype == torch.float32:
        mean = sum(d * s for d, s in contributions) / 40
        assert relative_error(mean, coordinator_model - model) < 0.6


# Malformed messages, through the coordinator's own checks (the in-process transport)

_gen = torch.Generator().manual_seed(9)
GOOD_A = [torch.randn(t.shape, generator=_gen) * 0.01 for _, t in MODEL]
GOOD_B = [torch.randn(t.shape, generator=_gen) * 0.01 for _, t in MODEL]


def q2_delta(host: str, base: str, values=GOOD_B, settings: CodecSettings = Q2, samples: int = 10,
             specs=SPECS) -> bytearray:
    message = delta_message(values, host=host, base_hash=base, samples=samples, settings=settings, specs=specs)
    return bytearray(message.view())


def nan_scale(base: str) -> bytearray:
    message = Message.parse(q2_delta("b", base))
    message.scales(0)[2] = math.nan
    message.write_header(message.meta)  # a correct CRC over the NaN
    return bytearray(message.view())


def flipped(data: bytearray) -> bytearray:
    data[-3] ^= 0x40
    return data


BAD = {  # name: (body, what the refusal says)
    "truncated": (lambda b: q2_delta("b", b)[:-16], "bytes but this model's q2 delta is"),
    "one flipped byte": (lambda b: flipped(q2_delta("b", b)), "integrity check"),
    "a NaN scale": (nan_scale, "NaN or Inf scales for tensor 'fc.weight'"),
    "a q4 delta": (lambda b: q2_delta("b", b, settings=Q4Settings(block_size=128)),
                   "bytes but this model's q2 delta is"),  # larger than any q2 delta
    "a q4 delta of some tensors": (lambda b: q2_delta("b", b, GOOD_B[1:], Q4Settings(), specs=SPECS[1:]),
                                   "payload uses q4 (block_size 64, scale_dtype fp16); "
                                   "this run uses q2 (block_size 64, scale_dtype fp16)"),
    "q2 at another block size": (lambda b: q2_delta("b", b, GOOD_B[:1], Q2Settings(block_size=128),
                                                    specs=SPECS[:1]),
                                 "payload uses q2 (block_size 128, scale_dtype fp16); "
                                 "this run uses q2 (block_size 64, scale_dtype fp16)"),
}


def test_malformed_q2_deltas_are_refused_and_change_nothing(tmp_path) -> None:
    """Host a's delta, then every bad one of host b (each refused, naming why), then b's good delta: the published
    model is exactly the one computed here from a's and b's q2 deltas."""
    refused_then_published(tmp_path, Q2, BAD, GOOD_A, GOOD_B)


@pytest.mark.slow
def test_a_real_run_with_q2_keeps_hosts_bit_identical(tmp_path) -> None:
    """``nodeox launch --codec q2``: two digits hosts, host 1 without error feedback; after every round both hold
    the published model bit for bit, each upload is the q2 layout's size, and the loss falls."""
    events, named, out = codec_run(tmp_path, "--codec", "q2")
    moving = [(k, t) for k, t in named if t.is_floating_point()]
    size = MessageLayout.of(spec_of(named), Q2).total
    assert {e["bytes"] for e in events if e["phase"] == "upload"} == {size}
    q2_data, q4_data = (layout.total - layout.data_start for layout in (MessageLayout.of(spec_of(named), s) for s in (Q2, Q4Settings())))
    assert q2_data < 0.56 * q4_data and moving
    for host in (0, 1):
        losses = json.loads((out / f"host{host}_losses.json").read_text())
        assert sum(losses[-5:]) / 5 < 0.6 * sum(losses[:5]) / 5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: encoding on the training device")
def test_cuda_kernels_agree_with_the_cpu_and_apply_the_same_bytes() -> None:
    """A sum over a block may round differently on the GPU (a scale an ulp apart, now and then a code at a rounding
    edge); applying the same codes gives the same bytes on both."""
    n = 1_000_003
    codec = codec_for(Q2)
    x = torch.randn(n, generator=torch.Generator().manual_seed(2))
    _, cpu_codes, cpu_scales = encode(x, Q2, chunk=1 << 16)
    gpu = codec.kernels("cuda")
    codes = torch.empty(codec.code_bytes(n), dtype=torch.uint8, device="cuda")
    scales = torch.empty(codec.scale_count(n), dtype=torch.float16, device="cuda")
    encode_tensor(gpu, x.cuda(), codes, scales)
    assert float((scales.cpu().float() - cpu_scales.float()).abs().max()) <= 1e-3 * float(cpu_scales.float().abs().max())
    assert float((codes.cpu() == cpu_codes).float().mean()) > 0.999
    model = torch.randn(n)
    on_cpu, on_gpu = model.clone(), model.cuda()
    apply_sync(kernels(Q2, 1 << 16), cpu_codes, cpu_scales, on_cpu.clone(), on_cpu)
    apply_sync(gpu, cpu_codes.cuda(), cpu_scales.cuda(), on_gpu.clone(), on_gpu)
    assert torch.equal(bits(on_cpu), bits(on_gpu.cpu()))
