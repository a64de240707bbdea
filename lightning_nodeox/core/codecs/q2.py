"""q2: blockwise 2-bit quantization with a mean-magnitude scale, as chunked torch kernels that allocate nothing
per round.

One tensor of ``n`` values at block size ``B`` becomes ``ceil(n / B)`` blocks (the last one zero-padded). Each
block has ``B`` codes ``c`` in ``[0, 3]``, four a byte (value ``4j + k`` in bits ``2k, 2k+1`` of byte ``j``),
and one scale ``s``; decoding is ``(2c - 3) * s``: the four levels ``-3s, -s, s, 3s``, evenly spaced and
symmetric around zero. The codes are those of ``s0 = 0.7 * mean|x|`` (the mean over the block's own values, not
its padding): for Gaussian values close to the uniform 4-level quantizer of least squared error, where absmax
scaling, which one outlier stretches, loses half the signal at two bits. With nearest rounding the scale sent is
then the least-squares one for those codes, ``s = sum(x * l) / sum(l * l)`` with ``l = 2c - 3`` (a block of
equal values comes back exact, not shrunk to ``0.7 x``); stochastic rounding sends ``s0`` itself, so that it stays
unbiased. There is no zero level: a zero decodes to ``s`` or ``-s`` (error feedback carries it); a block of
zeros has scale 0 and stays zero.

The error bound of the round trip (up to the rounding of the scale to fp16):

- nearest rounding: a block's ``||x - d||`` is at most ``||x - d0||``, where ``d0 = l * s0`` and every value of
  ``d0`` keeps ``|x - d0| <= max(s0, |x| - 3 s0)`` (at most ``s0`` inside ``[-4 s0, 4 s0]``; beyond, the value
  is clipped to ``±3 s0``);
- stochastic rounding: every value keeps ``|x - d| <= max(2s, |x| - 3s)``, unbiased inside ``[-3s, 3s]``.

On Gaussian values at block size 64 the relative error ``||x - d|| / ||x||`` is about 0.35 (q4: 0.11), at 18
bytes per 64 values against q4's 34 (fp16 scales; at block size 128, 34 bytes per 128 values: half of q4's).

The no-op sync is code 2 (``+s``) with scale -0.0 (``1.0 * -0.0 = -0.0``), byte ``0xAA``. Like q4's, the CPU
kernels never let ATen split an op over threads; parallelism comes from the worker pool, each worker with its
own :class:`Q2Kernels` scratch.
"""

from __future__ import annotations

import torch

from .blockwise import ROUND_MAGIC, Blockwise, BlockwiseKernels, packed_bytes, round_to_integers

SCALE = 0.7  # s / mean|x|
TOP = 3  # codes span 0..3
HALF = 1.5  # x / (2s) + 1.5 rounds to the code
NOOP_CODE = 0b10101010  # four codes 2 (+s) a byte

_TINY = 1e-30


def code_bytes(numel: int, block_size: int) -> int:
    """Bytes of the codes of ``numel`` values: four a byte over whole blocks."""
    return packed_bytes(numel, block_size, 2)


class Q2(Blockwise):
    """The q2 codec: packed 2-bit codes and one fp16 or fp32 scale per block."""

    name = "q2"
    bits = 2
    noop_code = NOOP_CODE

    def kernels(self, device: torch.device | str = "cpu", chunk: int | None = None) -> Q2Kernels:
        return Q2Kernels(self, device, chunk)


class Q2Kernels(BlockwiseKernels):
    """Scratch buffers and the chunk kernels of one worker on one device."""

    def __init__(self, codec: Q2, device: torch.device | str = "cpu", chunk: int | None = None) -> None:
        super().__init__(codec, device, chunk)
        n, nb, dev = self.chunk, self.chunk // codec.settings.block_size, self.device
        self.c8 = torch.empty(n, dtype=torch.uint8, device=dev)
        self.w32 = torch.empty(n // 4, dtype=torch.int32, device=dev)
        self.t32 = torch.empty(n // 4, dtype=torch.int32, device=dev)
        self.total = torch.empty(nb, device=dev)
        self.magic = torch.tensor(ROUND_MAGIC, device=dev)

    # -- encode ---------------------------------------------------------------------------------------------
    def quantize(self, m: int, codes_out: torch.Tensor, scales_out: torch.Tensor, *,
                 residual_out: torch.Tensor | None = None, dequant_out: torch.Tensor | None = None,
                 seed: int | None = None) -> None:
        xb, yb = self.input_blocks(m)
        nb, bs = xb.shape
        scale = self._mean_scale(xb, yb, m)
        stochastic = seed is not None
        if stochastic:
            self.publish(scale, scales_out)
        self._code(xb, yb, scale, seed if stochastic else None)
        if not stochastic:
            self._fit_scale(xb, yb, m, scale)
            self.publish(scale, scales_out)
        self.outputs(xb, yb, scale, m, residual_out, dequant_out)
        self._pack(nb * bs, codes_out)

    def _mean_scale(self, xb: torch.Tensor, yb: torch.Tensor, m: int) -> torch.Tensor:
        """Each block's scale (in ``self.scale``) from the mean magnitude of its values (of the last block's own
        values, where padding fills it); ``yb`` is overwritten."""
        nb, bs = xb.shape
        total = torch.sum(torch.abs(xb, out=yb), dim=1, out=self.total[:nb])
        scale = self.scale[:nb]
        torch.mul(total, SCALE / bs, out=scale)
        if nb * bs != m:
            torch.mul(total[-1:], SCALE / (m - (nb - 1) * bs), out=scale[-1:])
        return scale

    def _code(self, xb: torch.Tensor, yb: torch.Tensor, scale: torch.Tensor, seed: int | None) -> None:
        """Each value's code c into ``self.c8`` (rounded to nearest, or stochastically with noise drawn from
        ``seed``) and its level l = 2c - 3, as a float, into ``yb``."""
        nb, bs = xb.shape
        y = self.y[: nb * bs]
        inv = torch.reciprocal(torch.clamp_min(scale, _TINY, out=self.inv[:nb]), out=self.inv[:nb]).mul_(0.5)
        torch.mul(xb, inv[:, None], out=yb)
        y.add_(HALF)
        if seed is not None:
            noise = self.d[: nb * bs]
            noise.uniform_(-0.5, 0.5, generator=self.generator().manual_seed(seed))
            y.add_(noise)
        y.clamp_(0, TOP)
        round_to_integers(y, self.magic, self.c8[: nb * bs])
        y.mul_(2).sub_(TOP)  # the levels l = 2c - 3, as floats

    def _fit_scale(self, xb: torch.Tensor, yb: torch.Tensor, m: int, scale: torch.Tensor) -> None:
        """Each block's scale replaced by the least-squares scale of its codes: sum(x * l) / sum(l * l)."""
        nb, bs = xb.shape
        product = self.d[: nb * bs].view(nb, bs)
        num = torch.sum(torch.mul(xb, yb, out=product), dim=1, out=self.total[:nb])
        den = torch.sum(torch.mul(yb, yb, out=product), dim=1, out=self.inv[:nb])
        if nb * bs != m:
            den[-1:].sub_(nb * bs - m)  # a padding zero has code 2: l * l = 1
        torch.div(num, den, out=scale)

    def _pack(self, mp: int, codes_out: torch.Tensor) -> None:
        """The codes of ``self.c8[:mp]`` four to a byte into ``codes_out``."""
        v = self.c8[:mp].view(torch.int32)  # bytes c0 c1 c2 c3 (little-endian)
        w, t = self.w32[: mp // 4], self.t32[: mp // 4]
        torch.bitwise_right_shift(v, 6, out=w)
        w.bitwise_or_(v)  # low byte: c0 | c1 << 2; third byte: c2 | c3 << 2
        torch.bitwise_right_shift(w, 12, out=t)
        w.bitwise_or_(t)
        codes_out.copy_(w)  # low byte: c0 | c1 << 2 | c2 << 4 | c3 << 6

    # -- decode ---------------------------------------------------------------------------------------------
    def unscaled(self, codes: torch.Tensor, mp: int) -> torch.Tensor:
        """``float(2c - 3)`` for ``mp`` values unpacked from ``codes`` (into ``self.y``)."""
        w, t = self.w32[: mp // 4], self.t32[: mp // 4]
        w.copy_(codes)
        torch.bitwise_left_shift(w, 12, out=t)
        w.bitwise_or_(t)
        w.bitwise_and_(0x000F000F)  # c0 c1 in bits 0-3, c2 c3 in bits 16-19
        torch.bitwise_left_shift(w, 6, out=t)
        w.bitwise_or_(t)
        w.bitwise_and_(0x03030303)  # one code a byte
        f = self.y[:mp]
        f.copy_(w.view(torch.uint8))
        return f.mul_(2).sub_(TOP)

    def bound(self, dequantized: torch.Tensor, scales: torch.Tensor) -> float:
        return TOP * float(scales.abs().max())
