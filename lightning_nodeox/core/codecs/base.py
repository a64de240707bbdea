"""The codec interface: what a codec owns (:class:`Codec`) and the chunk kernels it runs (:class:`Kernels`).

A codec turns each tensor of a message into ``codes`` (bytes) and ``scales`` (its scale dtype, possibly none).
It says how many of each a tensor takes, whether every message of a run has the same size, the bytes of a sync
that changes nothing, and why a finite delta might not fit. Its kernels work on one chunk at a time in their
own scratch; the whole-tensor loops of :mod:`lightning_nodeox.core.codec` drive any codec's kernels alike.

A codec of varying size (the sparse codec's syncs) is one instance per *capacity* (:meth:`Codec.at_capacity`: the
header says it, the layout follows from it), and may structure a tensor's code bytes for its kernels
(:meth:`Codec.codes_view`); the loops pass codes through untouched.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar

import torch

if TYPE_CHECKING:
    from .settings import CodecSettings

ATEN_GRAIN = 32768  # ATen runs an op of at most this many elements on one thread
CPU_CHUNK_SINGLE_THREADED = 131072
CUDA_CHUNK = 1 << 24
TORCH_SCALE_DTYPES = {"fp16": torch.float16, "fp32": torch.float32}  # a settings' scale_dtype, as torch's


def default_chunk(device: torch.device, alignment: int) -> int:
    """Elements per kernel call: cache-sized on the CPU (at most ATen's grain where ATen may thread)."""
    if device.type != "cpu":
        return CUDA_CHUNK
    chunk = CPU_CHUNK_SINGLE_THREADED if torch.get_num_threads() == 1 else ATEN_GRAIN
    return max(chunk, alignment)


class Codec(ABC):
    """One codec under one run's settings: its byte counts, dtypes, message layout, no-op and error text."""

    name: ClassVar[str]
    stochastic_rounding: ClassVar[bool] = True  # whether its kernels round stochastically when given a seed
    fixed_size: ClassVar[bool] = True  # every message of a run has one layout (a top-k codec's sync does not)
    capacity: int | None = None  # a varying codec: the capacity its messages' headers say (None: fixed size)
    error_decay: float = 1.0  # β of a host's error feedback: it encodes Δ + β residual
    mean_over_senders: bool = False  # a sync's value at a position is the mean over the deltas that sent it (a
    # sparse codec's; the coordinator then counts each value's senders), not over all of the round's

    def __init__(self, settings: CodecSettings) -> None:
        self.settings = settings

    @property
    def header_capacity(self) -> int | None:
        """The capacity its messages' headers say (a codec of varying size; None: one of fixed size says none)."""
        return self.capacity

    def sync_capacity(self, deltas: int) -> int | None:
        """The capacity of a sync of ``deltas`` deltas (None: every message has one layout)."""
        return None

    def at_capacity(self, capacity: int) -> Codec:
        """This codec for a sync message of ``capacity`` (a ValueError for a codec of fixed size, or a capacity
        out of its range)."""
        raise ValueError(f"codec {self.name!r} has messages of one size; its messages carry no capacity")

    def codes_view(self, codes: torch.Tensor, numel: int, shape: tuple[int, ...] | None = None):
        """What the kernels take as a tensor's codes, from its bytes: the bytes themselves, unless a codec
        structures them (the sparse codec's indices and values, its tiles by the tensor's ``shape``)."""
        return codes

    def malformed(self, codes, scales: torch.Tensor, numel: int) -> str | None:
        """Why a received tensor's codes cannot be decoded (an index outside its chunk), or None."""
        return None

    @property
    def scale_dtype(self) -> torch.dtype:
        """The dtype of its scales (the settings' ``scale_dtype``)."""
        return TORCH_SCALE_DTYPES[self.settings.scale_dtype]

    def check_rounding(self, rounding: str) -> None:
        """A ValueError naming the fix where this codec cannot round as a host asks (``"stochastic"``)."""
        if rounding == "stochastic" and not self.stochastic_rounding:
            raise ValueError(f"codec {self.name!r} rounds to nearest only: use rounding='nearest' (NodeoxStrategy's "
                             "default), or another --codec")

    @property
    def alignment(self) -> int:
        """Values a kernel chunk must be a multiple of (chunks start on a block boundary)."""
        return 1

    @abstractmethod
    def scale_count(self, numel: int) -> int:
        """Scales of a tensor of ``numel`` values."""

    @abstractmethod
    def code_bytes(self, numel: int) -> int:
        """Bytes of a tensor's codes."""

    @abstractmethod
    def kernels(self, device: torch.device | str = "cpu", chunk: int | None = None) -> Kernels:
        """Scratch and chunk kernels for one worker on ``device``."""

    @abstractmethod
    def fill_noop(self, codes: torch.Tensor, scales: torch.Tensor) -> None:
        """Write a tensor's sync that changes nothing: every value dequantizes to -0.0, and ``x + -0.0`` is ``x``
        bit for bit for every finite ``x`` (+0.0 and -0.0 included), in any dtype."""

    @abstractmethod
    def magnitude(self, codes: torch.Tensor, scales: torch.Tensor) -> float:
        """A tensor's largest scale (or, unscaled, value) magnitude; NaN or Inf when one is."""

    def too_large(self, name: str, round_: int) -> str | None:
        """The error for a finite delta of parameter ``name`` that this codec cannot hold (None: it holds any)."""
        return None


class Kernels(ABC):
    """Scratch buffers and the chunk kernels of one worker on one device.

    The loops use ``x`` (a chunk's input, filled by the caller), ``d`` (dequantized values) and ``y`` (free once
    a chunk is quantized); ``chunk`` is the most values one call takes.
    """

    def __init__(self, codec: Codec, device: torch.device | str = "cpu", chunk: int | None = None) -> None:
        self.codec = codec
        self.settings = codec.settings
        self.device = torch.device(device)
        align = codec.alignment
        chunk = chunk or default_chunk(self.device, align)
        self.chunk = chunk - chunk % align
        self.x = torch.empty(self.chunk, device=self.device)
        self.y = torch.empty(self.chunk, device=self.device)
        self.d = torch.empty(self.chunk, device=self.device)
        self._generator: torch.Generator | None = None

    @abstractmethod
    def padded(self, m: int) -> int:
        """The values a chunk of ``m`` occupies in a message (whole blocks)."""

    @abstractmethod
    def blocks(self, codes: torch.Tensor, scales: torch.Tensor, start: int, padded: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The codes and scales of the ``padded`` values from flat value ``start`` (a block boundary)."""

    def generator(self) -> torch.Generator:
        """The random generator of stochastic rounding (made at its first use)."""
        if self._generator is None:
            self._generator = torch.Generator(device=self.device)
        return self._generator

    @abstractmethod
    def quantize(self, m: int, codes_out: torch.Tensor, scales_out: torch.Tensor, *,
                 residual_out: torch.Tensor | None = None, dequant_out: torch.Tensor | None = None,
                 seed: int | None = None) -> None:
        """Encode ``self.x[:m]`` into ``codes_out`` and ``scales_out``; ``residual_out`` (m values) receives
        ``x - dequantized``, ``dequant_out`` (padded length) the dequantized values, exactly as a decoder
        computes them. A ``seed`` asks for stochastic rounding (None: to nearest)."""

    @abstractmethod
    def dequantize(self, codes: torch.Tensor, scales: torch.Tensor, mp: int) -> torch.Tensor:
        """The dequantized values of one chunk (``mp`` values, in ``self.d``)."""

    def accumulate(self, codes: torch.Tensor, scales: torch.Tensor, m: int, acc: torch.Tensor, weight: float,
                   assign: bool = False, senders: torch.Tensor | None = None) -> None:
        """``acc += weight * dequantized`` (``acc = ...`` when ``assign``) for the first ``m`` values of one chunk:
        here the dequantized chunk added (a codec may fuse the two). ``senders``: where a codec of
        :attr:`Codec.mean_over_senders` counts each value's senders' weight (no other codec takes it)."""
        if senders is not None:
            raise ValueError(f"codec {self.codec.name!r} syncs the mean over all deltas; it counts no senders")
        d = self.dequantize(codes, scales, m)
        if assign:
            torch.mul(d, weight, out=acc)
        else:
            acc.add_(d, alpha=weight)

    @abstractmethod
    def bound(self, dequantized: torch.Tensor, scales: torch.Tensor) -> float:
        """An upper bound of ``|dequantized|`` over one chunk, from its scales where it has them."""
