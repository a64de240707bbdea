"""q4: blockwise absmax 4-bit quantization, as chunked torch kernels that allocate nothing per round.

One tensor of ``n`` values at block size ``B`` becomes ``ceil(n / B)`` blocks (the last one zero-padded).
Each block has one scale ``s = absmax / 7`` and ``B`` codes ``c = round(x / s) + 8`` in ``[1, 15]``,
two codes a byte (the even index in the low nibble). Decoding is ``(c - 8) * s``, so zero stays zero; the
no-op sync is code 8 with scale -0.0 (``0.0 * -0.0 = -0.0``).

On the CPU the kernels never let ATen split an op over threads (OpenMP barriers collapse when the CPU is
oversubscribed); parallelism comes from :class:`~lightning_nodeox.core.pool.WorkerPool` workers, each with
its own :class:`Q4Kernels` scratch.
"""

from __future__ import annotations

import torch

from .blockwise import Blockwise, BlockwiseKernels, packed_bytes

LEVELS = 7  # codes span -7..7 around the offset
CODE_OFFSET = 8
NOOP_CODE = CODE_OFFSET | CODE_OFFSET << 4  # two zero codes a byte

# Adding 1.5 * 2**23 to a float in [-2**22, 2**22] rounds it to an integer (half to even) held in the low
# mantissa bits; with the code offset folded in, the low byte of the float's bits is the code itself.
_ROUND_MAGIC = 12582912.0 + CODE_OFFSET
_TINY = 1e-30


def code_bytes(numel: int, block_size: int) -> int:
    """Bytes of the codes of ``numel`` values: two a byte over whole blocks."""
    return packed_bytes(numel, block_size, 4)


class Q4(Blockwise):
    """The q4 codec: packed 4-bit codes and one fp16 or fp32 scale per block."""

    name = "q4"
    bits = 4
    noop_code = NOOP_CODE

    def kernels(self, device: torch.device | str = "cpu", chunk: int | None = None) -> Q4Kernels:
        return Q4Kernels(self, device, chunk)


class Q4Kernels(BlockwiseKernels):
    """Scratch buffers and the chunk kernels of one worker on one device."""

    def __init__(self, codec: Q4, device: torch.device | str = "cpu", chunk: int | None = None) -> None:
        super().__init__(codec, device, chunk)
        n, nb, dev = self.chunk, self.chunk // codec.settings.block_size, self.device
        self.c8 = torch.empty(n, dtype=torch.uint8, device=dev)
        self.w16 = torch.empty(n // 2, dtype=torch.int16, device=dev)
        self.t16 = torch.empty(n // 2, dtype=torch.int16, device=dev)
        self.amax = torch.empty(nb, device=dev)
        self.scale = torch.empty(nb, device=dev)
        self.inv = torch.empty(nb, device=dev)
        self.magic = torch.tensor(_ROUND_MAGIC, device=dev)

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
        if seed is not None:
            noise = self.d[:mp]
            noise.uniform_(-0.5, 0.5, generator=self.generator().manual_seed(seed))
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

    def bound(self, dequantized: torch.Tensor, scales: torch.Tensor) -> float:
        return LEVELS * float(scales.abs().max())
