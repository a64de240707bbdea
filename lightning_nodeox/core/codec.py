"""The whole-tensor loops every codec's kernels run under: encode a delta, accumulate, apply and check a sync.

Each loop walks a flat tensor in chunks of ``k.chunk`` values that stay in cache, on the tensor's own device,
and hands each chunk to the kernels of the run's codec (:mod:`lightning_nodeox.core.codecs`).

Bit-identity rule: a dequantized value is computed as ``float(c - 8) * s`` (one IEEE multiply) and applied
as ``base + d`` (one IEEE add), never fused, so hosts and coordinator reach the same bytes on any device.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable

import torch

from .codecs.base import Kernels

RESIDUAL_DTYPE = torch.bfloat16  # error-feedback memory: half the bytes of fp32, the range of fp32
_TINY = 1e-30


class NonFiniteDeltaError(ValueError):
    """A tensor to encode holds NaN or Inf, or exceeds what its scale type can hold."""


def stochastic_seed(seed: int, *parts: int) -> int:
    """A 63-bit generator seed derived from a round seed and a chunk's position, independent of threading."""
    digest = hashlib.blake2b(repr((seed, *parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def load_delta(k: Kernels, current: torch.Tensor, base: torch.Tensor, residual: torch.Tensor | None, m: int) -> None:
    """``k.x[:m] = current - base (+ β residual)``, computed in fp32; β is the codec's ``error_decay``."""
    x = k.x[:m]
    if current.dtype == torch.float32 and base.dtype == torch.float32:
        torch.sub(current, base, out=x)
    else:
        x.copy_(current)
        x.sub_(base)
    if residual is not None:
        decay = k.codec.error_decay
        if decay == 1.0:
            x.add_(residual)
        else:
            x.add_(residual, alpha=decay)


def mean_of(acc: torch.Tensor, inv_weight: float, senders: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    """``out`` = the round's mean of the accumulated ``acc``: ``acc * inv_weight``, or, with ``senders`` (each value's
    sum of weights over the deltas that sent it), ``acc / senders`` (a value no delta sent stays ``acc``'s zero)."""
    if senders is None:
        return torch.mul(acc, inv_weight, out=out)
    return torch.div(acc, torch.clamp_min(senders, _TINY), out=out)


def chunk_ranges(numel: int, chunk: int, start: int = 0, stop: int | None = None):
    stop = numel if stop is None else stop
    for s in range(start, stop, chunk):
        yield s, min(stop, s + chunk)


def encode_delta(
    k: Kernels,
    current: torch.Tensor,
    base: torch.Tensor,
    residual: torch.Tensor | None,
    codes: torch.Tensor,
    scales: torch.Tensor,
    *,
    start: int = 0,
    stop: int | None = None,
    seed: int | None = None,
) -> None:
    """The codes of ``current - base (+ β residual)`` for flat values ``[start, stop)``; the residual is updated in
    place."""
    for s, e in chunk_ranges(current.numel(), k.chunk, start, stop):
        m = e - s
        load_delta(k, current[s:e], base[s:e], None if residual is None else residual[s:e], m)
        k.quantize(
            m,
            *k.blocks(codes, scales, s, k.padded(m)),
            residual_out=None if residual is None else residual[s:e],
            seed=None if seed is None else stochastic_seed(seed, s),
        )


def encode_mean(
    k: Kernels, acc: torch.Tensor, inv_weight: float, residual: torch.Tensor | None, codes: torch.Tensor,
    scales: torch.Tensor, *, start: int = 0, stop: int | None = None, senders: torch.Tensor | None = None,
) -> None:
    """A site relay's delta: the codes of the mean (:func:`mean_of`) ``(+ residual)`` for flat values ``[start,
    stop)``; the residual is updated in place (the relay's own error feedback, not decayed)."""
    for s, e in chunk_ranges(acc.numel(), k.chunk, start, stop):
        m = e - s
        x = mean_of(acc[s:e], inv_weight, None if senders is None else senders[s:e], k.x[:m])
        if residual is not None:
            x.add_(residual[s:e])
        k.quantize(m, *k.blocks(codes, scales, s, k.padded(m)), residual_out=None if residual is None else residual[s:e])


def encode_tensor(k: Kernels, values: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, *, seed=None) -> None:
    """The codes of a plain flat tensor (reference entry point for tests and benchmarks)."""
    for s, e in chunk_ranges(values.numel(), k.chunk):
        m = e - s
        k.x[:m].copy_(values[s:e])
        k.quantize(m, *k.blocks(codes, scales, s, k.padded(m)),
                   seed=None if seed is None else stochastic_seed(seed, s))


def decode_tensor(k: Kernels, codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
    """``out`` (flat, any float dtype) = dequantized values."""
    for s, e in chunk_ranges(out.numel(), k.chunk):
        mp = k.padded(e - s)
        out[s:e].copy_(k.dequantize(*k.blocks(codes, scales, s, mp), mp)[: e - s])


def accumulate_tensor(
    k: Kernels, codes: torch.Tensor, scales: torch.Tensor, acc: torch.Tensor, weight: float,
    *, start: int = 0, stop: int | None = None, assign: bool = False, senders: torch.Tensor | None = None,
) -> None:
    """``acc += weight * dequantized`` (``acc = ...`` when ``assign``) over flat values ``[start, stop)``; with
    ``senders`` (a codec of ``mean_over_senders``), ``weight`` is added there at each value the delta sent."""
    for s, e in chunk_ranges(acc.numel(), k.chunk, start, stop):
        mp = k.padded(e - s)
        if senders is None:
            k.accumulate(*k.blocks(codes, scales, s, mp), e - s, acc[s:e], weight, assign)
        else:
            k.accumulate(*k.blocks(codes, scales, s, mp), e - s, acc[s:e], weight, assign, senders=senders[s:e])


def apply_dequantized(base: torch.Tensor, d: torch.Tensor, out: torch.Tensor) -> None:
    """The one rule for applying a sync: ``out = base + d`` (an IEEE add, rounded to ``out``'s dtype)."""
    torch.add(base, d, out=out)


def apply_sync(
    k: Kernels, codes: torch.Tensor, scales: torch.Tensor, base: torch.Tensor, target: torch.Tensor,
    *, start: int = 0, stop: int | None = None, hasher=None,
) -> None:
    """``target = base + dequantized``, then ``base = target``, over flat values ``[start, stop)``; a
    ``hasher`` (:class:`~lightning_nodeox.core.hashing.RowHasher` of ``target``) digests each chunk while it is in cache."""
    for s, e in chunk_ranges(target.numel(), k.chunk, start, stop):
        m = e - s
        mp = k.padded(m)
        d = k.dequantize(*k.blocks(codes, scales, s, mp), mp)
        apply_dequantized(base[s:e], d[:m], target[s:e])
        if base.data_ptr() != target.data_ptr():
            base[s:e].copy_(target[s:e])
        if hasher is not None:
            hasher.values(s, e)


def encode_sync_and_apply(
    k: Kernels, acc: torch.Tensor, inv_weight: float, model: torch.Tensor, codes: torch.Tensor,
    scales: torch.Tensor, *, start: int = 0, stop: int | None = None, hasher=None,
    outer_step: Callable[[torch.Tensor, int, int], None] | None = None, senders: torch.Tensor | None = None,
) -> None:
    """Coordinator: the mean delta (:func:`mean_of`), turned into the sync delta by ``outer_step(x, start, stop)``
    (in place; None: plain averaging), quantized; then ``model += dequantized`` as hosts will (and, with a
    ``hasher`` of ``model``, its digest while the chunk is in cache)."""
    for s, e in chunk_ranges(acc.numel(), k.chunk, start, stop):
        d, _ = _sync_chunk(k, acc, inv_weight, codes, scales, s, e, outer_step, senders)
        apply_dequantized(model[s:e], d, model[s:e])
        if hasher is not None:
            hasher.values(s, e)


def _sync_chunk(k: Kernels, acc: torch.Tensor, inv_weight: float, codes: torch.Tensor, scales: torch.Tensor,
                s: int, e: int, outer_step, senders: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Values ``[s, e)`` of the sync delta (mean, then outer step) quantized into ``codes``/``scales``; returns
    their dequantized values (in ``k.d``) and the chunk's scales."""
    m = e - s
    mp = k.padded(m)
    x = mean_of(acc[s:e], inv_weight, None if senders is None else senders[s:e], k.x[:m])
    if outer_step is not None:
        outer_step(x, s, e)
    d = k.d[:mp]
    chunk_codes, chunk_scales = k.blocks(codes, scales, s, mp)
    k.quantize(m, chunk_codes, chunk_scales, dequant_out=d)
    return d[:m], chunk_scales


def encode_sync(
    k: Kernels, acc: torch.Tensor, inv_weight: float, model: torch.Tensor, codes: torch.Tensor,
    scales: torch.Tensor, *, start: int = 0, stop: int | None = None,
    outer_step: Callable[[torch.Tensor, int, int], None] | None = None, senders: torch.Tensor | None = None,
) -> bool:
    """Coordinator, before anything is applied: quantize the sync delta as :func:`encode_sync_and_apply` does,
    leaving ``model`` untouched; returns whether ``model + dequantized`` stays finite in the model's dtype
    (False at the first chunk that does not). Per chunk, while it is in cache: when ``max|model|`` plus the kernels'
    bound on the dequantized chunk (q4: ``7 * max scale``) is below the dtype's largest value it is finite; only
    otherwise is the sum itself formed and looked at."""
    limit = torch.finfo(model.dtype).max * (1 - 2**-10)  # room for the rounding of the bound itself
    for s, e in chunk_ranges(acc.numel(), k.chunk, start, stop):
        d, chunk_scales = _sync_chunk(k, acc, inv_weight, codes, scales, s, e, outer_step, senders)
        low, high = torch.aminmax(model[s:e])
        peak = k.bound(d, chunk_scales)
        if max(-float(low), float(high)) + peak < limit:
            continue
        m = e - s
        size = m * model.element_size()
        probe = (k.y.view(torch.uint8)[:size].view(model.dtype) if size <= k.y.numel() * 4
                 else torch.empty(m, dtype=model.dtype, device=model.device))  # k.y is free once quantized
        apply_dequantized(model[s:e], d, probe)
        low, high = torch.aminmax(probe)
        if not (math.isfinite(float(low)) and math.isfinite(float(high))):
            return False
    return True


def relative_error(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """``||reference - approx|| / ||reference||`` (0 for an all-zero reference that is matched exactly)."""
    ref = reference.float()
    num = torch.linalg.vector_norm(ref - approx.float()).item()
    den = torch.linalg.vector_norm(ref).item()
    return num / den if den > 0 else (0.0 if num == 0 else math.inf)
