"""The full model as a plain safetensors file, streamed from and into tensors without a full-size copy.

It travels only when a host asks for it (joining, or recovering from a sync it could not apply) and once
at the start, when the first host provides the initial model. Metadata: ``round`` and ``model_hash``.
"""

from __future__ import annotations

import json
import math
import os

import torch

from . import safetensors
from .protocol import read_fully
from .specs import ModelMismatchError, PayloadError, TensorSpec, check_same_model, spec_of
from .wire import VERSION

SAFETENSORS_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64",
                      "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"}
BOUNCE_BYTES = 64 << 20  # host-memory staging for tensors on a GPU


def model_header(specs: tuple[TensorSpec, ...], round_: int, model_hash: str) -> bytes:
    """Length prefix and JSON header of a safetensors file holding the model's tensors in order."""
    header: dict = {"__metadata__": {"format": "nodeox-model", "version": str(VERSION), "round": str(round_),
                                     "model_hash": model_hash}}
    pos = 0
    for s in specs:
        size = s.nbytes
        header[s.name] = {"dtype": SAFETENSORS_DTYPES[s.dtype], "shape": list(s.shape), "data_offsets": [pos, pos + size]}
        pos += size
    return safetensors.frame(json.dumps(header, separators=(",", ":")).encode())


def parse_header(header_json: bytes) -> tuple[int, str, tuple[TensorSpec, ...], list[tuple[int, int]]]:
    """Round, model hash, specs and data offsets from a safetensors header (ours, or any of the dtypes nodeox exchanges)."""
    names_by_code = {v: k for k, v in SAFETENSORS_DTYPES.items()}
    try:
        header = json.loads(header_json)
        md = header.pop("__metadata__", None) or {}
        round_, model_hash = int(md.get("round", 0)), str(md.get("model_hash", ""))
        entries = sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0])
        specs = tuple(TensorSpec(name, names_by_code[e["dtype"]], tuple(int(d) for d in e["shape"]))
                      for name, e in entries)
        offsets = [tuple(e["data_offsets"]) for _, e in entries]
    except KeyError as e:
        raise PayloadError(f"model file holds a tensor of a dtype nodeox does not exchange, or lacks a field: {e}") from None
    except (ValueError, TypeError, AttributeError, IndexError) as e:
        raise PayloadError(f"model file header is malformed: {e}") from None
    if any(len(o) != 2 for o in offsets) or any(d < 0 for s in specs for d in s.shape):
        raise PayloadError("model file header has malformed offsets or shapes")
    pos = 0
    for spec, (a, b) in zip(specs, offsets):
        size = spec.nbytes
        if (a, b) != (pos, pos + size):
            raise PayloadError(f"model file entry {spec.name!r} has offsets {[a, b]}, expected {[pos, pos + size]}")
        pos += size
    return round_, model_hash, specs, offsets


def check_model_file(path) -> tuple[int, str]:
    """Raise PayloadError unless the file at ``path`` has a model file's header and exactly the size it describes
    (its bytes are not read); returns the round and model hash its header records."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        length = safetensors.header_length(f.read(safetensors.PREFIX_BYTES), size, f"model file {path}")
        round_, model_hash, _, offsets = parse_header(f.read(length))
    end = safetensors.PREFIX_BYTES + length + (offsets[-1][1] if offsets else 0)
    if end != size:
        raise PayloadError(f"model file {path} is {size} bytes but its header describes {end}")
    return round_, model_hash


def read_model(data: torch.Tensor) -> tuple[int, str, tuple[TensorSpec, ...], list[torch.Tensor]]:
    """Round, model hash, specs and tensors viewing ``data`` (a whole model file in memory)."""
    raw = data.numpy()
    header, start = safetensors.split(raw, "model file")
    round_, model_hash, specs, offsets = parse_header(header)
    end = start + (offsets[-1][1] if offsets else 0)
    if end != len(raw):
        raise PayloadError(f"model file is {len(raw)} bytes but its header describes {end}")
    tensors = []
    for spec, (a, b) in zip(specs, offsets):
        chunk = data[start + a : start + b]
        if (start + a) % spec.torch_dtype.itemsize:
            chunk = chunk.clone()  # misaligned after a tensor of a smaller dtype
        tensors.append(chunk.view(spec.torch_dtype).view(spec.shape))
    return round_, model_hash, specs, tensors


# bytes per element of the safetensors dtypes nodeox does not exchange (not in SAFETENSORS_DTYPES): such tensors
# may sit in a user's file; they are skipped by name
OTHER_DTYPE_BYTES = {"U64": 8, "U32": 4, "U16": 2, "F8_E4M3": 1, "F8_E5M2": 1}


def read_named_model(data: torch.Tensor, what: str) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The tensors of any safetensors file in memory (``safetensors.torch.save_file`` of a state_dict, in whatever
    order it stored them) by name, and the names of those of a dtype the run does not exchange, skipped."""
    raw = data.numpy()
    header_json, start = safetensors.split(raw, what)
    codes = {v: k for k, v in SAFETENSORS_DTYPES.items()}
    try:
        header = json.loads(header_json)
        header.pop("__metadata__", None)
        entries = sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0])
        named, skipped, pos = {}, [], 0
        for name, e in entries:
            shape, (a, b) = tuple(int(d) for d in e["shape"]), e["data_offsets"]
            numel = math.prod(shape)
            if e["dtype"] not in codes:
                if (a, b) != (pos, pos + numel * OTHER_DTYPE_BYTES[e["dtype"]]):
                    raise ValueError(f"entry {name!r} has offsets {[a, b]}")
                skipped.append(name)
                pos = b
                continue
            dtype = TensorSpec(name, codes[e["dtype"]], shape).torch_dtype
            if (a, b) != (pos, pos + numel * dtype.itemsize) or min(shape, default=0) < 0:
                raise ValueError(f"entry {name!r} has offsets {[a, b]} for shape {list(shape)}")
            chunk = data[start + a : start + b]
            if (start + a) % dtype.itemsize:
                chunk = chunk.clone()
            named[name] = chunk.view(dtype).view(shape)
            pos = b
    except KeyError as e:
        raise PayloadError(f"{what}: an entry lacks a field or has an unknown dtype: {e}") from None
    except (ValueError, TypeError, AttributeError, IndexError) as e:
        raise PayloadError(f"{what}: the header is malformed: {e}") from None
    if start + pos != len(raw):
        raise PayloadError(f"{what} is {len(raw)} bytes but its header describes {start + pos}")
    return named, skipped


def arrange(named: dict[str, torch.Tensor], specs: tuple[TensorSpec, ...], what: str) -> list[torch.Tensor]:
    """``named``'s tensors in the order of ``specs``, matched by name; PayloadError naming the missing and extra
    names, or the first tensor whose dtype or shape differs."""
    missing = [s.name for s in specs if s.name not in named]
    extra = sorted(set(named) - {s.name for s in specs})
    if missing or extra:
        raise ModelMismatchError(f"{what} does not hold the model's tensors: missing {missing or 'none'}, extra "
                                 f"{extra or 'none'}")
    check_same_model(specs, spec_of((s.name, named[s.name]) for s in specs), what)
    return [named[s.name] for s in specs]


def _byte_view(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


class ModelFileReader:
    """File-like reading of (header, tensors) as one safetensors file, for an HTTP upload with a
    Content-Length: CPU tensors are read from their own memory, GPU tensors through a small bounce buffer."""

    def __init__(self, header: bytes, tensors: list[torch.Tensor]) -> None:
        self._parts = [torch.frombuffer(bytearray(header), dtype=torch.uint8)] + [_byte_view(t) for t in tensors]
        self._size = sum(p.numel() for p in self._parts)
        self._part, self._pos = 0, 0
        self._bounce: torch.Tensor | None = None

    def __len__(self) -> int:
        return self._size

    def rewind(self) -> None:
        """Start over (before a retried upload)."""
        self._part, self._pos = 0, 0

    def read(self, n: int = -1) -> memoryview | bytes:
        while self._part < len(self._parts) and self._pos >= self._parts[self._part].numel():
            self._part, self._pos = self._part + 1, 0
        if self._part >= len(self._parts):
            return b""
        part = self._parts[self._part]
        n = part.numel() - self._pos if n is None or n < 0 else min(n, part.numel() - self._pos)
        piece = part[self._pos : self._pos + n]
        self._pos += n
        if piece.device.type != "cpu":
            if self._bounce is None or self._bounce.numel() < n:
                self._bounce = torch.empty(max(n, 1 << 20), dtype=torch.uint8)
            piece = self._bounce[:n].copy_(piece)
        return memoryview(piece.numpy())


def read_model_into(stream, specs: tuple[TensorSpec, ...], tensors: list[torch.Tensor]) -> tuple[int, str]:
    """Read a model file from ``stream`` (with ``readinto``) straight into ``tensors``; returns round and hash."""
    prefix = bytearray(safetensors.PREFIX_BYTES)
    read_fully(stream, memoryview(prefix))
    header = bytearray(safetensors.header_length(prefix, None, "model file"))
    read_fully(stream, memoryview(header))
    round_, model_hash, got, _ = parse_header(bytes(header))
    if got != specs:
        check_same_model(specs, got, "the coordinator's model")
    bounce = None
    for t in tensors:
        raw = _byte_view(t)
        if raw.device.type == "cpu":
            read_fully(stream, memoryview(raw.numpy()))
            continue
        if bounce is None:
            bounce = torch.empty(min(BOUNCE_BYTES, max(raw.numel(), 1)), dtype=torch.uint8, pin_memory=True)
        for a in range(0, raw.numel(), bounce.numel()):
            b = min(raw.numel(), a + bounce.numel())
            read_fully(stream, memoryview(bounce[: b - a].numpy()))
            raw[a:b].copy_(bounce[: b - a])
    return round_, model_hash
