"""q4: blockwise absmax 4-bit quantization, as chunked torch kernels that allocate nothing per round.

One tensor of ``n`` values at block size ``B`` becomes ``ceil(n / B)`` blocks (the last one zero-padded).
Each block has one scale ``s = absmax / 7`` and ``B`` codes ``c = round(x / s) + 8`` in ``[1, 15]``,
two codes a byte (the even index in the low nibble). Decoding is ``(c - 8) * s``, so zero stays zero; the
no-op sync is code 8 with scale -0.0 (``0.0 * -0.0 = -0.0``). An fp16 scale is rounded to nearest and the values
clipped to ``[-7, 7]`` (unlike the other absmax codecs of :mod:`.absmax`, which round the scale up).

On the CPU the kernels never let ATen split an op over threads (OpenMP barriers collapse when the CPU is
oversubscribed); parallelism comes from :class:`~lightning_nodeox.core.pool.WorkerPool` workers, each with
its own :class:`Q4Kernels` scratch.
"""

from __future__ import annotations

import torch

from .absmax import AbsmaxKernels
from .blockwise import ROUND_MAGIC, Blockwise, BlockwiseKernels, packed_bytes, round_to_integers

LEVELS = 7  # codes span -7..7 around the offset
CODE_OFFSET = 8
NOOP_CODE = CODE_OFFSET | CODE_OFFSET << 4  # two zero codes a byte


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


class Q4Kernels(AbsmaxKernels):
    """Scratch buffers and the chunk kernels of one worker on one device."""

    top = LEVELS

    def __init__(self, codec: Q4, device: torch.device | str = "cpu", chunk: int | None = None) -> None:
        super().__init__(codec, device, chunk)
        n, dev = self.chunk, self.device
        self.c8 = torch.empty(n, dtype=torch.uint8, device=dev)
        self.w16 = torch.empty(n // 2, dtype=torch.int16, device=dev)
        self.t16 = torch.empty(n // 2, dtype=torch.int16, device=dev)
        self.magic = torch.tensor(ROUND_MAGIC + CODE_OFFSET, device=dev)

    publish = BlockwiseKernels.publish  # an fp16 scale rounded to nearest (q4's bytes as they always were)

    def round(self, y: torch.Tensor, codes_out: torch.Tensor) -> None:
        """Codes ``round(y) + 8``, two a byte (low byte: even code | odd code << 4)."""
        if self.settings.scale_dtype == "fp16":
            y.clamp_(-LEVELS, LEVELS)  # an fp16 scale may round below absmax / 7
        mp = y.numel()
        c8 = self.c8[:mp]
        round_to_integers(y, self.magic, c8)
        v = c8.view(torch.int16)
        w = self.w16[: mp // 2]
        torch.bitwise_right_shift(v, 4, out=w)
        w.bitwise_or_(v)
        codes_out.copy_(w)  # low byte: even code | odd code << 4

    def unscaled(self, codes: torch.Tensor, mp: int) -> torch.Tensor:
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
