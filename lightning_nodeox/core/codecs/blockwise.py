"""What the blockwise codecs share (q4, q2): packed codes of :attr:`Blockwise.bits` bits each, one fp16 or fp32
scale per block of ``block_size`` values; a zero-padded last block."""

from __future__ import annotations

import torch

from .base import Codec, Kernels


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
    """The chunk layout every blockwise codec's kernels share: whole blocks, ``8 // bits`` codes a byte."""

    codec: Blockwise

    def padded(self, m: int) -> int:
        bs = self.settings.block_size
        return -(-m // bs) * bs

    def blocks(self, codes: torch.Tensor, scales: torch.Tensor, start: int, padded: int) -> tuple[torch.Tensor, torch.Tensor]:
        bs, per_byte = self.settings.block_size, 8 // self.codec.bits
        return codes[start // per_byte : (start + padded) // per_byte], scales[start // bs : (start + padded) // bs]
