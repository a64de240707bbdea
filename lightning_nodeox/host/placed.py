"""A payload the coordinator placed in the run's store (:data:`~lightning_nodeox.core.protocol.PLACE`), read as a
:class:`~lightning_nodeox.core.protocol.ByteStream`: its parts in order, each from its URL (a presigned
``https://`` GET, a ``file://`` path on a shared filesystem, or an ``s3://`` address read with this host's own
credentials). A part not written yet (the coordinator writes a sync's pieces as it makes them) is asked for again
until ``within`` seconds pass; a store that is busy (5xx, SlowDown) is asked again with backoff within the same
time. What cannot be read (a refused or expired URL, a part of the wrong size, the time passed) breaks the
transfer (:class:`~lightning_nodeox.core.protocol.TransferBroken`) and calls ``broken``: the host then asks the
coordinator for the bytes themselves. The pieces' CRCs and the model hash are checked by the reader, as for a
payload the coordinator sends."""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable, Iterator
from urllib.parse import unquote, urlsplit

import requests
from urllib3.exceptions import HTTPError as Urllib3Error

from ..core.protocol import TransferBroken

log = logging.getLogger(__name__)

READ_CHUNK = 8 << 20
FIRST_DELAY, MAX_DELAY = 0.05, 1.0  # seconds between asks for a part not written yet (doubling)


class PlacedStream:
    """The parts of ``place`` (``{"size", "within", "parts": [{"url", "size"}]}``) read in order."""

    def __init__(self, place: dict, session: requests.Session, broken: Callable[[str], None],
                 timeout: tuple[float, float] = (5.0, 60.0)) -> None:
        self.size = int(place["size"])
        self.parts = [(str(p["url"]), int(p["size"])) for p in place["parts"]]
        if sum(size for _, size in self.parts) != self.size:
            raise TransferBroken("the store's parts do not add up to the payload's size")
        self.within = float(place.get("within", 60.0))
        self._session = session
        self._broken = broken
        self._timeout = timeout
        self._next = 0  # the next part to open
        self._reader: _PartReader | None = None

    def readinto(self, view: memoryview) -> int:
        while self._reader is None or self._reader.left == 0:
            if self._reader is not None:
                self._reader.close()
                self._reader = None
            if self._next == len(self.parts):
                return 0
            self._reader = self._open(*self.parts[self._next])
            self._next += 1
        try:
            return self._reader.readinto(view)
        except TransferBroken as e:
            self._broken(str(e))
            raise

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = None

    def _open(self, url: str, size: int) -> _PartReader:
        scheme = urlsplit(url).scheme
        opener = {"http": self._open_http, "https": self._open_http, "file": _open_file, "s3": _open_s3}.get(scheme)
        if opener is None:
            raise TransferBroken(f"the store's part URL has an unknown scheme: {url[:60]}")
        deadline, delay = time.monotonic() + self.within, FIRST_DELAY
        while True:
            try:
                chunks = opener(url, size)
            except _NotYet as e:
                if time.monotonic() + delay > deadline:
                    problem = f"a part of the payload was not in the store after {self.within:.0f} s ({e})"
                    self._broken(problem)
                    raise TransferBroken(problem) from None
                time.sleep(delay)
                delay = min(delay * 2, MAX_DELAY)
                continue
            except TransferBroken as e:
                self._broken(str(e))
                raise
            return _PartReader(chunks, size)

    def _open_http(self, url: str, size: int) -> Iterator[bytes]:
        try:
            response = self._session.get(url, stream=True, timeout=self._timeout)
        except requests.RequestException as e:
            raise _NotYet(f"{type(e).__name__}: {e}") from None
        if response.status_code == 404 or response.status_code >= 500:
            response.close()
            raise _NotYet(f"HTTP {response.status_code}")
        if response.status_code != 200:
            response.close()
            raise TransferBroken(f"the store refused a part: HTTP {response.status_code} (an expired or refused "
                                 "URL)")
        got = int(response.headers.get("Content-Length", -1))
        if got != size:
            response.close()
            raise TransferBroken(f"a part in the store has {got} bytes, not {size}")
        return _http_chunks(response)


class _NotYet(Exception):
    """The part is not there yet (or the store is busy): ask again."""


class _PartReader:
    """One part's bytes from an iterator of chunks, ``size`` of them exactly."""

    def __init__(self, chunks: Iterator[bytes], size: int) -> None:
        self._chunks = chunks
        self.left = size
        self._pending = memoryview(b"")

    def readinto(self, view: memoryview) -> int:
        if not self._pending:
            try:
                self._pending = memoryview(next(self._chunks))
            except StopIteration:
                raise TransferBroken(f"a part in the store ended {self.left} bytes early") from None
        n = min(len(view), len(self._pending), self.left)
        view[:n] = self._pending[:n]
        self._pending = self._pending[n:]
        self.left -= n
        return n

    def close(self) -> None:
        close = getattr(self._chunks, "close", None)
        if close is not None:
            close()


def _http_chunks(response: requests.Response) -> Iterator[bytes]:
    try:
        while data := response.raw.read(READ_CHUNK):
            yield data
    except (OSError, requests.RequestException, Urllib3Error) as e:
        raise TransferBroken(f"a read from the store broke off: {e}") from None
    finally:
        response.close()


def _open_file(url: str, size: int) -> Iterator[bytes]:
    path = unquote(urlsplit(url).path)
    try:
        f = open(path, "rb")  # noqa: SIM115 - closed by the generator
    except FileNotFoundError:
        raise _NotYet(f"{path} does not exist yet") from None
    except OSError as e:
        raise TransferBroken(f"cannot read {path}: {e}") from None
    return _file_chunks(f)


def _file_chunks(f) -> Iterator[bytes]:
    with f:
        while data := f.read(READ_CHUNK):
            yield data


def _open_s3(url: str, size: int) -> Iterator[bytes]:
    from ..core.stores import StoreError, StoreMissing

    store, key = _s3_object(url)
    chunks = store.stream(key, READ_CHUNK)
    try:
        first = next(chunks)
    except StopIteration:
        return iter(())
    except StoreMissing as e:
        raise _NotYet(str(e)) from None
    except StoreError as e:
        raise TransferBroken(f"cannot read {url}: {e}") from None
    return _prepend(first, chunks)


def _prepend(first: bytes, rest: Iterator[bytes]) -> Iterator[bytes]:
    from ..core.stores import StoreError

    yield first
    try:
        yield from rest
    except StoreError as e:
        raise TransferBroken(f"a read from the store broke off: {e}") from None


def _s3_object(url: str):
    """The store of an ``s3://bucket/key`` address's bucket (read and written with this host's own credentials),
    and its key."""
    parts = urlsplit(url)
    try:
        return _bucket(parts.netloc), unquote(parts.path.lstrip("/"))
    except ValueError as e:  # the store extra is not installed here
        raise TransferBroken(str(e)) from None


@functools.lru_cache(maxsize=8)
def _bucket(bucket: str):
    """The store of ``bucket`` (one client per bucket, reused)."""
    from ..core.stores import open_store

    return open_store(f"s3://{bucket}")


def write_part(session: requests.Session, url: str, data: bytes, timeout: tuple[float, float] = (5.0, 60.0),
               tries: int = 4) -> None:
    """Write one part of a delta where the coordinator placed it (``--store-deltas``): a presigned PUT (a busy
    store asked again, up to ``tries`` times), a file on the shared filesystem (a temporary name, then renamed),
    or an ``s3://`` address with this host's own credentials. :class:`TransferBroken` when it cannot be written."""
    scheme = urlsplit(url).scheme
    if scheme == "file":
        path = unquote(urlsplit(url).path)
        tmp = f"{path}.{os.getpid()}.part"
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except OSError as e:
            raise TransferBroken(f"cannot write {path}: {e}") from None
        return
    if scheme == "s3":
        from ..core.stores import StoreError

        store, key = _s3_object(url)
        try:
            store.put(key, [data])
        except StoreError as e:
            raise TransferBroken(f"cannot write {url}: {e}") from None
        return
    if scheme not in ("http", "https"):
        raise TransferBroken(f"the store's part URL has an unknown scheme: {url[:60]}")
    delay, problem = FIRST_DELAY, ""
    for _ in range(tries):
        try:
            response = session.put(url, data=data, timeout=timeout)
        except requests.RequestException as e:
            problem = f"{type(e).__name__}: {e}"
        else:
            response.close()
            if response.status_code == 200:
                return
            problem = f"HTTP {response.status_code}"
            if response.status_code < 500:
                break
        time.sleep(delay)
        delay = min(delay * 4, MAX_DELAY)
    raise TransferBroken(f"the store refused a part of the delta: {problem}")
