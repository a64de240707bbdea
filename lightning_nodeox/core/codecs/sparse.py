"""sparse: per chunk of :data:`CHUNK` values, the top-k values by magnitude (SparseLoCo's shape, arXiv 2508.15706).

A tensor of ``n`` values is cut into chunks of ``C = 4096`` values (the last one may be shorter: a tensor under
4096 values is one short chunk). A **delta** sends, per chunk of ``m`` values, its ``k = ceil(density * m)`` values
of largest magnitude (``k`` of a full chunk: 41 at density 1%, 123 at 3%), each as a uint16 index inside its chunk
and a 2-bit code with q2's levels ``(2c - 3) * s``: the codes are those of ``s0 = 0.7 * mean|v|`` over the chunk's
``k`` values, and ``s`` (one fp16 or fp32 scale a chunk) is the least-squares scale of those codes,
``sum(v * l) / sum(l * l)``. Everything else decodes to -0.0 and stays in the host's error feedback (the residual
``x - decoded``, exactly). Round trip error: the values not sent are lost to this round (kept by error feedback);
a value sent keeps ``|v - d| <= max(s0, |v| - 3 s0)`` against the codes of ``s0`` (q2's bound; the least-squares
``s`` makes the chunk's sent values' squared error no larger), up to the rounding of ``s`` to fp16. A delta has a
fixed size: at density 1% ``2.25 k + 2`` bytes per 4096 values, 0.023 bytes a value (q4: 0.53; 0.044x), at 3%
0.068 bytes a value (0.13x).

A **sync** has a capacity ``E`` (its header says it, in ``[1, C]``): the coordinator opens a round of ``D`` deltas
with ``E = min(C, D * k)`` and sends, per chunk, the ``E`` values of largest magnitude of the sync delta (``ceil(E
* k_m / k)`` of a last chunk whose deltas send ``k_m``, at most its length) as a uint16 index and an fp16 value
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
from typing import TYPE_CHECKING, ClassVar

import torch

from .base import Codec, Kernels
from .blockwise import Blockwise

if TYPE_CHECKING:
    from ..settings import Q4Settings

CHUNK = 4096  # values a chunk (SparseLoCo's); a tensor's last chunk may be shorter
SCALE = 0.7  # s0 / mean|v| (q2's)
TOP = 3  # codes span 0..3
NOOP_CODE = 0b10101010  # four codes 2 (+s) a byte
FP16_MAX = 65504.0
_TINY = 1e-30


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _rows(index: torch.Tensor, per_chunk: int) -> list[torch.Tensor]:
    """A tensor's (or some chunks') indices as rows of one chunk each: the full chunks, then a shorter last one."""
    full = index.numel() // per_chunk
    rows = [index[: full * per_chunk].view(full, per_chunk)]
    if index.numel() > full * per_chunk:
        rows.append(index[full * per_chunk :].view(1, -1))
    return rows


@dataclass(frozen=True)
class SparseCodes:
    """A tensor's sparse codes (or a run of its chunks'): ``index`` (int16, one an entry, chunk by chunk), ``value``
    (a delta's: uint8, 2-bit codes packed four a byte, ``packed`` bytes a full chunk; a sync's: float16, one an
    entry) and ``per_chunk``, the entries of a full chunk."""

    index: torch.Tensor
    value: torch.Tensor
    per_chunk: int
    packed: int  # value bytes of a full chunk (a sync: per_chunk)
    sync: bool

    def chunks(self, c0: int, c1: int) -> SparseCodes:
        """The entries of chunks ``[c0, c1)`` (the last chunk of the tensor may be among them)."""
        e, p = self.per_chunk, self.packed
        return SparseCodes(self.index[c0 * e : min(c1 * e, self.index.numel())],
                           self.value[c0 * p : min(c1 * p, self.value.numel())], e, p, self.sync)


class Sparse(Codec):
    """Top-k of each chunk with 2-bit values (a delta) and a sync of ``capacity`` fp16 values a chunk."""

    name = "sparse"
    density: ClassVar[float] = 0.01
    fixed_size = False

    def __init__(self, settings: Q4Settings, capacity: int | None = None) -> None:
        super().__init__(settings)
        if settings.rounding != "nearest":
            raise ValueError(f"codec {self.name!r} rounds to nearest only; drop --rounding {settings.rounding}")
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

    def _counts(self, numel: int) -> tuple[int, int, int]:
        """(entries, value bytes, entries of a full chunk) of a tensor of ``numel`` values."""
        full, tail = divmod(numel, CHUNK)
        e = self.chunk_entries(CHUNK)
        last = self.chunk_entries(tail) if tail else 0
        entries = full * e + last
        if self.sync:
            return entries, 2 * entries, e
        return entries, full * _ceil_div(e, 4) + _ceil_div(last, 4), e

    def scale_count(self, numel: int) -> int:
        return _ceil_div(numel, CHUNK)

    def code_bytes(self, numel: int) -> int:
        entries, value_bytes, _ = self._counts(numel)
        size = 2 * entries + value_bytes
        return size + -size % 8  # the next tensor's scales stay aligned

    def codes_view(self, codes: torch.Tensor, numel: int) -> SparseCodes:
        entries, value_bytes, e = self._counts(numel)
        index = codes[: 2 * entries].view(torch.int16)
        value = codes[2 * entries : 2 * entries + value_bytes]
        if self.sync:
            return SparseCodes(index, value.view(torch.float16), e, e, True)
        return SparseCodes(index, value, e, _ceil_div(e, 4), False)

    def kernels(self, device: torch.device | str = "cpu", chunk: int | None = None) -> SparseKernels:
        return SparseKernels(self, device, chunk)

    def fill_noop(self, codes: SparseCodes, scales: torch.Tensor) -> None:
        for rows in _rows(codes.index, codes.per_chunk):  # indices 0, 1, ... in every chunk
            rows.copy_(torch.arange(rows.shape[1], dtype=torch.int16, device=rows.device))
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
        full = numel // CHUNK
        index = codes.index
        if not index.numel():
            return None
        body, last = index[: full * codes.per_chunk], index[full * codes.per_chunk :]
        if int(index.min()) < 0 or (body.numel() and int(body.max()) >= CHUNK) or (
                last.numel() and int(last.max()) >= numel % CHUNK):
            return "an index outside its chunk"
        for rows in _rows(index, codes.per_chunk):
            ordered = rows.sort(dim=1).values
            if bool((ordered[:, 1:] == ordered[:, :-1]).any()):
                return "an index twice in one chunk"
        return None

    too_large = Blockwise.too_large


class Sparse3(Sparse):
    """The sparse codec at density 3%."""

    name = "sparse3"
    density = 0.03


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

    def _groups(self, m: int, codes: SparseCodes):
        """The chunk groups of ``m`` values: (value offset, rows, row length, entries a row, entry offset, value
        byte offset) for the full chunks, then the short last one."""
        full, tail = divmod(m, CHUNK)
        out = []
        if full:
            out.append((0, full, CHUNK, codes.per_chunk, 0, 0))
        if tail:
            entries = codes.index.numel() - full * codes.per_chunk
            out.append((full * CHUNK, 1, tail, entries, full * codes.per_chunk, full * codes.packed))
        return out

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
        for at, rows, length, e, entry, byte in self._groups(m, codes_out):
            xr = x[at : at + rows * length].view(rows, length)
            index = self.index[: rows * e].view(rows, e)
            torch.topk(xr.abs(), e, dim=1, sorted=False, out=(self.y[: rows * e].view(rows, e), index))
            v = torch.gather(xr, 1, index)
            sc = scales_out[at // CHUNK : at // CHUNK + rows]
            if codes_out.sync:
                d = self._encode_values(v, sc, codes_out.value[entry : entry + rows * e].view(rows, e))
            else:
                packed = codes_out.value[byte : byte + rows * _ceil_div(e, 4)].view(rows, -1)
                d = self._encode_codes(v, sc, packed)
            codes_out.index[entry : entry + rows * e].view(rows, e).copy_(index)
            if residual_out is not None:
                residual_out[at : at + rows * length].view(rows, length).scatter_(1, index, (v - d).to(residual_out.dtype))
            if dequant_out is not None:
                dequant_out[at : at + rows * length].view(rows, length).scatter_(1, index, d)

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
    def _decoded(self, codes: SparseCodes, scales: torch.Tensor, at: int, rows: int, e: int, entry: int,
                 byte: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The indices (int64) and decoded values of a group of chunks."""
        s = scales[at // CHUNK : at // CHUNK + rows].float()
        index = self.index[: rows * e].view(rows, e)
        index.copy_(codes.index[entry : entry + rows * e].view(rows, e))
        if codes.sync:
            return index, codes.value[entry : entry + rows * e].view(rows, e).float() * s[:, None]
        packed = codes.value[byte : byte + rows * _ceil_div(e, 4)].view(rows, -1)
        c = torch.stack([packed & 3, packed >> 2 & 3, packed >> 4 & 3, packed >> 6 & 3], dim=2).view(rows, -1)[:, :e]
        level = c.float().mul_(2).sub_(TOP)
        return index, level * s[:, None]

    def dequantize(self, codes: SparseCodes, scales: torch.Tensor, mp: int) -> torch.Tensor:
        """The decoded values of ``mp`` values (in ``self.d``): -0.0 where nothing was sent."""
        d = self.d[:mp].fill_(-0.0)
        for at, rows, length, e, entry, byte in self._groups(mp, codes):
            index, values = self._decoded(codes, scales, at, rows, e, entry, byte)
            d[at : at + rows * length].view(rows, length).scatter_add_(1, index, values)
        return d

    def accumulate(self, codes: SparseCodes, scales: torch.Tensor, m: int, acc: torch.Tensor, weight: float,
                   assign: bool = False) -> None:
        d = self.dequantize(codes, scales, m)
        if assign:
            torch.mul(d, weight, out=acc)
        else:
            acc.add_(d, alpha=weight)

    def bound(self, dequantized: torch.Tensor, scales: torch.Tensor) -> float:
        return float(dequantized.abs().max()) if dequantized.numel() else 0.0
