"""A store on a folder every machine of the run mounts (``file:///path``: NFS, Lustre, a local disk for one
machine). Objects are files, written under a temporary name and renamed, so a reader sees none or all of one.
Conditional writes hold a POSIX lock (``fcntl.lockf``) on the object's ``.lock`` file while they compare and
write: safe on a local filesystem and on NFSv4 or Lustre mounted with locking (``-o flock``), not on a filesystem
that ignores locks. POSIX locks belong to a process, so threads of one process also take a lock of their own."""

from __future__ import annotations

import fcntl
import hashlib
import os
import threading
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path
from urllib.parse import quote

from .base import StoreError, StoreMissing, StoreUnavailable, write_whole

LOCK_SUFFIX = ".lock"
TMP_SUFFIX = ".part"


class FileWriter:
    """An object written to a temporary file, renamed into place by :meth:`commit`."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.tmp = path.with_name(f"{path.name}.{uuid.uuid4().hex[:8]}{TMP_SUFFIX}")
        self.file = open(self.tmp, "wb")
        self.size = 0

    def write(self, data: bytes | memoryview) -> None:
        try:
            self.size += self.file.write(data)
        except OSError as e:
            raise StoreUnavailable(f"cannot write {self.path}: {e}") from None

    def commit(self) -> int:
        try:
            self.file.flush()
            os.fsync(self.file.fileno())
            self.file.close()
            os.replace(self.tmp, self.path)
        except OSError as e:
            raise StoreUnavailable(f"cannot write {self.path}: {e}") from None
        return self.size

    def abort(self) -> None:
        self.file.close()
        self.tmp.unlink(missing_ok=True)


class FileStore:
    """Objects as files under ``root``."""

    def __init__(self, url: str, root: str) -> None:
        self.url = url
        self.root = Path(root)

    def _path(self, key: str) -> Path:
        if not key or key.startswith("/") or ".." in key.split("/"):
            raise StoreError(f"invalid object key {key!r}")
        return self.root / key

    def check(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            probe = f".nodeox-check-{uuid.uuid4().hex[:8]}"
            self.put(probe, [b"ok"])
            self.delete([probe])
        except (OSError, StoreError) as e:
            raise StoreError(f"--store {self.url}: cannot write to {self.root} ({e}); give a folder this user may "
                             "write to, on a filesystem every machine of the run mounts") from None

    def writer(self, key: str) -> FileWriter:
        try:
            return FileWriter(self._path(key))
        except OSError as e:
            raise StoreUnavailable(f"cannot write {self.address(key)}: {e}") from None

    def put(self, key: str, chunks: Iterable[bytes | memoryview]) -> int:
        return write_whole(self.writer(key), chunks)  # a temporary name of its own: puts of one key never collide

    def get(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            raise StoreMissing(f"{self.address(key)} does not exist") from None

    def stream(self, key: str, chunk: int = 8 << 20) -> Iterator[bytes]:
        try:
            f = open(self._path(key), "rb")
        except FileNotFoundError:
            raise StoreMissing(f"{self.address(key)} does not exist") from None
        with f:
            while data := f.read(chunk):
                yield data

    def size(self, key: str) -> int:
        try:
            return self._path(key).stat().st_size
        except FileNotFoundError:
            raise StoreMissing(f"{self.address(key)} does not exist") from None

    def keys(self, prefix: str = "") -> list[str]:
        if not self.root.is_dir():
            return []
        found = []
        for dirpath, _, files in os.walk(self.root):
            for name in files:
                if name.endswith((LOCK_SUFFIX, TMP_SUFFIX)):
                    continue
                key = os.path.relpath(os.path.join(dirpath, name), self.root).replace(os.sep, "/")
                if key.startswith(prefix):
                    found.append(key)
        return sorted(found)

    def delete(self, keys: Iterable[str]) -> None:
        try:
            for key in keys:
                self._path(key).unlink(missing_ok=True)
        except OSError as e:
            raise StoreUnavailable(f"cannot delete from {self.root}: {e}") from None

    def get_tagged(self, key: str) -> tuple[bytes, str]:
        data = self.get(key)
        return data, _tag(data)

    def create(self, key: str, data: bytes) -> str | None:
        with self._locked(key):
            if self._path(key).exists():
                return None
            self.put(key, [data])
        return _tag(data)

    def replace(self, key: str, data: bytes, tag: str) -> str | None:
        with self._locked(key):
            try:
                if _tag(self.get(key)) != tag:
                    return None
            except StoreMissing:
                return None
            self.put(key, [data])
        return _tag(data)

    def _locked(self, key: str):
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        return _Lock(path.with_name(path.name + LOCK_SUFFIX))

    def location(self, key: str, seconds: float) -> str:
        return self.address(key)

    def upload_location(self, key: str, seconds: float) -> str:
        return self.address(key)

    def address(self, key: str) -> str:
        return "file://" + quote(str(self._path(key)))


class _Lock:
    """An exclusive lock on ``path`` for the length of a ``with``: a thread lock among this process's threads, then
    a POSIX lock among processes."""

    _threads: dict[Path, threading.Lock] = {}
    _threads_lock = threading.Lock()

    def __init__(self, path: Path) -> None:
        self.path = path
        with _Lock._threads_lock:
            self.thread_lock = _Lock._threads.setdefault(path, threading.Lock())

    def __enter__(self) -> None:
        self.thread_lock.acquire()
        try:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.lockf(self.fd, fcntl.LOCK_EX)
        except BaseException:
            self.thread_lock.release()
            raise

    def __exit__(self, *exc) -> None:
        try:
            fcntl.lockf(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
        finally:
            self.thread_lock.release()


def _tag(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:32]
