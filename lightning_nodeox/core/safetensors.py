"""The safetensors framing that q4 messages and model files share: an 8-byte little-endian header length,
a JSON header padded with spaces to a multiple of 8 bytes, then the data."""

from __future__ import annotations

import struct

from .specs import PayloadError

MAX_HEADER_BYTES = 64 << 20
PREFIX_BYTES = 8


def frame(header_json: bytes, reserve: int = 0) -> bytes:
    """Length prefix and header, padded with spaces to ``reserve`` bytes (at least) and a multiple of 8."""
    text = header_json + b" " * max(0, reserve - len(header_json))
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def header_length(prefix: bytes, total: int | None, what: str) -> int:
    """The header length a prefix announces, refused when implausible (or longer than ``total`` bytes)."""
    if len(prefix) < PREFIX_BYTES:
        raise PayloadError(f"{what} is truncated: {len(prefix)} bytes, not even a header length")
    (length,) = struct.unpack("<Q", bytes(prefix[:PREFIX_BYTES]))
    if length > MAX_HEADER_BYTES or (total is not None and PREFIX_BYTES + length > total):
        raise PayloadError(f"{what} is truncated or corrupt: header length {length} with {total} bytes in all")
    if length % 8:
        raise PayloadError(f"{what} header length {length} is not a multiple of 8 (safetensors pads it)")
    return length


def split(raw, what: str) -> tuple[bytes, int]:
    """The header bytes of a whole file in memory and where its data starts."""
    length = header_length(bytes(raw[:PREFIX_BYTES]), len(raw), what)
    return bytes(raw[PREFIX_BYTES : PREFIX_BYTES + length]), PREFIX_BYTES + length
