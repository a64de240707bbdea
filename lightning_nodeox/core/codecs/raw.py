"""The unquantized ablation codecs (bf16, fp32): a tensor's codes are its values in the codec's dtype, it has no
scales, and a value "dequantizes" to itself (rounded to bf16 where it is). The no-op sync is -0.0 in every value
(bytes ``00 80`` in bf16, ``00 00 00 80`` in fp32, little-endian)."""

from __future__ import annotations

from typing import ClassVar

import torch

from .base import Codec, Kernels


class Raw(Codec):
    """Values sent as they are, in :attr:`dtype`."""

    dtype: ClassVar[torch.dtype]

    @property
    def scale_dtype(self) -> torch.dtype:
        """fp16: it has no scales (its headers' empty scale entries say F16)."""
        return torch.float16

    def scale_count(self, numel: int) -> int:
        return 0

    def code_bytes(self, numel: int) -> int:
        return numel * self.dtype.itemsize

    def kernels(self, device: torch.device | str = "cpu", chunk: int | None = None) -> RawKernels:
        return RawKernels(self, device, chunk)

    def fill_noop(self, codes: torch.Tensor, scales: torch.Tensor) -> None:
        codes.view(self.dtype).fill_(-0.0)

    def magnitude(self, codes: torch.Tensor, scales: torch.Tensor) -> float:
        values = codes.view(self.dtype)
        return float(values.abs().max()) if values.numel() else 0.0


class BF16(Raw):
    name = "bf16"
    dtype = torch.bfloat16


class FP32(Raw):
    name = "fp32"
    dtype = torch.float32


class RawKernels(Kernels):
    """The chunk kernels of a :class:`Raw` codec (only the loops' common scratch)."""

    def __init__(self, codec: Raw, device: torch.device | str = "cpu", chunk: int | None = None) -> None:
        super().__init__(codec, device, chunk)
        self.dtype = codec.dtype
        self.size = codec.dtype.itemsize

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

    def bound(self, dequantized: torch.Tensor, scales: torch.Tensor) -> float:
        return float(dequantized.abs().max())
