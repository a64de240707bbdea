"""What the absmax codecs share (q4, int8, fp8): each block's scale is ``s = absmax / top`` and each value is sent
as ``x / s`` rounded onto the codec's grid of unscaled values inside ``[-top, top]`` (q4 and int8: the integers;
fp8: the e4m3 values), decoding to ``u * s``. Rounding is to nearest, or, where a codec has it, stochastic: uniform
noise of one unit added first, drawn from a seed per chunk, then clipped to ``[-top, top]``.

Where scales are fp16 the scale sent is ``absmax / top`` rounded *up* to fp16 (q4's, rounded to nearest, is the
exception: it clips instead), so that ``|x| / s <= top`` for every value of the block and nothing is clipped: a
value's error is its rounding onto the grid alone.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import ClassVar

import torch

from .blockwise import Blockwise, BlockwiseKernels

_TINY = 1e-30


class AbsmaxKernels(BlockwiseKernels):
    """The quantizer every absmax codec's kernels share; a codec says its :attr:`top` and how a scaled value is
    rounded onto its grid and written as codes (:meth:`round`)."""

    top: ClassVar[float]  # the largest unscaled value: absmax / s

    def __init__(self, codec: Blockwise, device: torch.device | str = "cpu", chunk: int | None = None) -> None:
        super().__init__(codec, device, chunk)
        nb = self.chunk // codec.settings.block_size
        self.amax = torch.empty(nb, device=self.device)
        self.below = torch.empty(nb, dtype=torch.bool, device=self.device)

    def quantize(self, m: int, codes_out: torch.Tensor, scales_out: torch.Tensor, *,
                 residual_out: torch.Tensor | None = None, dequant_out: torch.Tensor | None = None,
                 seed: int | None = None) -> None:
        xb, yb = self.input_blocks(m)
        nb, bs = xb.shape
        mp, y = nb * bs, self.y[: nb * bs]
        amax = torch.amax(torch.abs(xb, out=yb), dim=1, out=self.amax[:nb])
        scale = torch.div(amax, self.top, out=self.scale[:nb])
        self.publish(scale, scales_out)
        inv = torch.reciprocal(torch.clamp_min(scale, _TINY, out=self.inv[:nb]), out=self.inv[:nb])
        torch.mul(xb, inv[:, None], out=yb)
        if seed is not None:
            noise = self.d[:mp]
            noise.uniform_(-0.5, 0.5, generator=self.generator().manual_seed(seed))
            y.add_(noise)
            y.clamp_(-self.top, self.top)
        self.round(y, codes_out)
        self.outputs(xb, yb, scale, m, residual_out, dequant_out)

    def publish(self, scale: torch.Tensor, scales_out: torch.Tensor) -> None:
        """Write the scales, rounded up to fp16 where they are (the next fp16 up of a nonnegative scale is its bits
        plus one); ``scale`` becomes what a decoder will read."""
        scales_out.copy_(scale)
        if self.settings.scale_dtype == "fp16":
            nb = scale.numel()
            sent = self.amax[:nb].copy_(scales_out)  # amax is free once the scale is formed
            below = torch.lt(sent, scale, out=self.below[:nb])
            scales_out.view(torch.int16).add_(below)
            scale.copy_(scales_out)

    @abstractmethod
    def round(self, y: torch.Tensor, codes_out: torch.Tensor) -> None:
        """``y`` (scaled values inside ``[-top, top]``, up to the rounding of ``1 / s``) rounded onto the grid in
        place, and written as codes into ``codes_out``."""

    def bound(self, dequantized: torch.Tensor, scales: torch.Tensor) -> float:
        return self.top * float(scales.abs().max())
