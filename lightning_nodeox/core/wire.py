"""The q4 wire format: a safetensors file with nodeox metadata and a CRC-32 over the whole message.

Layout (readable by ``safetensors.safe_open``): 8-byte little-endian header length, a JSON header padded
with spaces to a fixed reserved size, then for each tensor it carries ``NAME/scales`` (F16 or F32) followed by
``NAME/codes`` (U8, packed q4). ``__metadata__`` holds the format, version, codec settings, kind, round,
host, base-model hash, resulting-model hash (sync only), sample count, tensor specs and ``crc32``. The
CRC covers the header (with its ``crc32`` digits read as zeros) and all data.

A message carries some of the model's tensors, in the model's order, named by its specs: a delta those that could
change on its host (frozen parameters stay out), a sync the round's (:mod:`lightning_nodeox.host.moving`).

A raw tensor (integer or boolean, :attr:`TensorSpec.raw`) has no scales, and its ``codes`` are its own bytes
(padded to 8, so that every region after it stays aligned): in a delta the host's values, in a sync the values
every host takes (never a difference; no codec touches them).

An optional ``metrics`` key holds values logged with ``self.log(..., sync_dist=True)``, as JSON
``{name: [value, reduction]}``: in a delta the host's latest values, in a sync their reduction across hosts.
The header reserves :data:`METRICS_BYTES` for it, so every message of one set of tensors keeps one layout;
:func:`fit_metrics` says which values fit. Readers that do not know the key ignore it.

Every problem with a received message raises :class:`PayloadError`, whose message names the problem.
"""

from __future__ import annotations

import json
import math
import zlib
from dataclasses import dataclass, field, replace

import torch

from . import safetensors
from .codecs import codec_for
from .codecs.base import Codec
from .settings import Q4Settings
from .specs import PayloadError, TensorSpec, specs_from_json

FORMAT = "nodeox-q4"
VERSION = 1
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


def fit_metrics(metrics: dict) -> tuple[dict, list[str]]:
    """The metrics that fit in a message's header (in order), and the names of those that do not."""
    kept: dict = {}
    dropped = []
    for name, value in metrics.items():
        trial = {**kept, name: value}
        if len(json.dumps(metrics_json(trial))) <= METRICS_BYTES:
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
class Q4Meta:
    """What a q4 message says about itself."""

    kind: str  # "delta" (host to coordinator) or "sync" (coordinator to hosts)
    round: int
    host: str
    base_hash: str
    samples: int = 0
    model_hash: str = ""  # sync: hash of the model after applying it
    final: bool = False  # delta: the host's last round
    block_size: int = 64
    scale_dtype: str = "fp16"
    codec: str = "q4"
    tensors: tuple[TensorSpec, ...] = field(default=(), repr=False)
    metrics: dict[str, list] = field(default_factory=dict)  # {name: [value, reduction]} (see fit_metrics)

    def metadata(self, crc: str) -> dict[str, str]:
        md = {
            "format": FORMAT, "version": str(VERSION), "kind": self.kind, "round": str(self.round),
            "host": self.host, "base_hash": self.base_hash, "model_hash": self.model_hash,
            "samples": str(self.samples), "final": "1" if self.final else "0",
            "block_size": str(self.block_size), "scale_dtype": self.scale_dtype, "codec": self.codec,
            "tensors": json.dumps([s.as_json() for s in self.tensors], separators=(",", ":")),
        }
        if self.metrics:
            md["metrics"] = metrics_json(self.metrics)
        md["crc32"] = crc
        return md


@dataclass(frozen=True)
class Region:
    scales: tuple[int, int]
    codes: tuple[int, int]


def regions_for(specs: tuple[TensorSpec, ...], codec: Codec) -> list[Region]:
    """Byte ranges (within the data section) of each tensor's scales and codes."""
    scale_size = codec.scale_dtype.itemsize
    out, pos = [], 0
    for s in specs:
        if s.raw:  # its own bytes, padded to 8
            sc, cd = (pos, pos), (pos, pos + -(-s.nbytes // 8) * 8)
            out.append(Region(sc, cd))
            pos = cd[1]
            continue
        sc = (pos, pos + codec.scale_count(s.numel) * scale_size)
        cd = (sc[1], sc[1] + codec.code_bytes(s.numel))
        out.append(Region(sc, cd))
        pos = cd[1]
    return out


def _header_json(meta: Q4Meta, regions: list[Region], codec: Codec, crc: str) -> str:
    scale_name = _DTYPE_NAMES[codec.scale_dtype]
    header: dict = {"__metadata__": meta.metadata(crc)}
    for spec, r in zip(meta.tensors, regions):
        nb = (r.scales[1] - r.scales[0]) // codec.scale_dtype.itemsize
        header[f"{spec.name}/scales"] = {"dtype": scale_name, "shape": [nb], "data_offsets": list(r.scales)}
        header[f"{spec.name}/codes"] = {"dtype": "U8", "shape": [r.codes[1] - r.codes[0]], "data_offsets": list(r.codes)}
    return json.dumps(header, separators=(",", ":"))


@dataclass(frozen=True)
class Q4Layout:
    """Where everything sits in a message of some of a model's tensors (those that move: see docs/design.md);
    the messages of one set of tensors all have the same layout."""

    specs: tuple[TensorSpec, ...]
    settings: Q4Settings
    regions: tuple[Region, ...]
    data_start: int
    total: int
    codec: Codec = field(compare=False, repr=False)

    @classmethod
    def of(cls, specs: tuple[TensorSpec, ...], settings: Q4Settings) -> Q4Layout:
        codec = codec_for(settings)
        if not codec.fixed_size:
            raise ValueError(f"codec {codec.name!r} has messages of varying size; this wire format holds "
                             "fixed-size messages only")
        regions = tuple(regions_for(specs, codec))
        longest = Q4Meta("delta", 2**63 - 1, "h" * 64, "f" * 32, 2**63 - 1, "f" * 32, True,
                         settings.block_size, settings.scale_dtype, settings.codec, specs)
        reserved = len(_header_json(longest, list(regions), codec, _CRC_PLACEHOLDER).encode()) + 64
        reserved += METRICS_BYTES + len(',"metrics":""')
        reserved += -reserved % 8
        data_bytes = regions[-1].codes[1] if regions else 0
        return cls(specs, settings, regions, 8 + reserved, 8 + reserved + data_bytes, codec)


class Q4Message:
    """One q4 message in a CPU byte buffer, with views on each tensor's scales and codes.

    A sender allocates it once per model and rewrites it every round (``write_header`` last); a receiver
    wraps received bytes with :meth:`parse`.
    """

    def __init__(self, buffer: torch.Tensor, layout: Q4Layout, meta: Q4Meta) -> None:
        self.buffer = buffer
        self.layout = layout
        self.meta = meta
        self.max_scale = math.nan  # known once checked (parse)

    @classmethod
    def allocate(cls, layout: Q4Layout, *, pin_memory: bool = False) -> Q4Message:
        buffer = torch.empty(layout.total, dtype=torch.uint8, pin_memory=pin_memory)
        meta = Q4Meta("delta", 0, "", "", block_size=layout.settings.block_size,
                      scale_dtype=layout.settings.scale_dtype, codec=layout.settings.codec, tensors=layout.specs)
        return cls(buffer, layout, meta)

    def __len__(self) -> int:
        return self.buffer.numel()

    @property
    def data(self) -> torch.Tensor:
        return self.buffer[self.layout.data_start :]

    def scales(self, i: int) -> torch.Tensor:
        a, b = self.layout.regions[i].scales
        return self.data[a:b].view(self.layout.codec.scale_dtype)

    def codes(self, i: int) -> torch.Tensor:
        a, b = self.layout.regions[i].codes
        return self.data[a:b]

    def raw(self, i: int) -> torch.Tensor:
        """A raw tensor's bytes (without its region's padding)."""
        return self.codes(i)[: self.layout.specs[i].nbytes]

    def write_header(self, meta: Q4Meta) -> None:
        """Write the header for ``meta`` and the CRC over header and data (after the data is in place)."""
        layout = self.layout
        meta = replace(meta, block_size=layout.settings.block_size, scale_dtype=layout.settings.scale_dtype,
                       codec=layout.settings.codec, tensors=layout.specs)
        text = _header_json(meta, list(layout.regions), layout.codec, _CRC_PLACEHOLDER).encode()
        framed = safetensors.frame(text, reserve=layout.data_start - safetensors.PREFIX_BYTES)
        if len(framed) != layout.data_start:
            raise ValueError("q4 header does not fit its reserved space: host ids are at most 64 characters "
                             "and metrics must pass fit_metrics")
        raw = self.buffer.numpy()
        raw[: layout.data_start] = memoryview(framed)
        crc = zlib.crc32(raw[layout.data_start :], zlib.crc32(raw[: layout.data_start]))
        pos = framed.index(b'"crc32":"') + len(b'"crc32":"')
        raw[pos : pos + 8] = memoryview(f"{crc:08x}".encode())
        self.meta = meta

    def view(self) -> memoryview:
        return memoryview(self.buffer.numpy())

    @classmethod
    def parse(cls, data: torch.Tensor | bytes | bytearray | memoryview) -> Q4Message:
        """Validate a received message (structure, version, CRC, scales) and return views on it."""
        buffer = data if isinstance(data, torch.Tensor) else _as_tensor(data)
        raw = buffer.numpy()
        total = len(raw)
        header_bytes, data_start = safetensors.split(raw, "payload")
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
        if version != VERSION:
            raise PayloadError(f"payload uses q4 format version {version}; this build reads version {VERSION}. "
                               "Run the same lightning-nodeox version on every host and the coordinator.")
        try:
            settings = Q4Settings(block_size=int(md["block_size"]), scale_dtype=md["scale_dtype"],
                                  codec=md.get("codec", "q4"))
            specs = specs_from_json(json.loads(md["tensors"]))
            meta = Q4Meta(kind=md["kind"], round=int(md["round"]), host=str(md["host"]),
                          base_hash=str(md["base_hash"]), samples=int(md["samples"]),
                          model_hash=str(md.get("model_hash", "")), final=md["final"] == "1",
                          block_size=settings.block_size, scale_dtype=settings.scale_dtype, codec=settings.codec,
                          tensors=specs, metrics=_parse_metrics(md.get("metrics") or "{}"))
            crc_text = str(md["crc32"])
            expected_crc = int(crc_text, 16)
        except PayloadError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
            raise PayloadError(f"payload metadata is incomplete or malformed: {e}") from None
        if meta.kind not in ("delta", "sync") or not 0 <= meta.samples < 2**62 or not 0 <= meta.round < 2**62:
            raise PayloadError(f"payload metadata is out of range: kind={meta.kind!r} round={meta.round} "
                               f"samples={meta.samples}")
        codec = codec_for(settings)
        regions = tuple(regions_for(specs, codec))
        data_bytes = regions[-1].codes[1] if regions else 0
        if total != data_start + data_bytes:
            raise PayloadSizeError(data_start + data_bytes, f"payload is truncated or has trailing bytes: {total} "
                                   f"bytes, {data_start + data_bytes} expected for its tensors")
        _check_offsets(header, specs, regions, codec)
        pos = header_bytes.find(b'"crc32":"' + crc_text.encode() + b'"')
        if len(crc_text) != 8 or pos < 0:
            raise PayloadError("payload crc32 field is malformed")
        zeroed = bytearray(header_bytes)
        start = pos + len(b'"crc32":"')
        zeroed[start : start + 8] = _CRC_PLACEHOLDER.encode()
        crc = zlib.crc32(raw[: safetensors.PREFIX_BYTES].tobytes())
        crc = zlib.crc32(zeroed, crc)
        crc = zlib.crc32(raw[data_start:], crc)
        if crc != expected_crc:
            raise PayloadError(f"payload failed its integrity check (crc32 {crc:08x}, header says {expected_crc:08x}): "
                               "it was corrupted in transit")
        message = cls(buffer, Q4Layout(specs, settings, regions, data_start, total, codec), meta)
        message.check_scales()
        return message

    def scale_maxima(self) -> list[float]:
        """Each tensor's largest scale magnitude (NaN or Inf when any of its scales is), one pass over the scales;
        unquantized, its largest value magnitude; 0.0 for a raw tensor (its bytes are not values of the codec)."""
        codec = self.layout.codec
        return [0.0 if spec.raw else codec.magnitude(self.codes(i), self.scales(i))
                for i, spec in enumerate(self.layout.specs)]

    def check_scales(self) -> None:
        """Refuse NaN or Inf scales; remember the largest scale for :meth:`weighted_scales_finite`."""
        maxima = self.scale_maxima()
        for spec, peak in zip(self.meta.tensors, maxima):
            if not math.isfinite(peak):
                raise PayloadError(f"payload has NaN or Inf scales for tensor {spec.name!r}")
        self.max_scale = max(maxima, default=0.0)

    def weighted_scales_finite(self, samples: int) -> bool:
        """Whether ``samples`` times the largest dequantized value stays far inside fp32's range."""
        return self.max_scale * 8 * max(samples, 1) < 1e30


def _check_offsets(header: dict, specs, regions: list[Region], codec: Codec) -> None:
    scale_name = _DTYPE_NAMES[codec.scale_dtype]
    if len(header) != 1 + 2 * len(specs):
        raise PayloadError(f"payload header lists {len(header) - 1} entries, {2 * len(specs)} expected")
    for spec, r in zip(specs, regions):
        for suffix, dtype, span in (("scales", scale_name, r.scales), ("codes", "U8", r.codes)):
            entry = header.get(f"{spec.name}/{suffix}")
            if not isinstance(entry, dict) or entry.get("dtype") != dtype or entry.get("data_offsets") != list(span):
                raise PayloadError(f"payload entry {spec.name}/{suffix} is missing or has the wrong dtype or offsets")


def _as_tensor(data: bytes | bytearray | memoryview) -> torch.Tensor:
    if isinstance(data, bytes):
        data = bytearray(data)  # torch.frombuffer needs a writable buffer
    if len(data) == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(data, dtype=torch.uint8)
