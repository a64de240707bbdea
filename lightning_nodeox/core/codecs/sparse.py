"""sparse: per chunk of :data:`CHUNK` values, the top-k values by magnitude (SparseLoCo's shape, arXiv 2508.15706).

A tensor of ``n`` values is cut into chunks of ``C = 4096`` values (the last one may be shorter: a tensor under
4096 values is one short chunk). A **delta** sends, per chunk of ``m`` values, its ``k = ceil(density * m)`` values
of largest magnitude (:class:`~.settings.SparseSettings`: density in [0.001, 0.25]; ``k`` of a full chunk: 5 at
0.1%, 41 at 1% (``--codec sparse``'s default), 123 at 3% (the alias ``sparse3``), 1024 at 25%; any ``k`` up to
``C`` fits the format, and above 1/4 q4 sends fewer bytes), each as a 12-bit index inside its
chunk (two in three bytes) and a 2-bit code with q2's levels ``(2c - 3) * s``: the codes are those of
``s0 = 0.7 * mean|v|`` over the chunk's ``k`` values, and ``s`` (one fp16 or fp32 scale a chunk) is the
least-squares scale of those codes, ``sum(v * l) / sum(l * l)``. Everything else decodes to -0.0 and stays in the
host's error feedback (the residual ``x - decoded``, exactly). A tensor's code bytes are its values (a sync's fp16
values first, where they stay aligned), then its indices, padded to 8 bytes.

Round trip error: the values not sent are late, not lost (error feedback keeps them); a value sent keeps
``|v - d| <= max(s0, |v| - 3 s0)`` against the codes of ``s0`` (q2's bound; the least-squares ``s`` makes the
chunk's sent values' squared error no larger), up to the rounding of ``s`` to fp16. A delta has a fixed size: at
density 1% ``3 ceil(k / 2) + ceil(k / 4) + 2`` = 76 bytes per 4096 values, 0.019 bytes a value (q4: 0.53;
0.035x), at 3% 219 bytes, 0.053 bytes a value (0.10x).

A **sync** has a capacity ``E`` (its header says it, in ``[1, C]``): the coordinator opens a round of ``D`` deltas
with ``E = min(C, D * k)`` and sends, per chunk, the ``E`` values of largest magnitude of the sync delta (``ceil(E
* k_m / k)`` of a last chunk whose deltas send ``k_m``, at most its length) as a 12-bit index and an fp16 value
``q`` with one scale ``s = max|v|`` a chunk (fp16 or fp32): it decodes to ``float(q) * s`` (one IEEE multiply),
a relative error of at most 2^-11 for ``|v| >= 6.1e-5 s`` (fp16's normal range) and ``2^-25 s`` below it, up to
the rounding of ``s`` to fp16. Under plain averaging the mean of ``D`` deltas has at most ``D * k`` nonzeros a
chunk (the union of their supports), so it is carried whole. Nesterov's step is dense (its momentum remembers
earlier rounds' supports): the sync keeps the step's top ``E`` values a chunk and drops the rest (the momentum
still holds them; no error feedback on the coordinator). A value that is zero is sent as -0.0, so a sync never
changes the bits of a value it does not move. A received message whose index lies outside its chunk, or twice in
one chunk (a GPU would add the two in no fixed order), is refused.

The no-op sync: indices 0, 1, ... in every chunk, every code 2 (delta; ``+1 * -0.0``) or value +0.0 (sync;
``0.0 * -0.0``) and every scale -0.0: every value decodes to -0.0. Rounding is to nearest only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .base import Codec, Kernels
from .blockwise import Blockwise
from .q2 import NOOP_CODE, SCALE, TOP  # a delta's values are on q2's levels

if TYPE_CHECKING:
    from .settings import SparseSettings

CHUNK = 4096  # values a chunk (SparseLoCo's); a tensor's last chunk may be shorter
FP16_MAX = 65504.0
_TINY = 1e-30


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def index_bytes(entries: int) -> int:
    """Bytes of the 12-bit indices of a chunk's ``entries``: two in three bytes."""
    return 3 * _ceil_div(entries, 2)


def _unpack(packed: torch.Tensor, entries: int) -> torch.Tensor:
    """The indices (int64, rows x ``entries``) of rows of packed 12-bit indices: entry ``2i`` in byte ``3i`` and the
    low nibble of byte ``3i + 1``, entry ``2i + 1`` in its high nibble and byte ``3i + 2``."""
    t = packed.view(packed.shape[0], -1, 3).long()
    low = t[..., 0] | (t[..., 1] & 15) << 8
    high = t[..., 1] >> 4 | t[..., 2] << 4
    return torch.stack((low, high), dim=2).view(packed.shape[0], -1)[:, :entries].contiguous()


def _pack(index: torch.Tensor, out: torch.Tensor) -> None:
    """Write rows of indices in [0, 4096) (int64) as packed 12-bit indices into ``out`` (rows of bytes)."""
    if index.shape[1] % 2:
        index = torch.nn.functional.pad(index, (0, 1))
    pairs = index.view(index.shape[0], -1, 2)
    low, high = pairs[..., 0], pairs[..., 1]
    out.view(out.shape[0], -1, 3).copy_(torch.stack((low & 255, low >> 8 | (high & 15) << 4, high >> 4), dim=2))


@dataclass(frozen=True)
class SparseCodes:
    """A tensor's sparse codes (or some of its consecutive chunks'): ``index`` (uint8, 12-bit indices, chunk by
    chunk), ``value`` (a delta's: uint8, 2-bit codes four a byte; a sync's: float16, one an entry); ``per_chunk``
    entries a full chunk, ``last`` those of a short last chunk among them (0: none), ``count`` chunks."""

    index: torch.Tensor
    value: torch.Tensor
    per_chunk: int
    last: int
    count: int
    sync: bool

    def _width(self, entries: int) -> int:
        """Elements of ``value`` a chunk of ``entries`` takes."""
        return entries if self.sync else _ceil_div(entries, 4)

    def chunks(self, c0: int, c1: int) -> SparseCodes:
        """The codes of chunks ``[c0, c1)``."""
        c1 = min(c1, self.count)
        ib, vw = index_bytes(self.per_chunk), self._width(self.per_chunk)
        return SparseCodes(self.index[c0 * ib : min(c1 * ib, self.index.numel())],
                           self.value[c0 * vw : min(c1 * vw, self.value.numel())], self.per_chunk,
                           self.last if c1 == self.count else 0, c1 - c0, self.sync)

    def groups(self) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        """(entries a row, packed indices, values), rows of one chunk each: the full chunks, then a short last one."""
        full = self.count - (1 if self.last else 0)
        ib, vw = index_bytes(self.per_chunk), self._width(self.per_chunk)
        out = []
        if full:
            out.append((self.per_chunk, self.index[: full * ib].view(full, ib), self.value[: full * vw].view(full, vw)))
        if self.last:
            out.append((self.last, self.index[full * ib :].view(1, -1), self.value[full * vw :].view(1, -1)))
        return out

    def indices(self) -> torch.Tensor:
        """Every entry's index inside its chunk (int64, in order)."""
        parts = [_unpack(packed, e).view(-1) for e, packed, _ in self.groups()]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64, device=self.index.device)

    def write_indices(self, flat: torch.Tensor) -> None:
        """Set every entry's index (int64, in order, each in [0, 4096))."""
        at = 0
        for e, packed, _ in self.groups():
            _pack(flat[at : at + packed.shape[0] * e].view(packed.shape[0], e), packed)
            at += packed.shape[0] * e


class Sparse(Codec):
    """Top-k of each chunk with 2-bit values (a delta) and a sync of ``capacity`` fp16 values a chunk."""

    name = "sparse"
    stochastic_rounding = False
    fixed_size = False
    settings: SparseSettings

    def __init__(self, settings: SparseSettings, capacity: int | None = None) -> None:
        super().__init__(settings)
        self.density = settings.density
        self.k = self.entries(CHUNK)
        if capacity is not None and not 1 <= capacity <= CHUNK:
            raise ValueError(f"a sparse sync's capacity is in [1, {CHUNK}], got {capacity}")
        self.capacity = capacity

    @property
    def sync(self) -> bool:
        return self.capacity is not None

    @property
    def header_capacity(self) -> int:
        """The capacity a message's header says: a delta's ``k``, a sync's own."""
        return self.capacity if self.sync else self.k

    def entries(self, m: int) -> int:
        """The values a delta sends of a chunk of ``m`` values."""
        return min(m, max(1, math.ceil(self.density * m)))

    def chunk_entries(self, m: int) -> int:
        """The entries of a chunk of ``m`` values in this codec's messages."""
        if not self.sync:
            return self.entries(m)
        return min(m, _ceil_div(self.capacity * self.entries(m), self.k))

    def sync_capacity(self, deltas: int) -> int:
        return min(CHUNK, max(1, deltas) * self.k)

    def at_capacity(self, capacity: int) -> Sparse:
        return type(self)(self.settings, capacity)

    @property
    def alignment(self) -> int:
        return CHUNK

    def _counts(self, numel: int) -> tuple[int, int, int, int]:
        """(value bytes, index bytes, entries of a full chunk, entries of a short last one) of ``numel`` values."""
        full, tail = divmod(numel, CHUNK)
        e = self.chunk_entries(CHUNK)
        last = self.chunk_entries(tail) if tail else 0
        value_bytes = 2 * (full * e + last) if self.sync else full * _ceil_div(e, 4) + _ceil_div(last, 4)
        return value_bytes, full * index_bytes(e) + index_bytes(last), e, last

    def scale_count(self, numel: int) -> int:
        return _ceil_div(numel, CHUNK)

    def code_bytes(self, numel: int) -> int:
        value_bytes, index_bytes_, _, _ = self._counts(numel)
        size = value_bytes + index_bytes_
        return size + -size % 8  # the next tensor's scales stay aligned

    def codes_view(self, codes: torch.Tensor, numel: int) -> SparseCodes:
        """A tensor's code bytes: its values (fp16 ones first, where they stay aligned), then its indices."""
        value_bytes, index_bytes_, e, last = self._counts(numel)
        value = codes[:value_bytes]
        index = codes[value_bytes : value_bytes + index_bytes_]
        return SparseCodes(index, value.view(torch.float16) if self.sync else value, e, last,
                           self.scale_count(numel), self.sync)

    def kernels(self, device: torch.device | str = "cpu", chunk: int | None = None) -> SparseKernels:
        return SparseKernels(self, device, chunk)

    def fill_noop(self, codes: SparseCodes, scales: torch.Tensor) -> None:
        for e, packed, _ in codes.groups():  # indices 0, 1, ... in every chunk
            _pack(torch.arange(e, device=packed.device).expand(packed.shape[0], e), packed)
        codes.value.fill_(0.0 if codes.sync else NOOP_CODE)
        scales.fill_(-0.0)

    def magnitude(self, codes: SparseCodes, scales: torch.Tensor) -> float:
        if not scales.numel():
            return 0.0
        peak = scales.abs().max().float()
        if codes.sync and codes.value.numel():
            peak = peak * torch.clamp_min(codes.value.abs().max().float(), 1.0)
        return float(peak)

    def malformed(self, codes: SparseCodes, scales: torch.Tensor, numel: int) -> str | None:
        """An index outside its chunk, or one twice in a chunk (which a GPU would add in no fixed order)."""
        groups = codes.groups()
        for g, (e, packed, _) in enumerate(groups):
            index = _unpack(packed, e)
            length = numel % CHUNK if codes.last and g == len(groups) - 1 else CHUNK
            if index.numel() and int(index.max()) >= length:
                return "an index outside its chunk"
            ordered = index.sort(dim=1).values
            if bool((ordered[:, 1:] == ordered[:, :-1]).any()):
                return "an index twice in one chunk"
        return None

    too_large = Blockwise.too_large


class SparseKernels(Kernels):
    """Scratch and the chunk kernels of the sparse codec, for deltas and syncs alike (the codes say which)."""

    codec: Sparse

    def __init__(self, codec: Sparse, device: torch.device | str = "cpu", chunk: int | None = None) -> None:
        super().__init__(codec, device, None if chunk is None else max(chunk, CHUNK))  # whole chunks a call
        self.index = torch.empty(self.chunk, dtype=torch.int64, device=self.device)

    def padded(self, m: int) -> int:
        return m

    def blocks(self, codes: SparseCodes, scales: torch.Tensor, start: int, padded: int):
        c0, c1 = start // CHUNK, _ceil_div(start + padded, CHUNK)
        return codes.chunks(c0, c1), scales[c0:c1]

    # -- encode ---------------------------------------------------------------------------------------------
    def quantize(self, m: int, codes_out: SparseCodes, scales_out: torch.Tensor, *,
                 residual_out: torch.Tensor | None = None, dequant_out: torch.Tensor | None = None,
                 seed: int | None = None) -> None:
        """Select and encode ``self.x[:m]`` (filled by the caller); ``residual_out`` receives ``x - decoded``,
        ``dequant_out`` the decoded values (-0.0 where nothing was sent), computed exactly as a decoder does."""
        x = self.x[:m]
        if residual_out is not None:
            residual_out.copy_(x)
        if dequant_out is not None:
            dequant_out[:m].fill_(-0.0)
        at = 0
        for e, packed, values in codes_out.groups():
            rows = packed.shape[0]
            length = min(CHUNK, m - at)
            xr = x[at : at + rows * length].view(rows, length)
            index = self.index[: rows * e].view(rows, e)
            torch.topk(xr.abs(), e, dim=1, sorted=False, out=(self.y[: rows * e].view(rows, e), index))
            v = torch.gather(xr, 1, index)
            sc = scales_out[at // CHUNK : at // CHUNK + rows]
            d = self._encode_values(v, sc, values) if codes_out.sync else self._encode_codes(v, sc, values)
            _pack(index, packed)
            if residual_out is not None:
                residual_out[at : at + rows * length].view(rows, length).scatter_(
                    1, index, (v - d).to(residual_out.dtype))
            if dequant_out is not None:
                dequant_out[at : at + rows * length].view(rows, length).scatter_(1, index, d)
            at += rows * length

    def _publish(self, scale: torch.Tensor, scales_out: torch.Tensor) -> torch.Tensor:
        """Write the scales; returns what a decoder reads (fp32)."""
        scales_out.copy_(scale)
        return scales_out.float()

    def _encode_codes(self, v: torch.Tensor, scales_out: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        """A delta's values: q2's codes of ``s0 = 0.7 mean|v|``, the least-squares scale; returns the decoded."""
        rows, e = v.shape
        s0 = v.abs().mean(dim=1).mul_(SCALE)
        y = v * torch.clamp_min(s0, _TINY).reciprocal_().mul_(0.5)[:, None]
        y.add_(1.5).round_().clamp_(0, TOP)  # the codes, as floats
        c = y.to(torch.uint8)
        level = y.mul_(2).sub_(TOP)
        s = (v * level).sum(dim=1).div_((level * level).sum(dim=1))
        s = self._publish(s, scales_out)
        width = packed.shape[1] * 4
        if width != e:
            c = torch.nn.functional.pad(c, (0, width - e), value=2)
        c = c.view(rows, -1, 4)
        packed.copy_(c[:, :, 0] | c[:, :, 1] << 2 | c[:, :, 2] << 4 | c[:, :, 3] << 6)
        return level * s[:, None]

    def _encode_values(self, v: torch.Tensor, scales_out: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """A sync's values: fp16 ``v / s`` with ``s = max|v|``, zero as -0.0; returns the decoded."""
        s = self._publish(v.abs().amax(dim=1), scales_out)
        q = (v * torch.clamp_min(s, _TINY).reciprocal()[:, None]).clamp_(-FP16_MAX, FP16_MAX)
        values.copy_(q)
        values.neg_().add_(0.0).neg_()  # +0.0 (and -0.0) become -0.0; the rest stays as it is
        return values.float() * s[:, None]

    # -- decode ---------------------------------------------------------------------------------------------
    def dequantize(self, codes: SparseCodes, scales: torch.Tensor, mp: int) -> torch.Tensor:
        """The decoded values of ``mp`` values (in ``self.d``): -0.0 where nothing was sent."""
        d = self.d[:mp].fill_(-0.0)
        at = 0
        for e, packed, values in codes.groups():
            rows = packed.shape[0]
            length = min(CHUNK, mp - at)
            s = scales[at // CHUNK : at // CHUNK + rows].float()[:, None]
            if codes.sync:
                decoded = values.float() * s
            else:
                c = torch.stack([values & 3, values >> 2 & 3, values >> 4 & 3, values >> 6 & 3], dim=2)
                decoded = c.view(rows, -1)[:, :e].float().mul_(2).sub_(TOP) * s
            d[at : at + rows * length].view(rows, length).scatter_add_(1, _unpack(packed, e), decoded)
            at += rows * length
        return d

    def bound(self, dequantized: torch.Tensor, scales: torch.Tensor) -> float:
        return float(dequantized.abs().max()) if dequantized.numel() else 0.0
