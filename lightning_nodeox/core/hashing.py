"""A fast model hash, computed where the tensors live, streaming over their bytes with no full copy.

Each tensor's bytes are read as 64-bit words in rows of ``ROW_WORDS``; a row's digest is
``sum(word[i] * key[i]) mod 2**64`` with fixed odd keys (a multilinear hash: any single changed word
always changes it). Integer arithmetic is exact, so CPU and GPU agree bit for bit. The model hash is a
BLAKE2b over each tensor's name, dtype, shape, row digests and trailing bytes.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Collection, Sequence

import numpy as np
import torch

from .pool import WorkerPool

ROW_WORDS = 16384  # 128 KiB of tensor bytes a row
_SEED = 0x6E6F64656F78  # "nodeox"
_keys_by_device: dict[torch.device, torch.Tensor] = {}
_scratch = threading.local()


def _splitmix64(count: int, seed: int) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = (np.arange(1, count + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)) + np.uint64(seed)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return z | np.uint64(1)


def hash_keys(device: torch.device) -> torch.Tensor:
    keys = _keys_by_device.get(device)
    if keys is None:
        keys = torch.from_numpy(_splitmix64(ROW_WORDS, _SEED).view(np.int64)).to(device)
        _keys_by_device[device] = keys
    return keys


def _byte_view(t: torch.Tensor) -> torch.Tensor:
    flat = t.detach().reshape(-1)
    if not flat.is_contiguous() or (flat.storage_offset() * flat.element_size()) % 8:
        flat = flat.clone()
    return flat.view(torch.uint8)


def _rows_per_op(device: torch.device) -> int:
    if device.type != "cpu":
        return 1024
    return 8 if torch.get_num_threads() == 1 else 2  # stay under ATen's threading grain on the CPU


def _products(device: torch.device, rows: int) -> torch.Tensor:
    """This thread's reusable buffer for ``rows`` rows of word products."""
    cache = getattr(_scratch, "by_device", None)
    if cache is None:
        cache = _scratch.by_device = {}
    buf = cache.get(device)
    if buf is None or buf.numel() < rows * ROW_WORDS:
        buf = cache[device] = torch.empty(rows * ROW_WORDS, dtype=torch.int64, device=device)
    return buf


def row_digests(words: torch.Tensor, sums: torch.Tensor, start_row: int, stop_row: int) -> None:
    """``sums[r] = sum(words[row r] * keys)`` for rows ``[start_row, stop_row)``."""
    keys = hash_keys(words.device)
    full_rows = words.numel() // ROW_WORDS
    step = _rows_per_op(words.device)
    products = _products(words.device, step)
    for r in range(start_row, min(stop_row, full_rows), step):
        r_end = min(stop_row, full_rows, r + step)
        rows = words[r * ROW_WORDS : r_end * ROW_WORDS].view(-1, ROW_WORDS)
        prod = products[: rows.numel()].view(-1, ROW_WORDS)
        torch.mul(rows, keys, out=prod)
        torch.sum(prod, dim=1, out=sums[r:r_end])
    if stop_row > full_rows >= start_row and words.numel() > full_rows * ROW_WORDS:
        rest = words[full_rows * ROW_WORDS :]
        prod = products[: rest.numel()]
        torch.mul(rest, keys[: rest.numel()], out=prod)
        torch.sum(prod, dim=0, out=sums[full_rows])


class RowHasher:
    """The row digests of one tensor, computed all at once or chunk by chunk while a kernel has the bytes in cache."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        flat = tensor.detach().reshape(-1)
        self.in_place = flat.is_contiguous() and (flat.storage_offset() * flat.element_size()) % 8 == 0
        self._view()
        self.sums = torch.zeros(self.rows, dtype=torch.int64, device=self.words.device)

    def _view(self) -> None:
        """Word view of the tensor's bytes now (a copy when the tensor's bytes are not 8-byte aligned)."""
        self.raw = _byte_view(self.tensor)
        self.words = self.raw[: self.raw.numel() // 8 * 8].view(torch.int64)
        self.rows = -(-self.words.numel() // ROW_WORDS)

    def tail(self) -> bytes:
        """The bytes after the last whole word (read when the digest is made, after any update)."""
        whole = self.words.numel() * 8
        return bytes(self.raw[whole:].cpu().tolist()) if whole < self.raw.numel() else b""

    def fusable(self, chunk: int) -> bool:
        """Whether chunks of ``chunk`` values always end on row boundaries (so each row is digested once)."""
        return self.in_place and (chunk * self.tensor.element_size()) % (ROW_WORDS * 8) == 0

    def values(self, start: int, stop: int) -> None:
        """Digest the rows inside values ``[start, stop)`` (and the last, partial row at the tensor's end)."""
        row_bytes, size = ROW_WORDS * 8, self.tensor.element_size()
        first = -(-(start * size) // row_bytes)
        last = self.rows if stop >= self.tensor.numel() else (stop * size) // row_bytes
        if last > first:
            row_digests(self.words, self.sums, first, last)

    def tasks(self, rows_per_task: int = 64):
        """Tasks digesting every row of the tensor as it is now."""
        if not self.in_place:
            self._view()
        return [lambda _k, a=a: row_digests(self.words, self.sums, a, min(self.rows, a + rows_per_task))
                for a in range(0, self.rows, rows_per_task)]


def rest_tasks(hashers: Sequence[RowHasher], chunk: int, skipped: Collection[int]) -> list:
    """Tasks digesting what a chunked pass (``chunk`` values a call, each chunk digested while in cache: the
    hashers that are :meth:`RowHasher.fusable`) left undigested: the tensors it did not fuse, and those it skipped
    (``skipped``, by index: raw tensors, which no codec pass touches)."""
    return [t for i, h in enumerate(hashers) if i in skipped or not h.fusable(chunk) for t in h.tasks()]


def combine(named: Sequence[tuple[str, torch.Tensor]], hashers: Sequence[RowHasher]) -> str:
    """The model hash from each tensor's row digests."""
    h = hashlib.blake2b(digest_size=16)
    for (name, tensor), hasher in zip(named, hashers):
        h.update(f"{name}|{str(tensor.dtype).removeprefix('torch.')}|{list(tensor.shape)}|".encode())
        h.update(hasher.sums.cpu().numpy().astype("<i8", copy=False).tobytes())
        h.update(hasher.tail())
    return h.hexdigest()


def model_hash(named: Sequence[tuple[str, torch.Tensor]], pool: WorkerPool | None = None) -> str:
    """Hex digest of the tensors' names, dtypes, shapes and bytes (parallel over ``pool``'s workers)."""
    hashers = [RowHasher(t) for _, t in named]
    tasks = [task for hasher in hashers for task in hasher.tasks()]
    if pool is not None:
        pool.run(tasks)
    else:
        for task in tasks:
            task(None)
    return combine(named, hashers)
