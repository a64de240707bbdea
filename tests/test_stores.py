"""The run's object store (lightning_nodeox/core/stores): the same rules for the file store (a folder) and the S3
store (moto's S3 in a thread, tests/s3server.py), then the S3 store's own: check()'s errors naming the fix, and
throttling (503 SlowDown) retried."""

from __future__ import annotations

import http.client
import http.server
import os
import socket
import threading
import time
from collections.abc import Iterator
from urllib.parse import unquote, urlsplit

import pytest
import requests
from s3server import S3Server, new_bucket, use

from lightning_nodeox.core.stores import Store, StoreError, StoreMissing, StoreUnavailable, open_store

MiB = 1 << 20


@pytest.fixture(params=["file", "s3"])
def store(request, tmp_path) -> Store:
    if request.param == "file":
        return open_store(f"file://{tmp_path}/run")
    return open_store(request.getfixturevalue("s3_url"))


def pattern(n: int, seed: int = 0) -> bytes:
    """``n`` bytes that differ from part to part (a part sent twice or out of order shows)."""
    block = bytes((i * 7 + seed) % 251 for i in range(251))
    return (block * (n // len(block) + 1))[:n]


def uploads(s3_server: S3Server, store: Store) -> list:
    """The store's bucket's multipart uploads in progress."""
    return s3_server.client.list_multipart_uploads(Bucket=store.bucket).get("Uploads", [])


def test_an_object_is_read_back_whole_streamed_and_sized(store):
    data = pattern(3 * MiB + 5)
    assert store.put("syncs/1/part-0", [data[:MiB], memoryview(data)[MiB:]]) == len(data)
    assert store.get("syncs/1/part-0") == data
    chunks = list(store.stream("syncs/1/part-0", chunk=MiB))
    assert b"".join(chunks) == data and max(map(len, chunks)) <= MiB
    assert store.size("syncs/1/part-0") == len(data)
    assert store.put("empty", []) == 0 and store.get("empty") == b""


def test_keys_are_relative_sorted_and_under_a_prefix(store):
    for key in ["syncs/2/b", "syncs/10/a", "model", "syncs/2/a"]:
        store.put(key, [key.encode()])
    assert store.keys() == ["model", "syncs/10/a", "syncs/2/a", "syncs/2/b"]
    assert store.keys("syncs/2/") == ["syncs/2/a", "syncs/2/b"]
    assert store.keys("nothing/") == []


def test_delete_removes_objects_and_ignores_absent_ones(store):
    store.put("a", [b"1"])
    store.put("b/c", [b"2"])
    store.delete(["a", "b/c", "never"])
    assert store.keys() == []
    store.delete([])


def test_reads_of_an_absent_object_raise_store_missing(store):
    for read in (store.get, store.size, store.get_tagged, lambda k: list(store.stream(k))):
        with pytest.raises(StoreMissing, match="gone"):
            read("gone")


def test_a_written_object_is_invisible_until_commit_then_whole(store, request):
    data = pattern(20 * MiB + 123, seed=3)
    w = store.writer("model")
    for i in range(0, len(data), 3 * MiB):  # writes that do not line up with parts
        w.write(data[i:i + 3 * MiB])
    assert store.keys() == []
    with pytest.raises(StoreMissing):
        store.get("model")
    if store.url.startswith("s3://"):
        assert [u["Key"] for u in uploads(request.getfixturevalue("s3_server"), store)] == ["run/model"]
    assert w.commit() == len(data)
    assert store.get("model") == data
    assert store.size("model") == len(data)
    assert store.keys() == ["model"]


def test_an_object_smaller_than_a_part_is_written_at_commit(store, request):
    w = store.writer("small")
    w.write(b"abc")
    w.write(memoryview(b"def"))
    assert store.keys() == []
    assert w.commit() == 6 and store.get("small") == b"abcdef"
    if store.url.startswith("s3://"):
        assert uploads(request.getfixturevalue("s3_server"), store) == []


def test_an_aborted_object_leaves_nothing_behind(store, request):
    w = store.writer("model")
    w.write(pattern(17 * MiB))
    w.abort()
    assert store.keys() == []
    with pytest.raises(StoreMissing):
        store.get("model")
    if store.url.startswith("s3://"):
        assert uploads(request.getfixturevalue("s3_server"), store) == []
    else:
        assert [f for _, _, files in os.walk(store.root) for f in files] == []  # no temporary file either


def test_create_writes_only_an_absent_object(store):
    tag = store.create("lease", b"first")
    assert tag is not None
    assert store.create("lease", b"second") is None
    assert store.get_tagged("lease") == (b"first", tag)


def test_replace_writes_only_while_the_tag_is_unchanged(store):
    tag = store.create("lease", b"1")
    new = store.replace("lease", b"2", tag)
    assert new is not None and new != tag
    assert store.replace("lease", b"3", tag) is None  # an old tag: someone else wrote since
    assert store.get_tagged("lease") == (b"2", new)
    assert store.replace("absent", b"x", new) is None
    assert store.keys() == ["lease"]


def test_of_racing_creates_exactly_one_wins(store):
    threads = 8
    start = threading.Barrier(threads)
    tags: list[str | None] = [None] * threads

    def create(i: int) -> None:
        start.wait()
        tags[i] = store.create("lease", b"host-%d" % i)

    runners = [threading.Thread(target=create, args=(i,)) for i in range(threads)]
    for t in runners:
        t.start()
    for t in runners:
        t.join()
    winners = [i for i, tag in enumerate(tags) if tag is not None]
    assert len(winners) == 1
    assert store.get_tagged("lease") == (b"host-%d" % winners[0], tags[winners[0]])


def test_a_location_is_read_with_no_credentials(store):
    data = pattern(1000)
    store.put("syncs/3/part 1", [data])
    url = store.location("syncs/3/part 1", 60)
    if store.url.startswith("s3://"):
        assert url.startswith("http://127.0.0.1:") and "X-Amz-Signature=" in url
        reply = requests.get(url, timeout=10)
        assert reply.status_code == 200 and reply.content == data
    else:
        assert url == store.address("syncs/3/part 1")
        with open(unquote(urlsplit(url).path), "rb") as f:
            assert f.read() == data


def test_an_address_names_the_object_under_the_prefix(store, tmp_path):
    if store.url.startswith("s3://"):
        assert store.address("syncs/1/a") == f"s3://{store.bucket}/run/syncs/1/a"
    else:
        assert store.address("syncs/1/a") == f"file://{tmp_path}/run/syncs/1/a"


def test_check_passes_on_a_usable_store_and_leaves_nothing(store):
    store.check()
    assert store.keys() == []


@pytest.mark.parametrize("key", ["", "/abs", "a/../b"])
def test_a_key_that_escapes_the_prefix_is_refused(store, key):
    with pytest.raises(StoreError, match="invalid object key"):
        store.put(key, [b"x"])


# The S3 store's own


def test_check_names_the_fix_for_a_missing_bucket(s3_url):
    with pytest.raises(StoreError, match=r"create it: aws s3 mb s3://no-such-bucket, or fix --store"):
        open_store("s3://no-such-bucket/run").check()


def test_check_names_the_endpoint_variable_when_it_cannot_connect(s3_url, monkeypatch):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    monkeypatch.setenv("AWS_ENDPOINT_URL", closed)
    began = time.monotonic()
    with pytest.raises(StoreUnavailable, match=f"cannot reach the S3 endpoint {closed}.*set AWS_ENDPOINT_URL"):
        open_store(s3_url).check()
    assert time.monotonic() - began < 15


def test_check_names_the_credential_settings_when_credentials_are_refused(s3_url, monkeypatch):
    import moto.settings

    monkeypatch.setattr(moto.settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)  # moto checks keys against its IAM
    with pytest.raises(StoreError, match="refused these credentials") as e:
        open_store(s3_url).check()
    for fix in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE", "instance role"):
        assert fix in str(e.value)


def test_check_names_the_credential_settings_when_there_are_none(s3_url, monkeypatch):
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(StoreError, match="no AWS credentials found") as e:
        open_store(s3_url).check()
    for fix in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE", "instance role"):
        assert fix in str(e.value)


def test_an_operation_on_a_missing_bucket_names_the_fix(s3_url):
    with pytest.raises(StoreError, match="create it: aws s3 mb s3://no-such-bucket"):
        open_store("s3://no-such-bucket/run").put("a", [b"x"])


class SlowDown(http.server.ThreadingHTTPServer):
    """An HTTP proxy in front of the S3 server that answers its first ``refusals`` requests with 503 SlowDown (as
    S3 does when throttling), then forwards each request as it is."""

    SLOW_DOWN = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
                 b"<Message>Please reduce your request rate.</Message></Error>")

    def __init__(self, upstream: str, refusals: int) -> None:
        self.upstream = urlsplit(upstream).netloc
        self.refusals = refusals
        self.refused = 0
        self.forwarded = 0
        self.lock = threading.Lock()
        super().__init__(("127.0.0.1", 0), Relay)
        self.endpoint = f"http://127.0.0.1:{self.server_port}"
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.shutdown()
        self.server_close()


class Relay(http.server.BaseHTTPRequestHandler):
    server: SlowDown
    protocol_version = "HTTP/1.1"  # answers botocore's Expect: 100-continue at once (1.0 leaves it waiting 1 s)

    def log_message(self, *args) -> None:
        pass

    def relay(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        with self.server.lock:
            refuse = self.server.refused < self.server.refusals
            self.server.refused += refuse
            self.server.forwarded += not refuse
        if refuse:
            self.send_response(503)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(SlowDown.SLOW_DOWN)))
            self.end_headers()
            self.wfile.write(SlowDown.SLOW_DOWN)
            return
        upstream = http.client.HTTPConnection(self.server.upstream, timeout=30)
        upstream.request(self.command, self.path, body=body, headers=dict(self.headers))
        reply = upstream.getresponse()
        data = reply.read()
        self.send_response(reply.status)
        for name, value in reply.getheaders():
            if name.lower() not in ("transfer-encoding", "connection", "content-length", "server", "date"):
                self.send_header(name, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)
        upstream.close()

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = relay


@pytest.fixture
def slow_down(s3_server, monkeypatch) -> Iterator:
    """``slow_down(refusals)``: an S3 store on a fresh bucket, reached through a :class:`SlowDown` proxy."""
    proxies: list[SlowDown] = []

    def start(refusals: int):
        bucket = new_bucket(s3_server)
        proxies.append(proxy := SlowDown(s3_server.endpoint, refusals))
        use(s3_server, monkeypatch, proxy.endpoint)
        return open_store(f"s3://{bucket}/run"), proxy

    yield start
    for p in proxies:
        p.stop()


def test_a_throttled_write_is_retried_until_it_succeeds(slow_down):
    store, proxy = slow_down(2)
    assert store.put("model", [b"weights"]) == 7
    assert (proxy.refused, proxy.forwarded) == (2, 1)
    assert store.get("model") == b"weights"


def test_a_store_that_keeps_throttling_is_unavailable_after_the_clients_retries(slow_down, monkeypatch):
    from botocore.retries.standard import ExponentialBackoff

    monkeypatch.setattr(ExponentialBackoff, "delay_amount", lambda self, context: 0)  # the same tries, no waits
    store, proxy = slow_down(1000)
    with pytest.raises(StoreUnavailable, match=f"the S3 endpoint {proxy.endpoint} failed.*AWS_ENDPOINT_URL"):
        store.put("model", [b"weights"])
    assert (proxy.refused, proxy.forwarded) == (9, 0)  # botocore's max_attempts 8 counts retries: 9 tries
