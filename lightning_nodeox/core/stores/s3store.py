"""A store on any S3-compatible service (``s3://bucket/prefix``: AWS S3, R2, GCS's S3 API, MinIO, Ceph) through
boto3. The endpoint and credentials are found as every other AWS tool finds them: ``AWS_ENDPOINT_URL`` for a
service other than AWS, then ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE``, or an instance role;
nothing of ours is written to disk. The client retries throttling (503 SlowDown) and 5xx replies with backoff
(botocore's ``standard`` mode); what still fails is :class:`StoreUnavailable`.

Objects are written as multipart uploads, a part at a time (readers see nothing until the upload completes), or
one ``put_object`` when smaller than one part. Conditional writes are S3's own: ``If-None-Match: *`` and
``If-Match: <etag>``."""

from __future__ import annotations

import uuid
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError, HTTPClientError, NoCredentialsError
from botocore.exceptions import ConnectionError as BotoConnectionError

from .base import StoreError, StoreMissing, StoreUnavailable, write_whole

PART = 8 << 20  # a multipart upload's part (S3's least is 5 MiB, except the last)
PARTS_PER_STEP = 1000  # each 1000 parts the part grows by PART: S3's 10000 parts then hold 440 GiB
PARTS_IN_FLIGHT = 4  # parts of one object uploaded at once
MAX_PRESIGN = 7 * 24 * 3600  # SigV4's longest presigned URL
DELETE_BATCH = 1000  # delete_objects' most keys per call

# botocore's ``max_attempts`` counts retries: 9 tries, waits of up to 1, 2, 4, 8, 16, 20... s between them.
# SigV4 everywhere: botocore may presign with SigV2, which R2, newer AWS regions and others refuse
CLIENT = Config(retries={"mode": "standard", "max_attempts": 8}, connect_timeout=5, read_timeout=60,
                max_pool_connections=32, signature_version="s3v4")
# check() must answer within ~15 s when the endpoint is unreachable (2 tries of 4 s), not after minutes of retries
CHECK_CLIENT = Config(retries={"mode": "standard", "max_attempts": 1}, connect_timeout=4, read_timeout=5,
                      signature_version="s3v4")

MISSING = {"NoSuchKey", "404", "NotFound"}
CONFLICT = {"PreconditionFailed", "412", "ConditionalRequestConflict", "409"}
REFUSED = {"403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken", "ExpiredToken",
           "InvalidClientTokenId"}
CREDENTIALS_FIX = ("set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN for temporary ones), or "
                   "AWS_PROFILE, or give the machine an instance role, allowed s3:ListBucket, s3:GetObject, "
                   "s3:PutObject, s3:DeleteObject and s3:AbortMultipartUpload on the bucket")


def _code(e: ClientError) -> str:
    return str(e.response.get("Error", {}).get("Code", ""))


def _status(e: ClientError) -> int:
    return int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0))


class S3Writer:
    """An object written as a multipart upload begun at its first full part, or one ``put_object`` at
    :meth:`commit` when it never fills one. Up to :data:`PARTS_IN_FLIGHT` parts go up at once (a link's round
    trips overlap), so at most that many parts are held beyond the one being filled."""

    def __init__(self, store: S3Store, key: str) -> None:
        self.store = store
        self.key = key
        self.buffer = bytearray()
        self.upload: str | None = None
        self.sending: list[Future] = []  # each part's upload, in order; its result {"PartNumber", "ETag"}
        self.size = 0
        self.done = False

    def _part_size(self) -> int:
        return PART * (1 + len(self.sending) // PARTS_PER_STEP)

    def write(self, data: bytes | memoryview) -> None:
        if self.done:
            raise StoreError(f"{self.store.address(self.key)}: written after commit() or abort()")
        self.buffer += data
        self.size += len(data)
        sent = 0
        with memoryview(self.buffer) as view:
            while len(view) - sent >= (part := self._part_size()):
                self._send(bytes(view[sent:sent + part]))
                sent += part
        del self.buffer[:sent]

    def _send(self, data: bytes) -> None:
        s = self.store
        if self.upload is None:
            with s._errors(self.key):
                self.upload = s.client.create_multipart_upload(Bucket=s.bucket, Key=s._key(self.key))["UploadId"]
        in_flight = [f for f in self.sending if not f.done()]
        if len(in_flight) >= PARTS_IN_FLIGHT:
            wait(in_flight, return_when=FIRST_COMPLETED)
        for f in self.sending:  # a part that failed fails the write now
            if f.done():
                f.result()
        self.sending.append(s.senders.submit(self._part, len(self.sending) + 1, data))

    def _part(self, number: int, data: bytes) -> dict:
        s = self.store
        with s._errors(self.key):
            reply = s.client.upload_part(Bucket=s.bucket, Key=s._key(self.key), UploadId=self.upload,
                                         PartNumber=number, Body=data)
        return {"PartNumber": number, "ETag": reply["ETag"]}

    def commit(self) -> int:
        if self.done:
            raise StoreError(f"{self.store.address(self.key)}: committed after commit() or abort()")
        s = self.store
        try:
            if self.upload is None:
                with s._errors(self.key):
                    s.client.put_object(Bucket=s.bucket, Key=s._key(self.key), Body=bytes(self.buffer))
            else:
                if self.buffer:
                    self._send(bytes(self.buffer))
                parts = [f.result() for f in self.sending]
                with s._errors(self.key):
                    s.client.complete_multipart_upload(Bucket=s.bucket, Key=s._key(self.key), UploadId=self.upload,
                                                       MultipartUpload={"Parts": parts})
        except BaseException:
            try:
                self.abort()
            except StoreError:
                pass  # the commit's error says more; an upload left behind lasts until a lifecycle rule drops it
            raise
        self.done = True
        self.buffer = bytearray()
        return self.size

    def abort(self) -> None:
        self.done = True
        self.buffer = bytearray()
        wait(self.sending)  # (their errors do not matter now)
        if self.upload is not None:
            upload, self.upload = self.upload, None
            s = self.store
            with s._errors(self.key):
                s.client.abort_multipart_upload(Bucket=s.bucket, Key=s._key(self.key), UploadId=upload)


class S3Store:
    """Objects under ``prefix`` in ``bucket``, through one boto3 client (thread-safe; shared by all threads)."""

    def __init__(self, url: str, bucket: str, prefix: str) -> None:
        self.url = url
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.client = boto3.session.Session().client("s3", config=CLIENT)
        self.senders = ThreadPoolExecutor(PARTS_IN_FLIGHT * 2, thread_name_prefix="nodeox-store")  # writers' parts
        self.endpoint = self.client.meta.endpoint_url

    def _key(self, key: str) -> str:
        if not key or key.startswith("/") or ".." in key.split("/"):
            raise StoreError(f"invalid object key {key!r}")
        return f"{self.prefix}/{key}" if self.prefix else key

    def _unavailable(self, what: str, e: Exception) -> StoreUnavailable:
        return StoreUnavailable(f"{what}: the S3 endpoint {self.endpoint} failed ({e}); check that it is up and "
                                "reachable from this machine, and AWS_ENDPOINT_URL when the service is not AWS")

    @contextmanager
    def _errors(self, key: str | None = None) -> Iterator[None]:
        """Translate boto3's errors into the store's."""
        what = self.address(key) if key else self.url
        try:
            yield
        except ClientError as e:
            code, status = _code(e), _status(e)
            if code in MISSING:
                raise StoreMissing(f"{what} does not exist") from None
            if code == "NoSuchBucket":
                raise StoreError(f"{what}: {self._no_bucket()}") from None
            if code in REFUSED:
                raise StoreError(f"{what}: the S3 service refused these credentials ({code}); "
                                 f"{CREDENTIALS_FIX}") from None
            if status >= 500 or code in ("SlowDown", "Throttling", "RequestTimeout"):
                raise self._unavailable(what, e) from None
            raise StoreError(f"{what}: {e}") from None
        except NoCredentialsError:
            raise StoreError(f"{what}: no AWS credentials found; {CREDENTIALS_FIX}") from None
        except (BotoConnectionError, HTTPClientError) as e:
            raise self._unavailable(what, e) from None
        except BotoCoreError as e:
            raise StoreError(f"{what}: {e}") from None

    def _no_bucket(self) -> str:
        return (f"the bucket {self.bucket} does not exist at {self.endpoint}; create it: aws s3 mb s3://{self.bucket}, "
                "or fix --store (and AWS_ENDPOINT_URL when the service is not AWS)")

    def check(self) -> None:
        client = boto3.session.Session().client("s3", config=CHECK_CLIENT)
        try:
            client.head_bucket(Bucket=self.bucket)
        except ClientError as e:
            code = _code(e)
            if code in ("404", "NoSuchBucket", "NotFound"):
                raise StoreError(f"--store {self.url}: {self._no_bucket()}") from None
            if code in REFUSED:
                raise StoreError(f"--store {self.url}: the S3 service at {self.endpoint} refused these credentials "
                                 f"for s3://{self.bucket} ({code}); {CREDENTIALS_FIX} (or, when the bucket is another "
                                 "account's, fix --store)") from None
            raise StoreError(f"--store {self.url}: {e}") from None
        except NoCredentialsError:
            raise StoreError(f"--store {self.url}: no AWS credentials found; {CREDENTIALS_FIX}") from None
        except (BotoConnectionError, HTTPClientError) as e:
            raise StoreUnavailable(f"--store {self.url}: cannot reach the S3 endpoint {self.endpoint} ({e}); set "
                                   "AWS_ENDPOINT_URL to the service's address (when it is not AWS), and check that "
                                   "it is up and reachable from this machine") from None
        probe = self._key(f".nodeox-check-{uuid.uuid4().hex[:8]}")
        try:
            client.put_object(Bucket=self.bucket, Key=probe, Body=b"ok")
            client.delete_object(Bucket=self.bucket, Key=probe)
        except ClientError as e:
            code = _code(e)
            if code in REFUSED:
                raise StoreError(f"--store {self.url}: these credentials may not write to s3://{self.bucket} "
                                 f"({code}); {CREDENTIALS_FIX}") from None
            raise StoreError(f"--store {self.url}: a test write failed ({e})") from None
        except (BotoConnectionError, HTTPClientError) as e:
            raise StoreUnavailable(f"--store {self.url}: a test write to {self.endpoint} failed ({e})") from None

    def writer(self, key: str) -> S3Writer:
        self._key(key)
        return S3Writer(self, key)

    def put(self, key: str, chunks: Iterable[bytes | memoryview]) -> int:
        return write_whole(self.writer(key), chunks)

    def get(self, key: str) -> bytes:
        return self.get_tagged(key)[0]

    def stream(self, key: str, chunk: int = 8 << 20) -> Iterator[bytes]:
        with self._errors(key):
            body = self.client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"]
        with body, self._errors(key):
            yield from body.iter_chunks(chunk)

    def size(self, key: str) -> int:
        with self._errors(key):
            return int(self.client.head_object(Bucket=self.bucket, Key=self._key(key))["ContentLength"])

    def keys(self, prefix: str = "") -> list[str]:
        base = f"{self.prefix}/" if self.prefix else ""
        found = []
        with self._errors():
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket,
                                                                               Prefix=base + prefix):
                found += [o["Key"][len(base):] for o in page.get("Contents", ())]
        return sorted(found)

    def delete(self, keys: Iterable[str]) -> None:
        names = [self._key(k) for k in keys]
        for i in range(0, len(names), DELETE_BATCH):
            with self._errors():
                reply = self.client.delete_objects(Bucket=self.bucket, Delete={
                    "Objects": [{"Key": n} for n in names[i:i + DELETE_BATCH]], "Quiet": True})
            if failed := reply.get("Errors"):
                raise StoreError(f"{self.url}: {len(failed)} objects were not deleted, the first "
                                 f"{failed[0].get('Key')}: {failed[0].get('Code')} {failed[0].get('Message')}")

    def get_tagged(self, key: str) -> tuple[bytes, str]:
        with self._errors(key):
            reply = self.client.get_object(Bucket=self.bucket, Key=self._key(key))
            with reply["Body"] as body:
                return body.read(), reply["ETag"]

    def create(self, key: str, data: bytes) -> str | None:
        return self._conditional(key, data, IfNoneMatch="*")

    def replace(self, key: str, data: bytes, tag: str) -> str | None:
        return self._conditional(key, data, IfMatch=tag)

    def _conditional(self, key: str, data: bytes, **condition: str) -> str | None:
        try:
            with self._errors(key):
                try:
                    return self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data,
                                                  **condition)["ETag"]
                except ClientError as e:
                    if _code(e) in CONFLICT:
                        return None
                    raise
        except StoreMissing:  # If-Match on an object that is gone
            return None

    def location(self, key: str, seconds: float) -> str:
        """A presigned GET; S3 honours at most 7 days (longer is capped), and no longer than the credentials that
        sign it (an instance role's last hours)."""
        expires = max(1, min(int(seconds), MAX_PRESIGN))
        with self._errors(key):
            return self.client.generate_presigned_url("get_object", Params={"Bucket": self.bucket,
                                                                            "Key": self._key(key)},
                                                      ExpiresIn=expires)

    def upload_location(self, key: str, seconds: float) -> str:
        """A presigned PUT (capped as :meth:`location`)."""
        expires = max(1, min(int(seconds), MAX_PRESIGN))
        with self._errors(key):
            return self.client.generate_presigned_url("put_object", Params={"Bucket": self.bucket,
                                                                            "Key": self._key(key)},
                                                      ExpiresIn=expires)

    def address(self, key: str) -> str:
        return f"s3://{self.bucket}/{self._key(key)}"
