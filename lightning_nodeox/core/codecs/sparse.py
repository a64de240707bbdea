"""sparse: per chunk of :data:`CHUNK` values, the top-k values by magnitude: SparseLoCo's recipe by default, its
chunks runs of 4096 values (arXiv 2508.15706; :class:`~.settings.SparseSettings` holds each ingredient as a knob,
docs/algorithms.md compares them).

**Chunks.** ``chunking="runs"`` (the default) cuts every tensor into runs of ``C = 4096`` consecutive values (the
last one may be shorter: a tensor under 4096 values is one short chunk). With ``chunking="tiles"`` (SparseLoCo's)
a matrix of ``R x W`` values whose row length ``W`` is a power of two in [64, 4096] is cut into 64x64 tiles, band
after band of 64 rows, each band's tiles left to right; its rows past the last whole band, and every other
tensor, are cut into runs. Either way a tensor of ``n`` values has ``ceil(n / C)`` chunks, in the same byte
layout: a tile is a chunk whose 4096 values lie 64 to a row, its index ``i`` the value at row ``i // 64``, column
``i % 64`` of the tile. (SparseLoCo cuts any shape into its dimensions' largest divisors up to 64; shapes other than the ones above
keep runs here, the codec's calls being of whole bands of 64 rows.)

A **delta** sends, per chunk of ``m`` values, its ``k = ceil(density * m)`` values of largest magnitude (density
in [0.001, 0.25]; ``k`` of a full chunk: 64 by default, SparseLoCo's, 41 at 1%, 123 at 3% (the alias ``sparse3``),
1024 at 25%; any ``k`` up to ``C`` fits the format, and above 1/4 q4 sends fewer bytes), each as a 12-bit index
inside its chunk (two in three bytes) and a 2-bit code:

- ``levels="centroids"`` (default): bit 0 the value's sign, bit 1 which of its chunk's two magnitudes ``lo <= hi``
  (two scales a chunk, fp16 or fp32) it takes; it decodes to ``(1 - 2 sign) * magnitude`` (one IEEE multiply).
  ``lo`` and ``hi`` are the centroids of the chunk's sent magnitudes after :data:`LLOYD_STEPS` steps of Lloyd's
  algorithm from a split at their mean, and each value takes the nearer one (SparseLoCo decodes each of its 2-bit
  bins to the bins' mean as well, with one table of four bins a tensor; top-k values lie in two clusters, ``±`` the
  chunk's threshold and above, which two magnitudes a chunk fit more closely: on Gaussian values the kept values'
  relative error is 0.06 here, 0.11 with a tensor's four bins, 0.15 with q2's levels).
- ``levels="q2"``: q2's levels ``(2c - 3) * s``: the codes are those of ``s0 = 0.7 * mean|v|`` over the chunk's
  ``k`` values, and ``s`` (one scale a chunk) is the least-squares scale of those codes, ``sum(v * l) / sum(l * l)``.

Everything else decodes to -0.0 and stays in the host's error feedback (the residual ``x - decoded``, exactly, with
``x = Δ + error_decay * residual``). A tensor's code bytes are its values (a sync's fp16 values first, where they
stay aligned), then its indices, padded to 8 bytes.

Round trip error: the values not sent are late, not lost (error feedback keeps them). A value sent keeps its sign
under ``centroids``, and the chunk's sent values' squared error is at most that of one magnitude, ``sign(v) *
mean|v|`` (Lloyd's steps never add error), up to the rounding of the scales to fp16; under ``q2`` a value sent keeps
``|v - d| <= max(s0, |v| - 3 s0)`` against the codes of ``s0`` (q2's bound; the least-squares ``s`` makes the
chunk's sent values' squared error no larger). A delta has a fixed size: by default ``3 ceil(k / 2) + ceil(k / 4) +
4`` = 116 bytes per 4096 values, 0.028 bytes a value (q4: 0.53; 0.053x); at 1% under ``q2`` 76 bytes (0.035x), at
3% 219 bytes (0.10x).

A **sync** has a capacity ``E`` (its header says it, in ``[1, C]``): the coordinator opens a round of ``D`` deltas
with ``E = min(C, D * k)`` and sends, per chunk, the ``E`` values of largest magnitude of the sync delta (``ceil(E
* k_m / k)`` of a last chunk whose deltas send ``k_m``, at most its length) as a 12-bit index and an fp16 value
``q`` with one scale ``s = max|v|`` a chunk (fp16 or fp32): it decodes to ``float(q) * s`` (one IEEE multiply),
a relative error of at most 2^-11 for ``|v| >= 6.1e-5 s`` (fp16's normal range) and ``2^-25 s`` below it, up to
the rounding of ``s`` to fp16. The sync delta is, at each value, the mean over the deltas that sent it
(``mean="senders"``, SparseLoCo's: a value one host of two sent is that host's, not half of it) or over all the
round's deltas (``mean="deltas"``); the coordinator counts each value's senders as it accumulates. Under plain
averaging the mean of ``D`` deltas has at most ``D * k`` nonzeros a chunk (the union of their supports), so it is
carried whole. Nesterov's step is dense (its momentum remembers earlier rounds' supports): the sync keeps the
step's top ``E`` values a chunk and drops the rest (the momentum still holds them; no error feedback on the
coordinator). A value that is zero is sent as -0.0, so a sync never changes the bits of a value it does not move.
A received message whose index lies outside its chunk, or twice in one chunk (a GPU would add the two in no fixed
order), is refused.

The no-op sync: indices 0, 1, ... in every chunk, every code 0 (``centroids``: ``+1 * -0.0``) or 2 (``q2``: ``+1 *
-0.0``) or value +0.0 (sync; ``0.0 * -0.0``) and every scale -0.0: every value decodes to -0.0. Rounding is to
nearest only.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, NamedTuple

import torch

from .base import Codec, Kernels
from .blockwise import Blockwise
from .q2 import NOOP_CODE, SCALE, TOP  # levels="q2": a delta's values are on q2's levels

if TYPE_CHECKING:
    from .settings import SparseSettings

CHUNK = 4096  # values a chunk (SparseLoCo's: 64 x 64); a tensor's last chunk may be shorter
TILE = 64  # a tile's side
TILED_CALL = TILE * CHUNK  # a call's values under tiling: whole bands of 64 rows of any tiled matrix
LLOYD_STEPS = 3  # levels="centroids": steps from the split at the mean magnitude
CENTROIDS_NOOP = 0  # levels="centroids": four codes 0 (sign +, low magnitude) a byte
FP16_MAX = 65504.0
_TINY = 1e-30


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def index_bytes(entries: int) -> int:
    """Bytes of the 12-bit indices of a chunk's ``entries``: two in three bytes."""
    return 3 * _ceil_div(entries, 2)


def tiling(shape: tuple[int, ...] | None) -> tuple[int, int]:
    """(row length, tiled chunks) of a tensor of ``shape`` cut into tiles: a matrix whose rows hold a power of two in
    [64, 4096] values has its whole bands of 64 rows tiled; (0, 0) for any other shape (runs)."""
    if shape is None or len(shape) != 2:
        return 0, 0
    rows, width = shape
    if not TILE <= width <= CHUNK or width & (width - 1) or rows < TILE:
        return 0, 0
    return width, rows // TILE * (width // TILE)


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


def _pack_codes(c: torch.Tensor, packed: torch.Tensor, pad: int) -> None:
    """Rows of 2-bit codes (uint8) four a byte into ``packed`` (value ``4j + q`` in bits ``2q, 2q + 1`` of byte
    ``j``), a row's last byte filled with ``pad``."""
    rows, e = c.shape
    width = packed.shape[1] * 4
    if width != e:
        c = torch.nn.functional.pad(c, (0, width - e), value=pad)
    c = c.view(rows, -1, 4)
    packed.copy_(c[:, :, 0] | c[:, :, 1] << 2 | c[:, :, 2] << 4 | c[:, :, 3] << 6)


def _unpack_codes(packed: torch.Tensor, entries: int) -> torch.Tensor:
    """Rows of 2-bit codes (uint8, rows x ``entries``) from rows of packed bytes."""
    c = torch.stack([packed & 3, packed >> 2 & 3, packed >> 4 & 3, packed >> 6 & 3], dim=2)
    return c.view(packed.shape[0], -1)[:, :entries]


class Group(NamedTuple):
    """Consecutive chunks of one kind: ``entries`` a chunk, their packed indices and values (a row a chunk);
    ``tiled``: tiles of a matrix; ``short``: the tensor's short last chunk."""

    entries: int
    packed: torch.Tensor
    values: torch.Tensor
    tiled: bool = False
    short: bool = False


@dataclass(frozen=True)
class SparseCodes:
    """A tensor's sparse codes (or some of its consecutive chunks'): ``index`` (uint8, 12-bit indices, chunk by
    chunk), ``value`` (a delta's: uint8, 2-bit codes four a byte; a sync's: float16, one an entry); ``per_chunk``
    entries a full chunk, ``last`` those of a short last chunk among them (0: none), ``count`` chunks; ``first``: the
    tensor's chunk these begin with, ``width``: its row length where its first ``tiled`` chunks are tiles."""

    index: torch.Tensor
    value: torch.Tensor
    per_chunk: int
    last: int
    count: int
    sync: bool
    width: int = 0
    tiled: int = 0
    first: int = 0

    def _width(self, entries: int) -> int:
        """Elements of ``value`` a chunk of ``entries`` takes."""
        return entries if self.sync else _ceil_div(entries, 4)

    def chunks(self, c0: int, c1: int) -> SparseCodes:
        """The codes of chunks ``[c0, c1)``."""
        c1 = min(c1, self.count)
        ib, vw = index_bytes(self.per_chunk), self._width(self.per_chunk)
        return replace(self, index=self.index[c0 * ib : min(c1 * ib, self.index.numel())],
                       value=self.value[c0 * vw : min(c1 * vw, self.value.numel())],
                       last=self.last if c1 == self.count else 0, count=c1 - c0, first=self.first + c0)

    def groups(self) -> list[Group]:
        """The chunks in rows of one chunk each: the tiles, the full runs, then a short last one."""
        full = self.count - (1 if self.last else 0)
        tiles = min(full, max(0, self.tiled - self.first))
        ib, vw = index_bytes(self.per_chunk), self._width(self.per_chunk)
        out = []
        for a, b, tiled in ((0, tiles, True), (tiles, full, False)):
            if b > a:
                out.append(Group(self.per_chunk, self.index[a * ib : b * ib].view(b - a, ib),
                                 self.value[a * vw : b * vw].view(b - a, vw), tiled))
        if self.last:
            out.append(Group(self.last, self.index[full * ib :].view(1, -1), self.value[full * vw :].view(1, -1),
                             short=True))
        return out

    def indices(self) -> torch.Tensor:
        """Every entry's index inside its chunk (int64, in order)."""
        parts = [_unpack(g.packed, g.entries).view(-1) for g in self.groups()]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64, device=self.index.device)

    def write_indices(self, flat: torch.Tensor) -> None:
        """Set every entry's index (int64, in order, each in [0, 4096))."""
        at = 0
        for g in self.groups():
            rows = g.packed.shape[0]
            _pack(flat[at : at + rows * g.entries].view(rows, g.entries), g.packed)
            at += rows * g.entries


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
        self.tiles = settings.chunking == "tiles"
        self.centroids = settings.levels == "centroids"
        self.error_decay = settings.error_decay
        self.mean_over_senders = settings.mean == "senders"

    @property
    def sync(self) -> bool:
        return self.capacity is not None

    @property
    def header_capacity(self) -> int:
        """The capacity a message's header says: a delta's ``k``, a sync's own."""
        return self.capacity if self.sync else self.k

    @property
    def scales_per_chunk(self) -> int:
        """A delta's two magnitudes a chunk under ``centroids``; one scale a chunk otherwise (and in a sync)."""
        return 2 if self.centroids and not self.sync else 1

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
        return TILED_CALL if self.tiles else CHUNK

    def _counts(self, numel: int) -> tuple[int, int, int, int]:
        """(value bytes, index bytes, entries of a full chunk, entries of a short last one) of ``numel`` values."""
        full, tail = divmod(numel, CHUNK)
        e = self.chunk_entries(CHUNK)
        last = self.chunk_entries(tail) if tail else 0
        value_bytes = 2 * (full * e + last) if self.sync else full * _ceil_div(e, 4) + _ceil_div(last, 4)
        return value_bytes, full * index_bytes(e) + index_bytes(last), e, last

    def scale_count(self, numel: int) -> int:
        return _ceil_div(numel, CHUNK) * self.scales_per_chunk

    def code_bytes(self, numel: int) -> int:
        value_bytes, index_bytes_, _, _ = self._counts(numel)
        size = value_bytes + index_bytes_
        return size + -size % 8  # the next tensor's scales stay aligned

    def codes_view(self, codes: torch.Tensor, numel: int, shape: tuple[int, ...] | None = None) -> SparseCodes:
        """A tensor's code bytes: its values (fp16 ones first, where they stay aligned), then its indices; its
        ``shape`` says which chunks are tiles (none without it)."""
        value_bytes, index_bytes_, e, last = self._counts(numel)
        value = codes[:value_bytes]
        index = codes[value_bytes : value_bytes + index_bytes_]
        width, tiled = tiling(shape) if self.tiles else (0, 0)
        return SparseCodes(index, value.view(torch.float16) if self.sync else value, e, last,
                           _ceil_div(numel, CHUNK), self.sync, width, tiled)

    def kernels(self, device: torch.device | str = "cpu", chunk: int | None = None) -> SparseKernels:
        return SparseKernels(self, device, chunk)

    def fill_noop(self, codes: SparseCodes, scales: torch.Tensor) -> None:
        for g in codes.groups():  # indices 0, 1, ... in every chunk
            _pack(torch.arange(g.entries, device=g.packed.device).expand(g.packed.shape[0], g.entries), g.packed)
        codes.value.fill_(0.0 if codes.sync else CENTROIDS_NOOP if self.centroids else NOOP_CODE)
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
        for g in codes.groups():
            index = _unpack(g.packed, g.entries)
            length = numel % CHUNK if g.short else CHUNK
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
        super().__init__(codec, device, None if chunk is None else max(chunk, codec.alignment))  # whole chunks a call
        self.index = torch.empty(self.chunk, dtype=torch.int64, device=self.device)

    def padded(self, m: int) -> int:
        return m

    def blocks(self, codes: SparseCodes, scales: torch.Tensor, start: int, padded: int):
        c0, c1 = start // CHUNK, _ceil_div(start + padded, CHUNK)
        per = self._per(codes)
        return codes.chunks(c0, c1), scales[c0 * per : c1 * per]

    def _per(self, codes: SparseCodes) -> int:
        """Scales a chunk of ``codes`` (a sync's or a delta's: these kernels take both)."""
        return 1 if codes.sync or not self.codec.centroids else 2

    # -- where a call's chunks lie ------------------------------------------------------------------------------
    def _spans(self, codes: SparseCodes, m: int) -> Iterator[tuple[Group, int, int]]:
        """Each group of the call's chunks, with its first value among the call's ``m`` and its chunks' length."""
        at = 0
        for g in codes.groups():
            length = min(CHUNK, m - at)  # a short last chunk is alone in its group
            yield g, at, length
            at += g.packed.shape[0] * length

    @staticmethod
    def _rows(x: torch.Tensor, g: Group, at: int, length: int, width: int) -> torch.Tensor:
        """The group's chunks' values as rows (a tile's row by row), from the call's values ``x``."""
        rows = g.packed.shape[0]
        part = x[at : at + rows * length]
        if not g.tiled:
            return part.view(rows, length)
        across = width // TILE
        return part.view(rows // across, TILE, across, TILE).transpose(1, 2).reshape(rows, CHUNK)

    @staticmethod
    def _places(index: torch.Tensor, g: Group, at: int, length: int, width: int) -> torch.Tensor:
        """Where the group's entries (``index``: rows x entries, inside their chunks) lie among the call's values."""
        row = torch.arange(index.shape[0], device=index.device)[:, None]
        if not g.tiled:
            return index + (at + row * length)
        across = width // TILE
        start = at + (row // across) * (TILE * width) + (row % across) * TILE
        return start + (index >> 6) * width + (index & (TILE - 1))

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
        per = self._per(codes_out)
        for g, at, length in self._spans(codes_out, m):
            rows, e = g.packed.shape[0], g.entries
            xr = self._rows(x, g, at, length, codes_out.width)
            index = self.index[: rows * e].view(rows, e)
            torch.topk(xr.abs(), e, dim=1, sorted=False, out=(self.y[: rows * e].view(rows, e), index))
            v = torch.gather(xr, 1, index)
            sc = scales_out[at // CHUNK * per : (at // CHUNK + rows) * per]
            if codes_out.sync:
                d = self._encode_values(v, sc, g.values)
            elif self.codec.centroids:
                d = self._encode_centroids(v, sc, g.values)
            else:
                d = self._encode_codes(v, sc, g.values)
            _pack(index, g.packed)
            places = self._places(index, g, at, length, codes_out.width).view(-1)
            if residual_out is not None:
                residual_out.scatter_(0, places, (v - d).view(-1).to(residual_out.dtype))
            if dequant_out is not None:
                dequant_out.scatter_(0, places, d.view(-1))

    def _publish(self, scale: torch.Tensor, scales_out: torch.Tensor) -> torch.Tensor:
        """Write the scales; returns what a decoder reads (fp32)."""
        scales_out.copy_(scale)
        return scales_out.float()

    def _encode_codes(self, v: torch.Tensor, scales_out: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        """A delta's values: q2's codes of ``s0 = 0.7 mean|v|``, the least-squares scale; returns the decoded."""
        s0 = v.abs().mean(dim=1).mul_(SCALE)
        y = v * torch.clamp_min(s0, _TINY).reciprocal_().mul_(0.5)[:, None]
        y.add_(1.5).round_().clamp_(0, TOP)  # the codes, as floats
        c = y.to(torch.uint8)
        level = y.mul_(2).sub_(TOP)
        s = (v * level).sum(dim=1).div_((level * level).sum(dim=1))
        s = self._publish(s, scales_out)
        _pack_codes(c, packed, pad=2)
        return level * s[:, None]

    def _encode_centroids(self, v: torch.Tensor, scales_out: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        """A delta's values: each its sign and the nearer of its chunk's two magnitudes (Lloyd's centroids of the
        chunk's magnitudes, published as two scales a chunk, low then high); returns the decoded."""
        rows, e = v.shape
        a = v.abs()
        low, high = _centroids(a)
        published = self._publish(torch.cat((low, high), dim=1).view(-1), scales_out).view(rows, 2)
        low, high = published[:, :1], published[:, 1:]
        big = (a - low) > (high - a)
        negative = v < 0
        d = (1 - 2 * negative.float()) * torch.where(big, high, low)  # as the decoder computes it
        _pack_codes(negative.to(torch.uint8) | big.to(torch.uint8) << 1, packed, pad=CENTROIDS_NOOP)
        return d

    def _encode_values(self, v: torch.Tensor, scales_out: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """A sync's values: fp16 ``v / s`` with ``s = max|v|``, zero as -0.0; returns the decoded."""
        s = self._publish(v.abs().amax(dim=1), scales_out)
        q = (v * torch.clamp_min(s, _TINY).reciprocal()[:, None]).clamp_(-FP16_MAX, FP16_MAX)
        values.copy_(q)
        values.neg_().add_(0.0).neg_()  # +0.0 (and -0.0) become -0.0; the rest stays as it is
        return values.float() * s[:, None]

    # -- decode ---------------------------------------------------------------------------------------------
    def _decoded(self, codes: SparseCodes, g: Group, s: torch.Tensor) -> torch.Tensor:
        """The values a group's entries decode to (rows x entries), its chunks' scales ``s`` (rows x per chunk)."""
        if codes.sync:
            return g.values.float() * s
        c = _unpack_codes(g.values, g.entries)
        if self.codec.centroids:
            return (1 - 2 * (c & 1).float()) * torch.where((c & 2).bool(), s[:, 1:], s[:, :1])
        return c.float().mul_(2).sub_(TOP) * s

    def dequantize(self, codes: SparseCodes, scales: torch.Tensor, mp: int) -> torch.Tensor:
        """The decoded values of ``mp`` values (in ``self.d``): -0.0 where nothing was sent."""
        d = self.d[:mp].fill_(-0.0)
        per = self._per(codes)
        for g, at, length in self._spans(codes, mp):
            rows = g.packed.shape[0]
            s = scales[at // CHUNK * per : (at // CHUNK + rows) * per].float().view(rows, per)
            places = self._places(_unpack(g.packed, g.entries), g, at, length, codes.width)
            d.scatter_add_(0, places.view(-1), self._decoded(codes, g, s).view(-1))
        return d

    def accumulate(self, codes: SparseCodes, scales: torch.Tensor, m: int, acc: torch.Tensor, weight: float,
                   assign: bool = False, senders: torch.Tensor | None = None) -> None:
        """``acc += weight * dequantized`` (``acc = ...`` when ``assign``); with ``senders``, ``weight`` added there
        at each value the chunk sent (``senders = ...`` when ``assign``)."""
        if senders is not None and not self.codec.mean_over_senders:
            raise ValueError(f"codec {self.codec.name!r} syncs the mean over all deltas; it counts no senders")
        super().accumulate(codes, scales, m, acc, weight, assign)
        if senders is None:
            return
        if assign:
            senders.zero_()
        for g, at, length in self._spans(codes, m):
            places = self._places(_unpack(g.packed, g.entries), g, at, length, codes.width).view(-1)
            senders.index_add_(0, places, torch.full((places.numel(),), weight, device=senders.device))

    def bound(self, dequantized: torch.Tensor, scales: torch.Tensor) -> float:
        return float(dequantized.abs().max()) if dequantized.numel() else 0.0


def _centroids(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's two magnitudes (rows x 1 each, low <= high): Lloyd's algorithm on the row's values ``a`` (>= 0),
    :data:`LLOYD_STEPS` steps from the split at their mean; a side left empty takes the split itself."""
    e = a.shape[1]
    total = a.sum(dim=1, keepdim=True)
    split = total / e
    low = high = split
    for _ in range(LLOYD_STEPS):
        big = a > split
        count = big.sum(dim=1, keepdim=True)
        above = (a * big).sum(dim=1, keepdim=True)
        high = torch.where(count > 0, above / count.clamp_min(1), split)
        low = torch.where(count < e, (total - above) / (e - count).clamp_min(1), split)
        split = (low + high) / 2
    return low, high
