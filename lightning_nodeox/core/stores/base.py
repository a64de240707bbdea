"""What a run's object store must offer (:mod:`lightning_nodeox.core.stores`): objects written whole, read whole or
streamed, written only if absent or only if unchanged (the coordinator's lease), and a location a host reads an
object at with no credentials of its own. One module per kind of store implements it: ``file://`` (a shared
filesystem) in :mod:`.filestore`, ``s3://`` (any S3-compatible service) in :mod:`.s3store`.

Keys are relative (``syncs/12/part-3``); a store puts them under its URL's prefix.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Protocol


class StoreError(Exception):
    """The store refused or failed an operation; the message names the fix where there is one."""


class StoreMissing(StoreError):
    """The object does not exist (not yet written, or deleted)."""


class StoreUnavailable(StoreError):
    """The store cannot be reached, or keeps failing (after the client's own retries)."""


class ObjectWriter(Protocol):
    """An object written in order, a chunk at a time (a multipart upload, or a temporary file); readers see none
    of it until :meth:`commit`, then all of it."""

    def write(self, data: bytes | memoryview) -> None: ...

    def commit(self) -> int:
        """Make the object visible whole; returns its size."""

    def abort(self) -> None:
        """Drop what was written (nothing becomes visible)."""


class Store(Protocol):
    """A run's object store. Every call may raise :class:`StoreUnavailable`; reads of an absent object raise
    :class:`StoreMissing`."""

    url: str  # as given (s3://bucket/prefix, file:///path)

    def check(self) -> None:
        """Raise :class:`StoreError` naming the fix when this store cannot be used (no such bucket or folder,
        credentials refused, not writable); writes and deletes one small object to find out."""

    def writer(self, key: str) -> ObjectWriter:
        """Write ``key`` a chunk at a time."""

    def put(self, key: str, chunks: Iterable[bytes | memoryview]) -> int:
        """Write ``key`` whole from ``chunks``; returns its size."""

    def get(self, key: str) -> bytes:
        """The object whole (small objects)."""

    def stream(self, key: str, chunk: int = 8 << 20) -> Iterator[bytes]:
        """The object's bytes, in chunks of at most ``chunk``."""

    def size(self, key: str) -> int:
        """The object's size in bytes."""

    def keys(self, prefix: str = "") -> list[str]:
        """The keys under ``prefix``, sorted."""

    def delete(self, keys: Iterable[str]) -> None:
        """Delete ``keys`` (absent ones are no error)."""

    def get_tagged(self, key: str) -> tuple[bytes, str]:
        """The object and its tag (an ETag: changes whenever the object is written)."""

    def create(self, key: str, data: bytes) -> str | None:
        """Write ``key`` only if it does not exist: its tag, or None when it exists (nothing written)."""

    def replace(self, key: str, data: bytes, tag: str) -> str | None:
        """Write ``key`` only if its tag is still ``tag``: the new tag, or None when it changed or is gone."""

    def location(self, key: str, seconds: float) -> str:
        """A URL a host reads ``key`` at for ``seconds`` with no credentials of its own: an ``https://`` (or
        ``http://``) presigned GET, or a ``file://`` path on the shared filesystem."""

    def upload_location(self, key: str, seconds: float) -> str:
        """A URL a host writes ``key`` at for ``seconds`` with no credentials of its own (one PUT of the whole
        object: a presigned PUT, or a ``file://`` path on the shared filesystem)."""

    def address(self, key: str) -> str:
        """The object's own address (``s3://bucket/prefix/key``, ``file:///path/key``), read with the reader's own
        credentials."""


def write_whole(writer: ObjectWriter, chunks: Iterable[bytes | memoryview]) -> int:
    """Write ``chunks`` through ``writer`` and commit (abort on any error); returns the object's size."""
    try:
        for chunk in chunks:
            writer.write(chunk)
    except BaseException:
        writer.abort()
        raise
    return writer.commit()
