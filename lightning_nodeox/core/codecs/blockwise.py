"""What the blockwise codecs share (q4, q2, int8, fp8): packed codes of :attr:`Blockwise.bits` bits each, one fp16
or fp32 scale per block of ``block_size`` values; a zero-padded last block. A value decodes to ``u * s``: its code
as the float its codec gives it (``u``: q4's ``c - 8``, q2's ``2c - 3``, int8's ``c``, fp8's e4m3 value) times its
block's scale (one IEEE multiply)."""

from __future__ import annotations

from abc import abstractmethod

import torch

from .base import Codec, Kernels


# Adding 1.5 * 2**23 to a float in [-2**22, 2**22] rounds it to an integer (half to even) held in the low
# mantissa bits: the low byte of the float's bits is that integer plus any offset folded into the constant.
ROUND_MAGIC = 12582912.0


def round_to_integers(y: torch.Tensor, magic: torch.Tensor, codes: torch.Tensor) -> None:
    """``y`` rounded to integers (half to even) in place, and the low byte of each (the integer plus the offset in
    ``magic``, modulo 256) into ``codes`` (uint8, one a value)."""
    y.add_(magic)
    codes.copy_(y.view(torch.int32))  # int32 -> uint8 keeps the low byte: the code
    y.sub_(magic)


def block_count(numel: int, block_size: int) -> int:
    return -(-numel // block_size)


def packed_bytes(numel: int, block_size: int, bits: int) -> int:
    """Bytes of the codes of ``numel`` values at ``bits`` a code, over whole blocks."""
    return block_count(numel, block_size) * block_size * bits // 8


class Blockwise(Codec):
    """A codec of packed ``bits``-bit codes and one scale per block; its no-op sync is ``noop_code`` in every byte
    with scale -0.0 (every value decodes to -0.0)."""

    bits: int
    noop_code: int

    @property
    def alignment(self) -> int:
        return self.settings.block_size

    def scale_count(self, numel: int) -> int:
        return block_count(numel, self.settings.block_size)

    def code_bytes(self, numel: int) -> int:
        return packed_bytes(numel, self.settings.block_size, self.bits)

    def fill_noop(self, codes: torch.Tensor, scales: torch.Tensor) -> None:
        codes.fill_(self.noop_code)
        scales.fill_(-0.0)

    def magnitude(self, codes: torch.Tensor, scales: torch.Tensor) -> float:
        return float(scales.abs().max()) if scales.numel() else 0.0

    def too_large(self, name: str, round_: int) -> str | None:
        if self.settings.scale_dtype != "fp16":
            return None
        return (f"the delta of parameter {name!r} in round {round_} is too large for fp16 scales; "
                "start the coordinator with --scale-dtype fp32, or lower the learning rate")


class BlockwiseKernels(Kernels):
    """The chunk layout every blockwise codec's kernels share (whole blocks, ``8 // bits`` codes a byte), their
    per-block scratch (``scale``, ``inv``) and their decoding, ``unscaled(codes) * s`` block by block."""

    codec: Blockwise

    def __init__(self, codec: Blockwise, device: torch.device | str = "cpu", chunk: int | None = None) -> None:
        super().__init__(codec, device, chunk)
        nb = self.chunk // codec.settings.block_size
        self.scale = torch.empty(nb, device=self.device)
        self.inv = torch.empty(nb, device=self.device)

    def padded(self, m: int) -> int:
        bs = self.settings.block_size
        return -(-m // bs) * bs

    def blocks(self, codes: torch.Tensor, scales: torch.Tensor, start: int, padded: int) -> tuple[torch.Tensor, torch.Tensor]:
        bs, per_byte = self.settings.block_size, 8 // self.codec.bits
        return codes[start // per_byte : (start + padded) // per_byte], scales[start // bs : (start + padded) // bs]

    # -- encode helpers -------------------------------------------------------------------------------------
    def input_blocks(self, m: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``self.x[:m]`` zero-padded to whole blocks, and the same span of ``self.y``, as (blocks, block_size)."""
        mp = self.padded(m)
        x = self.x[:mp]
        if mp != m:
            x[m:].zero_()
        shape = (mp // self.settings.block_size, self.settings.block_size)
        return x.view(shape), self.y[:mp].view(shape)

    def publish(self, scale: torch.Tensor, scales_out: torch.Tensor) -> None:
        """Write the scales; ``scale`` becomes what a decoder will read (rounded to fp16 where they are)."""
        scales_out.copy_(scale)
        if self.settings.scale_dtype == "fp16":
            scale.copy_(scales_out)

    def outputs(self, xb: torch.Tensor, yb: torch.Tensor, scale: torch.Tensor, m: int,
                residual_out: torch.Tensor | None, dequant_out: torch.Tensor | None) -> None:
        """From a quantized chunk (``yb`` its unscaled values): ``residual_out`` (m values) receives ``x - yb * s``,
        ``dequant_out`` (padded length) ``yb * s``, exactly as a decoder computes it."""
        nb, bs = xb.shape
        if residual_out is not None:
            if nb * bs == m:
                torch.addcmul(xb, yb, scale[:, None], value=-1, out=residual_out.view(nb, bs))
            else:
                d = self.d[: nb * bs]
                torch.addcmul(xb, yb, scale[:, None], value=-1, out=d.view(nb, bs))
                residual_out.copy_(d[:m])
        if dequant_out is not None:
            torch.mul(yb, scale[:, None], out=dequant_out.view(nb, bs))

    # -- decode ---------------------------------------------------------------------------------------------
    @abstractmethod
    def unscaled(self, codes: torch.Tensor, mp: int) -> torch.Tensor:
        """Each of ``mp`` values' code as the float its scale multiplies (into ``self.y``)."""

    def block_scales(self, scales: torch.Tensor, nb: int) -> torch.Tensor:
        """The scales of ``nb`` blocks as fp32."""
        if scales.dtype == torch.float32:
            return scales
        return self.scale[:nb].copy_(scales)

    def dequantize(self, codes: torch.Tensor, scales: torch.Tensor, mp: int) -> torch.Tensor:
        """The dequantized values of one chunk (``mp`` values, in ``self.d``)."""
        bs = self.settings.block_size
        nb = mp // bs
        f = self.unscaled(codes, mp)
        d = self.d[:mp]
        torch.mul(f.view(nb, bs), self.block_scales(scales, nb)[:, None], out=d.view(nb, bs))
        return d

    def accumulate(self, codes: torch.Tensor, scales: torch.Tensor, m: int, acc: torch.Tensor, weight: float,
                   assign: bool = False) -> None:
        """``acc += weight * dequantized`` (``acc = ...`` when ``assign``) for the first ``m`` values of one chunk
        (the weight folded into the scales where the chunk is whole blocks)."""
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
        f = self.unscaled(codes, mp)
        weighted = torch.mul(self.block_scales(scales, nb), weight, out=self.inv[:nb])
        if assign:
            torch.mul(f.view(nb, bs), weighted[:, None], out=acc.view(nb, bs))
        else:
            acc.view(nb, bs).addcmul_(f.view(nb, bs), weighted[:, None])
