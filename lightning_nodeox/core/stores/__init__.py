"""A run's object store (``--store URL``): where the coordinator puts each round's sync and the model once, for
every host to read, and a copy of the run's state that outlives its machine. See :mod:`.base` for the interface.

- ``s3://bucket/prefix``: any S3-compatible service (AWS S3, R2, GCS's S3 API, MinIO, Ceph) through boto3 (the
  ``store`` extra); credentials and the endpoint the usual way (``AWS_*`` variables, a profile, an instance role;
  ``AWS_ENDPOINT_URL`` for a service other than AWS).
- ``file:///path``: a folder on a filesystem every machine of the run mounts (NFS, Lustre).
"""

from __future__ import annotations

from urllib.parse import urlsplit

from .base import ObjectWriter, Store, StoreError, StoreMissing, StoreUnavailable

__all__ = ["ObjectWriter", "Store", "StoreError", "StoreMissing", "StoreUnavailable", "open_store"]

EXTRA = 'pip install "lightning-nodeox[store]"'


def open_store(url: str) -> Store:
    """The store at ``url``; a ValueError naming the fix for a URL of no known kind, or an s3:// URL without the
    client installed."""
    parts = urlsplit(url)
    if parts.scheme == "file":
        from .filestore import FileStore

        if parts.netloc not in ("", "localhost") or not parts.path.startswith("/"):
            raise ValueError(f"--store {url}: a file store is file:///absolute/path (three slashes)")
        return FileStore(url, parts.path)
    if parts.scheme == "s3":
        try:
            from .s3store import S3Store
        except ImportError:
            raise ValueError(f"--store {url} needs the S3 client: {EXTRA}") from None
        if not parts.netloc:
            raise ValueError(f"--store {url}: an S3 store is s3://bucket or s3://bucket/prefix")
        return S3Store(url, parts.netloc, parts.path.strip("/"))
    raise ValueError(f"--store {url}: the store's URL starts with s3:// (any S3-compatible service) or file:/// (a "
                     "shared filesystem)")
