"""The q4 wire format: a safetensors file with nodeox metadata, made to be streamed piece by piece.

Layout (readable by ``safetensors.safe_open``): 8-byte little-endian header length, a JSON header padded
with spaces to a fixed reserved size, then for each tensor it carries ``NAME/scales`` (F16 or F32) followed by
``NAME/codes`` (U8, packed q4). ``__metadata__`` holds the format, version, the codec's settings (``codec``: the
JSON of :meth:`~.codecs.settings.CodecSettings.to_json`, its name and every setting), kind, round,
host, base-model hash, sample count, tensor specs, ``piece_bytes`` and ``crc32``, the CRC of the header itself
(with its ``crc32`` digits read as zeros): everything a receiver needs before the first tensor arrives.

The tensors are grouped into *pieces*, consecutive whole tensors of about ``piece_bytes`` (a tensor larger
than that is a piece of its own); after each piece an 8-byte entry ``__crc__/P`` holds the CRC-32 of the piece's
bytes (little-endian, then zero bytes to the next multiple of 8), so a receiver checks, accumulates or applies each piece as it arrives
while the sender still encodes the next. Because a tensor's scales come before its codes, any received prefix
of a piece is also usable. The message ends with ``__trailer__`` (40 bytes): the resulting model's hash (sync:
32 hex digits; a delta: zeros), the CRC-32 of those 32 bytes (little-endian) and 4 zero bytes: a sync's hash is
known only once its last piece is made.

A message carries some of the model's tensors, in the model's order, named by its specs: a delta those that could
change on its host (frozen parameters stay out), a sync the round's (:mod:`lightning_nodeox.host.moving`).

A raw tensor (integer or boolean, :attr:`TensorSpec.raw`) has no scales, and its ``codes`` are its own bytes
(padded to 8, so that every region after it stays aligned): in a delta the host's values, in a sync the values
every host takes (never a difference; no codec touches them).

An optional ``metrics`` key holds values logged with ``self.log(..., sync_dist=True)``, as JSON
``{name: [value, reduction]}``: in a delta the host's latest values, in a sync their reduction across hosts.
The header reserves :data:`METRICS_BYTES` for it, so every message of one set of tensors keeps one layout;
:func:`fit_metrics` says which values fit. Readers that do not know the key ignore it.

An optional ``covered`` key (a delta of a host that leases its data: :class:`~.ledger_terms.Covered`, as JSON)
says which positions of the epoch the delta trained. It shares the metrics' reserved room (so no layout changes):
:func:`covered_room` is what it leaves the metrics.

Every problem with a received message raises :class:`PayloadError`, whose message names the problem.
"""

from __future__ import annotations

import json
import math
import os
import struct
import zlib
from dataclasses import dataclass, field, replace

import torch

from . import safetensors
from .codecs import codec_for
from .codecs.base import Codec
from .codecs.settings import CodecSettings, Q4Settings, settings_from_json, settings_from_old_keys
from .ledger_terms import Covered
from .specs import PayloadError, TensorSpec, specs_from_json

FORMAT = "nodeox-q4"
VERSION = 3  # 3: the codec's settings whole, as one JSON value
OLDEST_VERSION = 2  # still read (a run saved before version 3 resumes): loose codec keys, another header size
PIECE_BYTES = 2 << 20  # a piece's size (about): NODEOX_PIECE_BYTES overrides it, for a sender
MIN_PIECE_BYTES, MAX_PIECE_BYTES = 1 << 10, 1 << 30
CRC_BYTES = 8
TRAILER_BYTES = 40
HASH_DIGITS = 32
_CRC_PLACEHOLDER = "00000000"
_DTYPE_NAMES = {torch.float16: "F16", torch.float32: "F32", torch.uint8: "U8"}
METRICS_BYTES = 4096  # room for the metrics JSON, as escaped inside the header


class PayloadSizeError(PayloadError):
    """A message whose size is not the one its header's tensors take (truncated, or trailing bytes)."""

    def __init__(self, expected: int, text: str) -> None:
        super().__init__(text)
        self.expected = expected


def metrics_json(metrics: dict) -> str:
    return json.dumps(metrics, separators=(",", ":"))


def covered_json(covered: Covered) -> str:
    return json.dumps(covered.to_dict(), separators=(",", ":"))


def covered_room(covered: Covered | None) -> int:
    """The room a delta's ``covered`` leaves its metrics; a Covered too large for the header is refused, naming
    the fix."""
    if covered is None:
        return METRICS_BYTES
    used = len(json.dumps(covered_json(covered))) + len(',"covered":')
    if used > METRICS_BYTES // 2:
        raise ValueError(f"a delta's covered data ({len(covered.spans)} spans) takes {used} bytes of its header, "
                         f"more than {METRICS_BYTES // 2}: lease fewer units per round, or start the coordinator "
                         "with a larger --data-unit")
    return METRICS_BYTES - used


def fit_metrics(metrics: dict, room: int = METRICS_BYTES) -> tuple[dict, list[str]]:
    """The metrics that fit in a message's header (in ``room`` bytes: less beside a ``covered``, see
    :func:`covered_room`), in order, and the names of those that do not."""
    kept: dict = {}
    dropped = []
    for name, value in metrics.items():
        trial = {**kept, name: value}
        if len(json.dumps(metrics_json(trial))) <= room:
            kept = trial
        else:
            dropped.append(name)
    return kept, dropped


def _parse_metrics(text: str) -> dict[str, list]:
    metrics = json.loads(text)
    if not isinstance(metrics, dict) or not all(
            isinstance(v, list) and len(v) == 2 and isinstance(v[0], (int, float)) and isinstance(v[1], str)
            for v in metrics.values()):
        raise PayloadError('payload metrics must be {"name": [value, "reduction"], ...}')
    return metrics


@dataclass(frozen=True)
class MessageMeta:
    """What a q4 message says about itself."""

    kind: str  # "delta" (host to coordinator) or "sync" (coordinator to hosts)
    round: int
    host: str
    base_hash: str
    samples: int = 0
    model_hash: str = ""  # sync: hash of the model after applying it
    final: bool = False  # delta: the host's last round
    codec: CodecSettings = Q4Settings()  # the codec's settings (a layout's, when it writes the header)
    tensors: tuple[TensorSpec, ...] = field(default=(), repr=False)
    metrics: dict[str, list] = field(default_factory=dict)  # {name: [value, reduction]} (see fit_metrics)
    piece_bytes: int = PIECE_BYTES
    capacity: int | None = None  # a codec of varying size: entries a chunk (see the codec); None: fixed size
    covered: Covered | None = None  # delta: the epoch's positions it trained (a host leasing its data)

    def metadata(self, crc: str) -> dict[str, str]:
        md = {
            "format": FORMAT, "version": str(VERSION), "kind": self.kind, "round": str(self.round),
            "host": self.host, "base_hash": self.base_hash,
            "samples": str(self.samples), "final": "1" if self.final else "0",
            "codec": json.dumps(self.codec.to_json(), separators=(",", ":")),
            "piece_bytes": str(self.piece_bytes),
            "tensors": json.dumps([s.as_json() for s in self.tensors], separators=(",", ":")),
        }
        if self.capacity is not None:
            md["capacity"] = str(self.capacity)
        if self.metrics:
            md["metrics"] = metrics_json(self.metrics)
        if self.covered is not None:
            md["covered"] = covered_json(self.covered)
        md["crc32"] = crc
        return md


@dataclass(frozen=True)
class Region:
    scales: tuple[int, int]
    codes: tuple[int, int]


@dataclass(frozen=True)
class Piece:
    """Consecutive whole tensors of a message (its tensor indices ``[first, stop)``), their bytes in the data
    section and where the CRC of those bytes sits (``crc``, also in the data section)."""

    first: int
    stop: int
    data: tuple[int, int]
    crc: int  # where its CRC starts (where its data ends)

    @property
    def end(self) -> int:
        """Where the piece ends on the wire, its CRC (padded so that the next piece starts aligned to 8)
        included, in the data section."""
        return self.crc + CRC_BYTES + -(self.crc + CRC_BYTES) % 8


def piece_bytes_default() -> int:
    """The piece size a sender uses: :data:`PIECE_BYTES`, or ``NODEOX_PIECE_BYTES``."""
    text = os.environ.get("NODEOX_PIECE_BYTES", "")
    return check_piece_bytes(int(text)) if text else PIECE_BYTES


def check_piece_bytes(size: int) -> int:
    if not MIN_PIECE_BYTES <= size <= MAX_PIECE_BYTES:
        raise PayloadError(f"piece size {size} is outside [{MIN_PIECE_BYTES}, {MAX_PIECE_BYTES}] bytes")
    return size


def regions_for(specs: tuple[TensorSpec, ...], codec: Codec,
                piece_bytes: int = PIECE_BYTES) -> tuple[list[Region], list[Piece], int]:
    """Byte ranges (within the data section) of each tensor's scales and codes, the pieces (each followed by its
    CRC) and where the trailer starts."""
    scale_size = codec.scale_dtype.itemsize
    regions: list[Region] = []
    pieces: list[Piece] = []
    pos = first = piece_start = 0
    for j, s in enumerate(specs):
        if s.raw:  # its own bytes, padded to 8
            sc, cd = (pos, pos), (pos, pos + -(-s.nbytes // 8) * 8)
        else:
            sc = (pos, pos + codec.scale_count(s.numel) * scale_size)
            cd = (sc[1], sc[1] + codec.code_bytes(s.numel))
        regions.append(Region(sc, cd))
        pos = cd[1]
        if pos - piece_start >= piece_bytes or j == len(specs) - 1:
            pieces.append(Piece(first, j + 1, (piece_start, pos), pos))
            pos = piece_start = pieces[-1].end
            first = j + 1
    return regions, pieces, pos


def _header_json(meta: MessageMeta, layout_parts: tuple, codec: Codec, crc: str) -> str:
    regions, pieces, trailer = layout_parts
    scale_name = _DTYPE_NAMES[codec.scale_dtype]
    header: dict = {"__metadata__": meta.metadata(crc)}
    for spec, r in zip(meta.tensors, regions):
        nb = (r.scales[1] - r.scales[0]) // codec.scale_dtype.itemsize
        header[f"{spec.name}/scales"] = {"dtype": scale_name, "shape": [nb], "data_offsets": list(r.scales)}
        header[f"{spec.name}/codes"] = {"dtype": "U8", "shape": [r.codes[1] - r.codes[0]], "data_offsets": list(r.codes)}
    for k, piece in enumerate(pieces):
        header[f"__crc__/{k}"] = {"dtype": "U8", "shape": [piece.end - piece.crc], "data_offsets": [piece.crc, piece.end]}
    header["__trailer__"] = {"dtype": "U8", "shape": [TRAILER_BYTES], "data_offsets": [trailer, trailer + TRAILER_BYTES]}
    return json.dumps(header, separators=(",", ":"))


@dataclass(frozen=True)
class MessageLayout:
    """Where everything sits in a message of some of a model's tensors (those that move: see docs/design.md);
    the messages of one set of tensors (and piece size) all have the same layout."""

    specs: tuple[TensorSpec, ...]
    settings: CodecSettings
    regions: tuple[Region, ...]
    pieces: tuple[Piece, ...]
    trailer: int  # where the trailer starts, in the data section
    piece_bytes: int
    data_start: int
    total: int
    codec: Codec = field(compare=False, repr=False)
    capacity: int | None = None  # a sync of a codec of varying size: its capacity (None: a delta, or fixed size)

    @classmethod
    def of(cls, specs: tuple[TensorSpec, ...], settings: CodecSettings, piece_bytes: int | None = None,
           capacity: int | None = None) -> MessageLayout:
        """The layout of a message of ``specs``; ``capacity``: a sync's, for a codec of varying size (the
        codec's ``at_capacity`` says which it takes)."""
        codec = codec_for(settings)
        if capacity is not None:
            codec = codec.at_capacity(capacity)
        piece_bytes = piece_bytes_default() if piece_bytes is None else check_piece_bytes(piece_bytes)
        regions, pieces, trailer = regions_for(specs, codec, piece_bytes)
        longest = MessageMeta("delta", 2**63 - 1, "h" * 64, "f" * 32, 2**63 - 1, "", True, settings, specs,
                              piece_bytes=MAX_PIECE_BYTES, capacity=_header_capacity(codec))
        parts = (regions, pieces, trailer)
        reserved = len(_header_json(longest, parts, codec, _CRC_PLACEHOLDER).encode()) + 64
        reserved += METRICS_BYTES + len(',"metrics":""')
        reserved += -reserved % 8
        data_bytes = trailer + TRAILER_BYTES
        return cls(specs, settings, tuple(regions), tuple(pieces), trailer, piece_bytes, 8 + reserved,
                   8 + reserved + data_bytes, codec, capacity)

    def codes_of(self, j: int, codes: torch.Tensor):
        """Tensor ``j``'s codes as its codec's kernels take them, from its bytes ``codes`` (a raw tensor's: its
        bytes)."""
        spec = self.specs[j]
        return codes if spec.raw else self.codec.codes_view(codes, spec.numel, spec.shape)

    def piece_of(self, j: int) -> int:
        """The piece that holds tensor ``j``."""
        for k, piece in enumerate(self.pieces):
            if j < piece.stop:
                return k
        raise IndexError(j)


class Message:
    """One q4 message in a CPU byte buffer, with views on each tensor's scales and codes.

    A sender allocates it once per model and rewrites it every round: all at once (``write_header`` last), or
    streamed (``write_head`` first, ``seal`` each piece once its tensors are in place, ``write_trailer`` last). A
    receiver wraps received bytes with :meth:`parse`, or checks a stream as it arrives (:meth:`read_head`, then
    :meth:`check_piece` per piece and :meth:`read_trailer`).
    """

    def __init__(self, buffer: torch.Tensor, layout: MessageLayout, meta: MessageMeta) -> None:
        self.buffer = buffer
        self.layout = layout
        self.meta = meta
        self.max_scale = 0.0  # the largest scale of the pieces checked so far

    @classmethod
    def allocate(cls, layout: MessageLayout, *, pin_memory: bool = False) -> Message:
        buffer = torch.empty(layout.total, dtype=torch.uint8, pin_memory=pin_memory)
        meta = MessageMeta("delta", 0, "", "", codec=layout.settings, tensors=layout.specs,
                           piece_bytes=layout.piece_bytes, capacity=_header_capacity(layout.codec))
        return cls(buffer, layout, meta)

    def __len__(self) -> int:
        return self.buffer.numel()

    @property
    def data(self) -> torch.Tensor:
        return self.buffer[self.layout.data_start :]

    def scales(self, i: int) -> torch.Tensor:
        a, b = self.layout.regions[i].scales
        return self.data[a:b].view(self.layout.codec.scale_dtype)

    def codes(self, i: int):
        """Tensor ``i``'s codes, as its codec's kernels take them (:meth:`MessageLayout.codes_of`)."""
        a, b = self.layout.regions[i].codes
        return self.layout.codes_of(i, self.data[a:b])

    def raw(self, i: int) -> torch.Tensor:
        """A raw tensor's bytes (without its region's padding)."""
        a, _ = self.layout.regions[i].codes
        return self.data[a : a + self.layout.specs[i].nbytes]

    # -- writing -----------------------------------------------------------------------------------------------
    def write_header(self, meta: MessageMeta) -> None:
        """Complete a message whose data is in place: the header for ``meta``, every piece's CRC, the trailer
        with ``meta.model_hash``."""
        self.write_head(meta)
        for k in range(len(self.layout.pieces)):
            self.seal(k)
        self.write_trailer(meta.model_hash)

    def write_head(self, meta: MessageMeta) -> None:
        """Write the header for ``meta`` (its ``model_hash`` goes in the trailer) and its own CRC."""
        layout = self.layout
        meta = replace(meta, codec=layout.settings, tensors=layout.specs, piece_bytes=layout.piece_bytes,
                       capacity=_header_capacity(layout.codec))
        text = _header_json(meta, (layout.regions, layout.pieces, layout.trailer), layout.codec,
                            _CRC_PLACEHOLDER).encode()
        framed = safetensors.frame(text, reserve=layout.data_start - safetensors.PREFIX_BYTES)
        if len(framed) != layout.data_start:
            raise ValueError("q4 header does not fit its reserved space: host ids are at most 64 characters "
                             "and metrics must pass fit_metrics")
        raw = self.buffer.numpy()
        raw[: layout.data_start] = memoryview(framed)
        crc = zlib.crc32(framed)
        pos = framed.index(b'"crc32":"') + len(b'"crc32":"')
        raw[pos : pos + 8] = memoryview(f"{crc:08x}".encode())
        self.meta = meta

    def seal(self, k: int) -> None:
        """Write piece ``k``'s CRC (its tensors are in place)."""
        piece, data = self.layout.pieces[k], self.data.numpy()
        slot = struct.pack("<I", zlib.crc32(data[piece.data[0] : piece.data[1]]))
        data[piece.crc : piece.end] = memoryview(slot.ljust(piece.end - piece.crc, b"\0"))

    def write_trailer(self, model_hash: str = "") -> None:
        """Write the trailer: the resulting model's hash (a sync's; "" for a delta) and its CRC."""
        digits = model_hash.encode().ljust(HASH_DIGITS, b"\0")
        if len(digits) != HASH_DIGITS:
            raise ValueError(f"a model hash has at most {HASH_DIGITS} characters, got {model_hash!r}")
        data, at = self.data.numpy(), self.layout.trailer
        data[at : at + TRAILER_BYTES] = memoryview(digits + struct.pack("<II", zlib.crc32(digits), 0))
        self.meta = replace(self.meta, model_hash=model_hash)

    def view(self) -> memoryview:
        return memoryview(self.buffer.numpy())

    def wire_end(self, k: int) -> int:
        """Where piece ``k`` (its CRC included) ends in the whole message."""
        return self.layout.data_start + self.layout.pieces[k].end

    def part_ranges(self) -> list[tuple[int, int]]:
        """The message cut where a store holds it, one object each: its header, each piece, its trailer."""
        ends = [self.layout.data_start] + [self.wire_end(k) for k in range(len(self.layout.pieces))] + [len(self)]
        return [(a, b) for a, b in zip([0] + ends[:-1], ends) if b > a]

    # -- reading -----------------------------------------------------------------------------------------------
    @classmethod
    def parse(cls, data: torch.Tensor | bytes | bytearray | memoryview) -> Message:
        """Validate a whole received message (structure, version, CRCs, scales) and return views on it."""
        buffer = data if isinstance(data, torch.Tensor) else _as_tensor(data)
        raw = buffer.numpy()
        header_bytes, data_start = safetensors.split(raw, "payload")
        message = cls.read_head(bytes(raw[:data_start]), buffer, total=len(raw))
        for k in range(len(message.layout.pieces)):
            message.check_piece(k)
        message.read_trailer()
        return message

    @classmethod
    def read_head(cls, head: bytes, buffer: torch.Tensor | None = None, *, total: int | None = None) -> Message:
        """A message whose header ``head`` (its first ``data_start`` bytes, length prefix included) is valid,
        in ``buffer`` (whose first bytes become ``head``; None: allocated for it). ``total``: the message's size,
        when the receiver knows it (refused unless the header's tensors take exactly that)."""
        header_bytes, data_start = safetensors.split(head, "payload")
        if data_start != len(head):
            raise PayloadError("payload header is longer than the bytes given for it")
        header, md, version = _parsed_header(header_bytes)
        try:
            settings = (settings_from_json(json.loads(md["codec"])) if version == VERSION
                        else settings_from_old_keys(md))
            specs = specs_from_json(json.loads(md["tensors"]))
            piece_bytes = check_piece_bytes(int(md["piece_bytes"]))
            meta = MessageMeta(kind=md["kind"], round=int(md["round"]), host=str(md["host"]),
                          base_hash=str(md["base_hash"]), samples=int(md["samples"]), final=md["final"] == "1",
                          codec=settings, tensors=specs, metrics=_parse_metrics(md.get("metrics") or "{}"),
                          piece_bytes=piece_bytes,
                          covered=Covered.from_dict(json.loads(md["covered"])) if "covered" in md else None)
            crc_text = str(md["crc32"])
            expected_crc = int(crc_text, 16)
            capacity = int(md["capacity"]) if "capacity" in md else None
        except PayloadError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
            raise PayloadError(f"payload metadata is incomplete or malformed: {e}") from None
        if meta.kind not in ("delta", "sync") or not 0 <= meta.samples < 2**62 or not 0 <= meta.round < 2**62:
            raise PayloadError(f"payload metadata is out of range: kind={meta.kind!r} round={meta.round} "
                               f"samples={meta.samples}")
        _check_header_crc(head, header_bytes, crc_text, expected_crc)
        layout = MessageLayout.of(specs, settings, piece_bytes, _sync_capacity(meta.kind, settings, capacity))
        if version != VERSION:  # an older header, of another size before the same data section
            layout = replace(layout, data_start=data_start, total=data_start + layout.total - layout.data_start)
        meta = replace(meta, capacity=capacity)
        if layout.data_start != data_start:
            raise PayloadError(f"payload header takes {data_start} bytes; {layout.data_start} expected for its tensors")
        if total is not None and total != layout.total:
            raise PayloadSizeError(layout.total, f"payload is truncated or has trailing bytes: {total} bytes, "
                                   f"{layout.total} expected for its tensors")
        _check_offsets(header, specs, layout)
        if buffer is None:
            buffer = torch.empty(layout.total, dtype=torch.uint8)
        elif buffer.numel() < layout.total:
            raise PayloadSizeError(layout.total, f"payload needs {layout.total} bytes for its tensors")
        buffer = buffer[: layout.total]
        buffer.numpy()[:data_start] = memoryview(head)
        return cls(buffer, layout, meta)

    def check_piece(self, k: int) -> None:
        """Piece ``k`` (in place in the buffer) passes its CRC and holds no NaN or Inf scales."""
        piece, data = self.layout.pieces[k], self.data.numpy()
        slot = bytes(data[piece.crc : piece.end])
        (crc,) = struct.unpack("<I", slot[:4])
        got = zlib.crc32(data[piece.data[0] : piece.data[1]])
        if got != crc or slot[4:].strip(b"\0"):
            raise PayloadError(f"payload piece {k} failed its integrity check (crc32 {got:08x}, the piece says "
                               f"{crc:08x}): it was corrupted in transit")
        codec = self.layout.codec
        for j in range(piece.first, piece.stop):
            spec = self.layout.specs[j]
            if spec.raw:
                continue
            codes = self.codes(j)
            problem = codec.malformed(codes, self.scales(j), spec.numel)
            if problem:
                raise PayloadError(f"payload tensor {spec.name!r} has {problem}: the message is malformed")
            peak = codec.magnitude(codes, self.scales(j))
            if not math.isfinite(peak):
                raise PayloadError(f"payload has NaN or Inf scales for tensor {spec.name!r}")
            self.max_scale = max(self.max_scale, peak)

    def read_trailer(self) -> str:
        """The trailer's model hash (checked; "" for a delta), also set in :attr:`meta`."""
        data, at = self.data.numpy(), self.layout.trailer
        digits = bytes(data[at : at + HASH_DIGITS])
        crc, pad = struct.unpack("<II", bytes(data[at + HASH_DIGITS : at + TRAILER_BYTES]))
        if zlib.crc32(digits) != crc or pad:
            raise PayloadError("payload trailer failed its integrity check: it was corrupted in transit")
        try:
            model_hash = digits.rstrip(b"\0").decode("ascii")
        except UnicodeDecodeError:
            raise PayloadError("payload trailer's model hash is not text") from None
        self.meta = replace(self.meta, model_hash=model_hash)
        return model_hash

    def scale_maxima(self) -> list[float]:
        """Each tensor's largest scale magnitude (NaN or Inf when any of its scales is), one pass over the scales;
        unquantized, its largest value magnitude; 0.0 for a raw tensor (its bytes are not values of the codec)."""
        codec = self.layout.codec
        return [0.0 if spec.raw else codec.magnitude(self.codes(i), self.scales(i))
                for i, spec in enumerate(self.layout.specs)]

    def weighted_scales_finite(self, samples: int) -> bool:
        """Whether ``samples`` times the largest dequantized value stays far inside fp32's range."""
        return self.max_scale * 8 * max(samples, 1) < 1e30


def check_codec(theirs: CodecSettings, run: CodecSettings) -> None:
    """A PayloadError unless a message's codec settings (``theirs``) are the run's."""
    if theirs != run:
        raise PayloadError(f"payload uses {theirs}; this run uses {run}")


def _header_capacity(codec: Codec) -> int | None:
    """The capacity a message's header says (None: a codec of fixed size says none)."""
    return None if codec.fixed_size else codec.header_capacity


def _sync_capacity(kind: str, settings: CodecSettings, capacity: int | None) -> int | None:
    """The capacity a received message's layout takes (a sync's; a delta's is the codec's own), or a PayloadError
    for one the codec does not take."""
    codec = codec_for(settings)
    if codec.fixed_size:
        if capacity is not None:
            raise PayloadError(f"payload of codec {codec.name!r} says a capacity ({capacity}); its messages have one size")
        return None
    if capacity is None:
        raise PayloadError(f"payload of codec {codec.name!r} says no capacity")
    if kind == "delta":
        if capacity != codec.header_capacity:
            raise PayloadError(f"payload is a {codec.name} delta of capacity {capacity}; its codec sends "
                               f"{codec.header_capacity} values a chunk")
        return None
    try:
        codec.at_capacity(capacity)
    except ValueError as e:
        raise PayloadError(f"payload is malformed: {e}") from None
    return capacity


def _parsed_header(header_bytes: bytes) -> tuple[dict, dict, int]:
    """A message's header, its ``__metadata__`` and its format version, parsed: JSON that names this format at a
    version this build reads."""
    try:
        header = json.loads(header_bytes.decode("utf-8"))
        md = header["__metadata__"]
        if md.get("format") != FORMAT:
            raise PayloadError(f"payload is not a {FORMAT} message (format={md.get('format')!r})")
        version = int(md["version"])
    except PayloadError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError, RecursionError) as e:
        raise PayloadError(f"payload header is not valid nodeox-q4 JSON: {e}") from None
    if not OLDEST_VERSION <= version <= VERSION:
        raise PayloadError(f"payload uses q4 format version {version}; this build reads versions {OLDEST_VERSION} "
                           f"to {VERSION}. Run the same lightning-nodeox version on every host and the coordinator.")
    return header, md, version


def _check_header_crc(head: bytes, header_bytes: bytes, crc_text: str, expected_crc: int) -> None:
    """The header ``head`` passes the CRC-32 its ``crc32`` field (``crc_text``, read as ``expected_crc``) says,
    computed with that field's digits zeroed."""
    pos = header_bytes.find(b'"crc32":"' + crc_text.encode() + b'"')
    if pos < 0 or crc_text != f"{expected_crc:08x}":  # one spelling: "CCB5..." would pass int(..., 16)
        raise PayloadError("payload crc32 field is malformed")
    zeroed = bytearray(head)
    start = safetensors.PREFIX_BYTES + pos + len(b'"crc32":"')
    zeroed[start : start + 8] = _CRC_PLACEHOLDER.encode()
    crc = zlib.crc32(zeroed)
    if crc != expected_crc:
        raise PayloadError(f"payload header failed its integrity check (crc32 {crc:08x}, header says "
                           f"{expected_crc:08x}): it was corrupted in transit")


def _check_offsets(header: dict, specs, layout: MessageLayout) -> None:
    codec = layout.codec
    scale_name = _DTYPE_NAMES[codec.scale_dtype]
    entries = 2 * len(specs) + len(layout.pieces) + 1
    if len(header) != 1 + entries:
        raise PayloadError(f"payload header lists {len(header) - 1} entries, {entries} expected")
    for spec, r in zip(specs, layout.regions):
        for suffix, dtype, span in (("scales", scale_name, r.scales), ("codes", "U8", r.codes)):
            entry = header.get(f"{spec.name}/{suffix}")
            if not isinstance(entry, dict) or entry.get("dtype") != dtype or entry.get("data_offsets") != list(span):
                raise PayloadError(f"payload entry {spec.name}/{suffix} is missing or has the wrong dtype or offsets")
    spans = [(f"__crc__/{k}", [p.crc, p.end]) for k, p in enumerate(layout.pieces)]
    spans.append(("__trailer__", [layout.trailer, layout.trailer + TRAILER_BYTES]))
    for name, span in spans:
        entry = header.get(name)
        if not isinstance(entry, dict) or entry.get("dtype") != "U8" or entry.get("data_offsets") != span:
            raise PayloadError(f"payload entry {name} is missing or has the wrong dtype or offsets")


def _as_tensor(data: bytes | bytearray | memoryview) -> torch.Tensor:
    if isinstance(data, bytes):
        data = bytearray(data)  # torch.frombuffer needs a writable buffer
    if len(data) == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(data, dtype=torch.uint8)
