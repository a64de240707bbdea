"""fp8: each value an e4m3 float (``torch.float8_e4m3fn``: 4 exponent bits, 3 mantissa bits, no infinities) times
one scale per block, as chunked torch kernels that allocate nothing per round (the quantizer of :mod:`.absmax`).

One tensor of ``n`` values at block size ``B`` becomes ``ceil(n / B)`` blocks (the last one zero-padded). Each
block has one scale ``s = absmax / 448`` (fp32, or rounded *up* to fp16), so that the block's largest value maps
to e4m3's largest, 448; each value is sent as the e4m3 byte of ``x / s`` rounded to nearest (ties to even,
e4m3's subnormals included) and decodes to ``float(e) * s``: the widening is exact and the multiply one IEEE
multiply. At block size 64 a value costs ``(64 + 2) / 64 = 1.03`` bytes with fp16 scales, as int8's.

The error bound of the round trip, ``s`` the scale as sent (nothing is clipped), up to the fp32 rounding of
``x * (1 / s)`` (a relative ``2**-22`` of ``x``): three mantissa bits keep ``|x - d| <= 2**-4 * |x|`` for a value
whose ``|x| / s`` is an e4m3 normal (at least ``2**-6``); below, e4m3's subnormals are ``2**-9`` apart, so the
floor is ``|x - d| <= 2**-10 * s``. In all: ``|x - d| <= max(2**-4 * |x|, 2**-10 * s)``.

NaN and infinities: a block holding one has a NaN or Inf scale, which every codec's check refuses (a host's
non-finite delta, a coordinator's overflowing sync). A finite block never yields a NaN byte: ``|x| / s`` stays
within ``448 * (1 + 2**-22)``, below 464 (the midpoint between 448 and the NaN pattern above it, where a cast
that does not saturate would round to NaN), so casts that saturate and casts that do not write the same bytes.
A received NaN byte (``0x7f``, ``0xff``) is refused as malformed.

Hosts end bit-identical because they decode the coordinator's bytes, and decoding rounds nothing but the one
multiply. Rounding is to nearest only (``rounding="stochastic"`` is refused). The no-op sync is byte ``0x00``
(+0.0) with scale -0.0.
"""

from __future__ import annotations

import torch

from .absmax import AbsmaxKernels
from .blockwise import Blockwise

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0  # 1.75 * 2**8
NAN_BITS = 0x7F  # e4m3fn's NaN, with either sign bit
NOOP_CODE = 0  # +0.0


class FP8(Blockwise):
    """The fp8 codec: one e4m3 byte a value and one fp16 or fp32 scale per block."""

    name = "fp8"
    bits = 8
    noop_code = NOOP_CODE
    stochastic_rounding = False

    def kernels(self, device: torch.device | str = "cpu", chunk: int | None = None) -> FP8Kernels:
        return FP8Kernels(self, device, chunk)

    def malformed(self, codes: torch.Tensor, scales: torch.Tensor, numel: int) -> str | None:
        if bool(torch.eq(torch.bitwise_and(codes, NAN_BITS), NAN_BITS).any()):
            return "NaN codes (e4m3 bytes 0x7f or 0xff)"
        return None


class FP8Kernels(AbsmaxKernels):
    """Scratch buffers and the chunk kernels of one worker on one device. The bytes widen through a table of the
    256 e4m3 values (a lookup is several times faster than torch's widening cast on the CPU, and as exact)."""

    top = E4M3_MAX

    def __init__(self, codec: FP8, device: torch.device | str = "cpu", chunk: int | None = None) -> None:
        super().__init__(codec, device, chunk)
        self.values = torch.arange(256, dtype=torch.uint8, device=self.device).view(E4M3).float()
        self.index = torch.empty(self.chunk, dtype=torch.int32, device=self.device)

    def round(self, y: torch.Tensor, codes_out: torch.Tensor) -> None:
        """The e4m3 bytes of ``y`` (rounded to nearest, ties to even), and ``y`` set to their values."""
        codes_out.view(E4M3).copy_(y)
        self.widen(codes_out, y)

    def unscaled(self, codes: torch.Tensor, mp: int) -> torch.Tensor:
        """The e4m3 values of ``mp`` codes as fp32 (into ``self.y``)."""
        return self.widen(codes, self.y[:mp])

    def widen(self, codes: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out`` = the e4m3 value of each byte of ``codes``, exactly, as fp32."""
        index = self.index[: codes.numel()]
        index.copy_(codes)
        return torch.index_select(self.values, 0, index, out=out)
