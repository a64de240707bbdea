"""int8: blockwise absmax 8-bit quantization (symmetric, one signed byte a value), as chunked torch kernels that
allocate nothing per round (the quantizer of :mod:`.absmax`, shared with q4).

One tensor of ``n`` values at block size ``B`` becomes ``ceil(n / B)`` blocks (the last one zero-padded). Each
block has one scale ``s = absmax / 127`` (fp32, or rounded *up* to fp16) and ``B`` codes ``c = round(x / s)`` in
``[-127, 127]``, one two's-complement byte each; decoding is ``c * s`` (one IEEE multiply), so zero stays zero.
At block size 64 a value costs ``(64 + 2) / 64 = 1.03`` bytes with fp16 scales (q4: 0.53; bf16: 2).

The error bound of the round trip, ``s`` the scale as sent (at least ``absmax / 127``: nothing is clipped), up to
the fp32 rounding of ``x * (1 / s)`` (a relative ``2**-22`` of ``x``):

- nearest rounding: ``|x - d| <= s / 2`` for every value;
- stochastic rounding: ``|x - d| <= s``, unbiased.

The no-op sync is code 0 (byte ``0x00``) with scale -0.0 (``0.0 * -0.0 = -0.0``). A received code -128 (byte
``0x80``), which no encoder writes, is refused as malformed.
"""

from __future__ import annotations

import torch

from .absmax import AbsmaxKernels
from .blockwise import ROUND_MAGIC, Blockwise, round_to_integers

LEVELS = 127  # codes span -127..127
NOOP_CODE = 0  # code 0: +0.0 * -0.0
FORBIDDEN_CODE = 0x80  # -128: outside the symmetric range


class Int8(Blockwise):
    """The int8 codec: one signed byte a value and one fp16 or fp32 scale per block."""

    name = "int8"
    bits = 8
    noop_code = NOOP_CODE

    def kernels(self, device: torch.device | str = "cpu", chunk: int | None = None) -> Int8Kernels:
        return Int8Kernels(self, device, chunk)

    def malformed(self, codes: torch.Tensor, scales: torch.Tensor, numel: int) -> str | None:
        if bool(torch.eq(codes, FORBIDDEN_CODE).any()):
            return "code -128 (byte 0x80; int8 codes span -127..127)"
        return None


class Int8Kernels(AbsmaxKernels):
    """Scratch buffers and the chunk kernels of one worker on one device."""

    top = LEVELS

    def __init__(self, codec: Int8, device: torch.device | str = "cpu", chunk: int | None = None) -> None:
        super().__init__(codec, device, chunk)
        self.magic = torch.tensor(ROUND_MAGIC, device=self.device)

    def round(self, y: torch.Tensor, codes_out: torch.Tensor) -> None:
        """Codes ``round(y)``, the low byte of each integer: its two's complement."""
        round_to_integers(y, self.magic, codes_out)

    def unscaled(self, codes: torch.Tensor, mp: int) -> torch.Tensor:
        """``float(c)`` for ``mp`` codes (into ``self.y``)."""
        return self.y[:mp].copy_(codes.view(torch.int8))
