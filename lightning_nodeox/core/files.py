"""A file written whole or not at all: under a temporary name, synced, then renamed over the old one, so that a
crash or a reader polling the path sees the old file (or none) or all of the new one, never part of it."""

from __future__ import annotations

import os
import zlib
from collections.abc import Iterable
from pathlib import Path


def write_atomic(path: Path, chunks: Iterable[bytes | memoryview], mode: int = 0o600) -> tuple[int, int]:
    """Write ``chunks`` to ``path`` so that it is either the old file or the whole new one (created with ``mode``:
    its owner's alone unless said); returns the size and the CRC-32 of what was written."""
    tmp = path.with_name(path.name + ".tmp")
    size = crc = 0
    with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode), "wb") as f:
        for chunk in chunks:
            size += f.write(chunk)
            crc = zlib.crc32(chunk, crc)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return size, crc
