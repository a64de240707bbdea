"""q4: blockwise absmax 4-bit quantization, as chunked torch kernels that allocate nothing per round.

One tensor of ``n`` values at block size ``B`` becomes ``ceil(n / B)`` blocks (the last one zero-padded).
Each block has one scale ``s = absmax / 7`` and ``B`` codes ``c = round(x / s) + 8`` in ``[1, 15]``,
two codes a byte (the even index in the low nibble). Decoding is ``(c - 8) * s``, so zero stays zero.

The kernels work on chunks that stay in cache, on the tensor's own device. On the CPU they never let
ATen split an op over threads (OpenMP barriers collapse when the CPU is oversubscribed); parallelism
comes from :class:`~lightning_nodeox.core.pool.WorkerPool` workers, each with its own :class:`Q4Kernels` scratch.

Bit-identity rule: a dequantized value is computed as ``float(c - 8) * s`` (one IEEE multiply) and applied
as ``base + d`` (one IEEE add), never fused, so hosts and coordinator reach the same bytes on any device.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable

import torch

from .settings import Q4Settings

LEVELS = 7  # codes span -7..7 around the offset
CODE_OFFSET = 8
RESIDUAL_DTYPE = torch.bfloat16  # error-feedback memory: half the bytes of fp32, the range of fp32

# Adding 1.5 * 2**23 to a float in [-2**22, 2**22] rounds it to an integer (half to even) held in the low
# mantissa bits; with the code offset folded in, the low byte of the float's bits is the code itself.
_ROUND_MAGIC = 12582912.0 + CODE_OFFSET
_TINY = 1e-30
ATEN_GRAIN = 32768  # ATen runs an op of at most this many elements on one thread
CPU_CHUNK_SINGLE_THREADED = 131072
CUDA_CHUNK = 1 << 24


class NonFiniteDeltaError(ValueError):
    """A tensor to encode holds NaN or Inf, or exceeds what its scale type can hold."""


def block_count(numel: int, block_size: int) -> int:
    return -(-numel // block_size)


def code_bytes(numel: int, block_size: int) -> int:
    return Q4Settings(block_size=block_size).code_bytes(numel)


def default_chunk(device: torch.device, block_size: int) -> int:
    """Elements per kernel call: cache-sized on the CPU (at most ATen's grain where ATen may thread)."""
    if device.type != "cpu":
        return CUDA_CHUNK
    chunk = CPU_CHUNK_SINGLE_THREADED if torch.get_num_threads() == 1 else ATEN_GRAIN
    return max(chunk, block_size)


def stochastic_seed(seed: int, *parts: int) -> int:
    """A 63-bit generator seed derived from a round seed and a chunk's position, independent of threading."""
    digest = hashlib.blake2b(repr((seed, *parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class Q4Kernels:
    """Scratch buffers and the chunk kernels of one worker on one device."""

    def __init__(self, settings: Q4Settings, device: torch.device | str = "cpu", chunk: int | None = None) -> None:
        self.settings = settings
        self.device = torch.device(device)
        bs = settings.block_size
        chunk = chunk or default_chunk(self.device, bs)
        self.chunk = chunk - chunk % bs
        n, nb, dev = self.chunk, self.chunk // bs, self.device
        self.x = torch.empty(n, device=dev)
        self.y = torch.empty(n, device=dev)
        self.d = torch.empty(n, device=dev)
        self.c8 = torch.empty(n, dtype=torch.uint8, device=dev)
        self.w16 = torch.empty(n // 2, dtype=torch.int16, device=dev)
        self.t16 = torch.empty(n // 2, dtype=torch.int16, device=dev)
        self.amax = torch.empty(nb, device=dev)
        self.scale = torch.empty(nb, device=dev)
        self.inv = torch.empty(nb, device=dev)
        self.magic = torch.tensor(_ROUND_MAGIC, device=dev)
        self.generator = torch.Generator(device=dev) if settings.rounding == "stochastic" else None

    def padded(self, m: int) -> int:
        bs = self.settings.block_size
        return -(-m // bs) * bs

    def blocks(self, codes: torch.Tensor, scales: torch.Tensor, start: int, padded: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The codes and scales of the ``padded`` values from flat value ``start`` (a block boundary)."""
        bs = self.settings.block_size
        return codes[start // 2 : (start + padded) // 2], scales[start // bs : (start + padded) // bs]

    # -- encode ---------------------------------------------------------------------------------------------
    def quantize(
        self,
        m: int,
        codes_out: torch.Tensor,
        scales_out: torch.Tensor,
        *,
        residual_out: torch.Tensor | None = None,
        dequant_out: torch.Tensor | None = None,
        seed: int | None = None,
    ) -> None:
        """Quantize ``self.x[:m]`` (filled by the caller) into ``codes_out`` and ``scales_out``.

        ``residual_out`` (m values) receives ``x - dequantized``; ``dequant_out`` (padded length) the
        dequantized values themselves, computed exactly as a decoder computes them.
        """
        bs = self.settings.block_size
        mp = self.padded(m)
        nb = mp // bs
        x = self.x[:mp]
        if mp != m:
            x[m:].zero_()
        xb, y = x.view(nb, bs), self.y[:mp]
        yb = y.view(nb, bs)
        amax = torch.amax(torch.abs(xb, out=yb), dim=1, out=self.amax[:nb])
        scale = self.scale[:nb]
        if self.settings.scale_dtype == "fp16":
            torch.div(amax, LEVELS, out=scales_out)
            scale.copy_(scales_out)  # the scale a decoder will read
        else:
            torch.div(amax, LEVELS, out=scale)
            scales_out.copy_(scale)
        inv = torch.reciprocal(torch.clamp_min(scale, _TINY, out=self.inv[:nb]), out=self.inv[:nb])
        torch.mul(xb, inv[:, None], out=yb)
        if self.generator is not None and seed is not None:
            noise = self.d[:mp]
            noise.uniform_(-0.5, 0.5, generator=self.generator.manual_seed(seed))
            y.add_(noise)
            y.clamp_(-LEVELS, LEVELS)
        elif self.settings.scale_dtype == "fp16":
            y.clamp_(-LEVELS, LEVELS)  # an fp16 scale may round below absmax / 7
        y.add_(self.magic)
        c8 = self.c8[:mp]
        c8.copy_(y.view(torch.int32))  # int32 -> uint8 keeps the low byte: the code
        y.sub_(self.magic)  # the rounded integers, as floats
        if residual_out is not None:
            if mp == m:
                torch.addcmul(xb, yb, scale[:, None], value=-1, out=residual_out.view(nb, bs))
            else:
                d = self.d[:mp]
                torch.addcmul(xb, yb, scale[:, None], value=-1, out=d.view(nb, bs))
                residual_out.copy_(d[:m])
        if dequant_out is not None:
            torch.mul(yb, scale[:, None], out=dequant_out.view(nb, bs))
        v = c8.view(torch.int16)
        w = self.w16[: mp // 2]
        torch.bitwise_right_shift(v, 4, out=w)
        w.bitwise_or_(v)
        codes_out.copy_(w)  # low byte: even code | odd code << 4

    # -- decode ---------------------------------------------------------------------------------------------
    def integer_codes(self, codes: torch.Tensor, mp: int) -> torch.Tensor:
        """``float(c - 8)`` for ``mp`` values unpacked from ``codes`` (into ``self.y``)."""
        w, t = self.w16[: mp // 2], self.t16[: mp // 2]
        w.copy_(codes)
        torch.bitwise_and(w, 0xF0, out=t)
        t.bitwise_left_shift_(4)
        w.bitwise_and_(0x0F)
        w.bitwise_or_(t)  # bytes: low code, high code
        f = self.y[:mp]
        f.copy_(w.view(torch.uint8))
        f.sub_(CODE_OFFSET)
        return f

    def block_scales(self, scales: torch.Tensor, nb: int) -> torch.Tensor:
        if scales.dtype == torch.float32:
            return scales
        return self.scale[:nb].copy_(scales)

    def dequantize(self, codes: torch.Tensor, scales: torch.Tensor, mp: int) -> torch.Tensor:
        """The dequantized values of one chunk (``mp`` values, in ``self.d``)."""
        bs = self.settings.block_size
        nb = mp // bs
        f = self.integer_codes(codes, mp)
        d = self.d[:mp]
        torch.mul(f.view(nb, bs), self.block_scales(scales, nb)[:, None], out=d.view(nb, bs))
        return d

    def accumulate(self, codes: torch.Tensor, scales: torch.Tensor, m: int, acc: torch.Tensor, weight: float,
                   assign: bool = False) -> None:
        """``acc += weight * dequantized`` (``acc = ...`` when ``assign``) for the first ``m`` values of one chunk."""
        bs = self.settings.block_size
        mp = self.padded(m)
        nb = mp // bs
        if mp != m:
            d = self.dequantize(codes, scales, mp)[:m]
            if assign:
                torch.mul(d, weight, out=acc)
            else:
                acc.add_(d, alpha=weight)
            return
        f = self.integer_codes(codes, mp)
        weighted = torch.mul(self.block_scales(scales, nb), weight, out=self.inv[:nb])
        if assign:
            torch.mul(f.view(nb, bs), weighted[:, None], out=acc.view(nb, bs))
        else:
            acc.view(nb, bs).addcmul_(f.view(nb, bs), weighted[:, None])


class RawKernels(Q4Kernels):
    """The unquantized ablation codecs (bf16, fp32) behind the same interface: a tensor's "codes" are its values
    in the codec's dtype, it has no scales, and a value "dequantizes" to itself (rounded to bf16 where it is)."""

    def __init__(self, settings: Q4Settings, device: torch.device | str = "cpu", chunk: int | None = None) -> None:
        super().__init__(settings, device, chunk)
        self.dtype = torch.bfloat16 if settings.codec == "bf16" else torch.float32
        self.size = settings.value_bytes

    def padded(self, m: int) -> int:
        return m

    def blocks(self, codes: torch.Tensor, scales: torch.Tensor, start: int, padded: int) -> tuple[torch.Tensor, torch.Tensor]:
        return codes[start * self.size : (start + padded) * self.size], scales[:0]

    def quantize(self, m: int, codes_out: torch.Tensor, scales_out: torch.Tensor, *,
                 residual_out: torch.Tensor | None = None, dequant_out: torch.Tensor | None = None,
                 seed: int | None = None) -> None:
        x = self.x[:m]
        values = codes_out.view(self.dtype)
        values.copy_(x)
        if residual_out is not None:
            residual_out.copy_(torch.sub(x, values.float(), out=self.d[:m]))
        if dequant_out is not None:
            dequant_out[:m].copy_(values)

    def dequantize(self, codes: torch.Tensor, scales: torch.Tensor, mp: int) -> torch.Tensor:
        return self.d[:mp].copy_(codes.view(self.dtype))

    def accumulate(self, codes: torch.Tensor, scales: torch.Tensor, m: int, acc: torch.Tensor, weight: float,
                   assign: bool = False) -> None:
        d = self.dequantize(codes, scales, m)
        if assign:
            torch.mul(d, weight, out=acc)
        else:
            acc.add_(d, alpha=weight)


def make_kernels(settings: Q4Settings, device: torch.device | str = "cpu", chunk: int | None = None) -> Q4Kernels:
    """The kernels of ``settings.codec``."""
    return (Q4Kernels if settings.quantized else RawKernels)(settings, device, chunk)


# -- whole tensors: loops over chunks -----------------------------------------------------------------------


def load_delta(k: Q4Kernels, current: torch.Tensor, base: torch.Tensor, residual: torch.Tensor | None, m: int) -> None:
    """``k.x[:m] = current - base (+ residual)``, computed in fp32."""
    x = k.x[:m]
    if current.dtype == torch.float32 and base.dtype == torch.float32:
        torch.sub(current, base, out=x)
    else:
        x.copy_(current)
        x.sub_(base)
    if residual is not None:
        x.add_(residual)


def chunk_ranges(numel: int, chunk: int, start: int = 0, stop: int | None = None):
    stop = numel if stop is None else stop
    for s in range(start, stop, chunk):
        yield s, min(stop, s + chunk)


def encode_delta(
    k: Q4Kernels,
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
    """q4 of ``current - base (+ residual)`` for flat values ``[start, stop)``; the residual is updated in place."""
    for s, e in chunk_ranges(current.numel(), k.chunk, start, stop):
        m = e - s
        load_delta(k, current[s:e], base[s:e], None if residual is None else residual[s:e], m)
        k.quantize(
            m,
            *k.blocks(codes, scales, s, k.padded(m)),
            residual_out=None if residual is None else residual[s:e],
            seed=None if seed is None else stochastic_seed(seed, s),
        )


def encode_tensor(k: Q4Kernels, values: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, *, seed=None) -> None:
    """q4 of a plain flat tensor (reference entry point for tests and benchmarks)."""
    for s, e in chunk_ranges(values.numel(), k.chunk):
        m = e - s
        k.x[:m].copy_(values[s:e])
        k.quantize(m, *k.blocks(codes, scales, s, k.padded(m)),
                   seed=None if seed is None else stochastic_seed(seed, s))


def decode_tensor(k: Q4Kernels, codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
    """``out`` (flat, any float dtype) = dequantized values."""
    for s, e in chunk_ranges(out.numel(), k.chunk):
        mp = k.padded(e - s)
        out[s:e].copy_(k.dequantize(*k.blocks(codes, scales, s, mp), mp)[: e - s])


def accumulate_tensor(
    k: Q4Kernels, codes: torch.Tensor, scales: torch.Tensor, acc: torch.Tensor, weight: float,
    *, start: int = 0, stop: int | None = None, assign: bool = False,
) -> None:
    """``acc += weight * dequantized`` (``acc = ...`` when ``assign``) over flat values ``[start, stop)``."""
    for s, e in chunk_ranges(acc.numel(), k.chunk, start, stop):
        mp = k.padded(e - s)
        k.accumulate(*k.blocks(codes, scales, s, mp), e - s, acc[s:e], weight, assign)


def apply_dequantized(base: torch.Tensor, d: torch.Tensor, out: torch.Tensor) -> None:
    """The one rule for applying a sync: ``out = base + d`` (an IEEE add, rounded to ``out``'s dtype)."""
    torch.add(base, d, out=out)


def apply_sync(
    k: Q4Kernels, codes: torch.Tensor, scales: torch.Tensor, base: torch.Tensor, target: torch.Tensor,
    *, start: int = 0, stop: int | None = None, hasher=None,
) -> None:
    """``target = base + dequantized``, then ``base = target``, over flat values ``[start, stop)``; a
    ``hasher`` (:class:`~lightning_nodeox.hashing.RowHasher` of ``target``) digests each chunk while it is in cache."""
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
    k: Q4Kernels, acc: torch.Tensor, inv_weight: float, model: torch.Tensor, codes: torch.Tensor,
    scales: torch.Tensor, *, start: int = 0, stop: int | None = None, hasher=None,
    outer_step: Callable[[torch.Tensor, int, int], None] | None = None,
) -> None:
    """Coordinator: the mean delta ``acc * inv_weight``, turned into the sync delta by ``outer_step(x, start,
    stop)`` (in place; None: plain averaging), quantized; then ``model += dequantized`` as hosts will (and,
    with a ``hasher`` of ``model``, its digest while the chunk is in cache)."""
    for s, e in chunk_ranges(acc.numel(), k.chunk, start, stop):
        d, _ = _sync_chunk(k, acc, inv_weight, codes, scales, s, e, outer_step)
        apply_dequantized(model[s:e], d, model[s:e])
        if hasher is not None:
            hasher.values(s, e)


def _sync_chunk(k: Q4Kernels, acc: torch.Tensor, inv_weight: float, codes: torch.Tensor, scales: torch.Tensor,
                s: int, e: int, outer_step) -> tuple[torch.Tensor, torch.Tensor]:
    """Values ``[s, e)`` of the sync delta (mean, then outer step) quantized into ``codes``/``scales``; returns
    their dequantized values (in ``k.d``) and the chunk's scales."""
    m = e - s
    mp = k.padded(m)
    x = torch.mul(acc[s:e], inv_weight, out=k.x[:m])
    if outer_step is not None:
        outer_step(x, s, e)
    d = k.d[:mp]
    chunk_codes, chunk_scales = k.blocks(codes, scales, s, mp)
    k.quantize(m, chunk_codes, chunk_scales, dequant_out=d)
    return d[:m], chunk_scales


def encode_sync(
    k: Q4Kernels, acc: torch.Tensor, inv_weight: float, model: torch.Tensor, codes: torch.Tensor,
    scales: torch.Tensor, *, start: int = 0, stop: int | None = None,
    outer_step: Callable[[torch.Tensor, int, int], None] | None = None,
) -> bool:
    """Coordinator, before anything is applied: quantize the sync delta as :func:`encode_sync_and_apply` does,
    leaving ``model`` untouched; returns whether ``model + dequantized`` stays finite in the model's dtype
    (False at the first chunk that does not). Per chunk, while it is in cache: when ``max|model| + 7 * max
    scale`` is below the dtype's largest value it is finite; only otherwise is the sum itself formed and looked at."""
    limit = torch.finfo(model.dtype).max * (1 - 2**-10)  # room for the rounding of the bound itself
    for s, e in chunk_ranges(acc.numel(), k.chunk, start, stop):
        d, chunk_scales = _sync_chunk(k, acc, inv_weight, codes, scales, s, e, outer_step)
        low, high = torch.aminmax(model[s:e])
        peak = LEVELS * float(chunk_scales.abs().max()) if chunk_scales.numel() else float(d.abs().max())
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
