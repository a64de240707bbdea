"""The q4 kernels against the plain reference, error bounds, error feedback, and the bit-identity rule."""

from __future__ import annotations

import pytest
import torch
from reference_q4 import decode_reference, encode_reference, kernels

from lightning_nodeox.core.codec import (
    accumulate_tensor,
    apply_sync,
    decode_tensor,
    encode_delta,
    encode_sync_and_apply,
    encode_tensor,
    relative_error,
)
from lightning_nodeox.core.codecs import codec_for
from lightning_nodeox.core.codecs.blockwise import block_count
from lightning_nodeox.core.codecs.q4 import code_bytes
from lightning_nodeox.core.pool import WorkerPool
from lightning_nodeox.core.codecs.settings import BLOCK_SIZES, CodecSettings, Q4Settings
from lightning_nodeox.core.settings import check_rounding

SIZES = [0, 1, 2, 31, 63, 64, 65, 255, 256, 257, 1000, 4099]


def encode(x: torch.Tensor, settings: CodecSettings, chunk: int = 256, seed: int | None = None):
    k = kernels(settings, chunk)
    codes = torch.empty(code_bytes(x.numel(), settings.block_size), dtype=torch.uint8)
    scales = torch.empty(block_count(x.numel(), settings.block_size), dtype=codec_for(settings).scale_dtype)
    encode_tensor(k, x, codes, scales, seed=seed)
    return k, codes, scales


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize(("settings", "seed"), [
    (Q4Settings(), None), (Q4Settings(block_size=32, scale_dtype="fp32"), None), (Q4Settings(block_size=256), None),
    (Q4Settings(), 7), (Q4Settings(block_size=128, scale_dtype="fp32"), 7),  # a seed: stochastic rounding
])
def test_kernels_match_reference(n: int, settings: CodecSettings, seed: int | None) -> None:
    x = torch.randn(n, generator=torch.Generator().manual_seed(n)) * 3
    if n >= 128:
        x[64:128] = 0  # an all-zero block
    k, codes, scales = encode(x, settings, seed=seed)
    ref_codes, ref_scales = encode_reference(x, settings, seed=seed, chunk=k.chunk)
    assert torch.equal(codes, ref_codes)
    assert torch.equal(scales, ref_scales)
    out = torch.empty(n)
    decode_tensor(k, codes, scales, out)
    assert torch.equal(out, decode_reference(codes, scales, n, settings.block_size))


def test_chunking_does_not_change_codes() -> None:
    x = torch.randn(10_000)
    settings = Q4Settings(block_size=32)
    _, a, sa = encode(x, settings, chunk=64)
    _, b, sb = encode(x, settings, chunk=4096)
    assert torch.equal(a, b) and torch.equal(sa, sb)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_gaussian_error_zeros_and_size(block_size: int) -> None:
    n = 1 << 18
    x = torch.randn(n, generator=torch.Generator().manual_seed(0))
    x[1000:3000] = 0
    settings = Q4Settings(block_size=block_size)
    k, codes, scales = encode(x, settings, chunk=1 << 14)
    out = torch.empty(n)
    decode_tensor(k, codes, scales, out)
    error = relative_error(x, out)
    if block_size == 64:
        assert error <= 0.12
    assert error < 0.2
    assert torch.all(out[x == 0] == 0), "zeros stay zero"
    payload = codes.numel() + scales.numel() * scales.element_size()
    if block_size >= 64:
        assert payload <= x.numel() * 4 / 7


def test_stochastic_rounding_is_unbiased() -> None:
    x = torch.full((64 * 512,), 0.3)
    x[::64] = 7.0  # each block's absmax: scale 1.0, so 0.3 sits between codes 0 and 1
    settings = Q4Settings()
    k, codes, scales = encode(x, settings, seed=3)  # a seed: stochastic rounding
    out = torch.empty_like(x)
    decode_tensor(k, codes, scales, out)
    mask = torch.ones_like(x, dtype=torch.bool)
    mask[::64] = False
    assert abs(out[mask].mean().item() - 0.3) < 0.01
    _, nearest_codes, nearest_scales = encode(x, Q4Settings())
    decode_tensor(k, nearest_codes, nearest_scales, out)
    assert out[mask].mean().item() == 0.0


@pytest.mark.parametrize("feedback", [True, False])
def test_error_feedback_bounds_accumulated_error(feedback: bool) -> None:
    """Over 50 rounds of Gaussian deltas, the sum of what was sent tracks the sum of the true deltas."""
    n, rounds = 1 << 15, 50
    settings = Q4Settings()
    k = kernels(settings, 4096)
    gen = torch.Generator().manual_seed(1)
    base = torch.zeros(n)
    residual = torch.zeros(n, dtype=torch.bfloat16) if feedback else None
    true_total, sent_total = torch.zeros(n), torch.zeros(n)
    codes = torch.empty(code_bytes(n, 64), dtype=torch.uint8)
    scales = torch.empty(block_count(n, 64), dtype=torch.float16)
    decoded = torch.empty(n)
    errors = []
    for _ in range(rounds):
        delta = torch.randn(n, generator=gen)
        current = base + delta
        encode_delta(k, current, base, residual, codes, scales)
        decode_tensor(k, codes, scales, decoded)
        true_total += delta
        sent_total += decoded
        errors.append(torch.linalg.vector_norm(true_total - sent_total).item())
    one_round = errors[0]
    if feedback:
        assert max(errors) <= 2 * one_round
    else:
        assert errors[-1] > 4 * one_round  # grows like sqrt(rounds) without feedback


def test_residual_is_what_quantization_left() -> None:
    n = 5000
    settings = Q4Settings()
    k = kernels(settings)
    current, base = torch.randn(n), torch.randn(n)
    residual = torch.zeros(n, dtype=torch.bfloat16)
    codes = torch.empty(code_bytes(n, 64), dtype=torch.uint8)
    scales = torch.empty(block_count(n, 64), dtype=torch.float16)
    encode_delta(k, current, base, residual, codes, scales)
    decoded = torch.empty(n)
    decode_tensor(k, codes, scales, decoded)
    expected = (current - base) - decoded
    assert torch.allclose(residual.float(), expected, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_coordinator_and_host_reach_identical_bytes(dtype: torch.dtype) -> None:
    """The coordinator applies its dequantized sync while quantizing; a host decodes and applies it: same bytes."""
    n = 3001
    settings = Q4Settings()
    model = (torch.randn(n) * 2).to(dtype)
    host_live, host_base = model.clone(), model.clone()
    acc = torch.zeros(n)
    contributions = [(torch.randn(n) * 1e-2, 30), (torch.randn(n) * 1e-2, 10)]
    for i, (delta, samples) in enumerate(contributions):
        k = kernels(settings, 512)
        codes = torch.empty(code_bytes(n, 64), dtype=torch.uint8)
        scales = torch.empty(block_count(n, 64), dtype=torch.float16)
        encode_tensor(k, delta, codes, scales)
        accumulate_tensor(k, codes, scales, acc, float(samples), assign=i == 0)
    sync_codes = torch.empty(code_bytes(n, 64), dtype=torch.uint8)
    sync_scales = torch.empty(block_count(n, 64), dtype=torch.float16)
    coordinator_model = model.clone()
    encode_sync_and_apply(kernels(settings, 1024), acc, 1 / 40, coordinator_model, sync_codes, sync_scales)
    apply_sync(kernels(settings, 256), sync_codes, sync_scales, host_base, host_live)
    assert torch.equal(host_live.view(torch.uint8 if dtype == torch.float32 else torch.int16),
                       coordinator_model.view(torch.uint8 if dtype == torch.float32 else torch.int16))
    assert torch.equal(host_base, host_live)
    if dtype == torch.float32:  # half-precision models cannot hold such small steps exactly
        mean = sum(d * s for d, s in contributions) / 40
        assert relative_error(mean, coordinator_model - model) < 0.25


def test_pool_runs_tasks_in_parallel_with_the_same_result() -> None:
    n = 300_000
    settings = Q4Settings()
    x, base = torch.randn(n), torch.zeros(n)
    outputs = []
    for threads in (1, 2):
        pool = WorkerPool(settings, "cpu", threads)
        codes = torch.empty(code_bytes(n, 64), dtype=torch.uint8)
        scales = torch.empty(block_count(n, 64), dtype=torch.float16)
        pool.run([lambda k, a=a, b=b: encode_delta(k, x, base, None, codes, scales, start=a, stop=b)
                  for a, b in pool.split(n)])
        pool.close()
        outputs.append((codes, scales))
    assert torch.equal(outputs[0][0], outputs[1][0]) and torch.equal(outputs[0][1], outputs[1][1])


def test_settings_reject_bad_values() -> None:
    with pytest.raises(ValueError, match="block_size=48"):
        Q4Settings(block_size=48)
    with pytest.raises(ValueError, match="scale_dtype"):
        Q4Settings(scale_dtype="bf16")
    with pytest.raises(ValueError, match="rounding"):
        check_rounding("up")  # a host's setting (NodeoxStrategy(rounding=...))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: encoding on the training device")
def test_cuda_kernels_match_cpu() -> None:
    n = 1_000_003
    settings = Q4Settings()
    x = torch.randn(n)
    _, cpu_codes, cpu_scales = encode(x, settings, chunk=1 << 16)
    k = Q4Kernels_cuda = kernels_on("cuda", settings)
    codes = torch.empty(code_bytes(n, 64), dtype=torch.uint8, device="cuda")
    scales = torch.empty(block_count(n, 64), dtype=torch.float16, device="cuda")
    encode_tensor(Q4Kernels_cuda, x.cuda(), codes, scales)
    assert torch.equal(codes.cpu(), cpu_codes) and torch.equal(scales.cpu(), cpu_scales)
    model = torch.randn(n)
    on_cpu, on_gpu = model.clone(), model.cuda()
    apply_sync(kernels(settings, 1 << 16), cpu_codes, cpu_scales, on_cpu.clone(), on_cpu)
    apply_sync(k, codes, scales, on_gpu.clone(), on_gpu)
    assert torch.equal(on_cpu.view(torch.int32), on_gpu.cpu().view(torch.int32))


def kernels_on(device: str, settings: CodecSettings):
    return codec_for(settings).kernels(device)
