"""A payload read from the run's store (host/placed.py): parts in order, a part not written yet waited for, a busy
store asked again, and what cannot be read broken off (the host then asks the coordinator for the bytes)."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import requests

from lightning_nodeox.core.protocol import TransferBroken, read_fully
from lightning_nodeox.host import placed
from lightning_nodeox.host.placed import PlacedStream


class Parts(BaseHTTPRequestHandler):
    """Serves ``objects`` (path -> bytes); ``answers`` (path -> statuses) are given first, one a request."""

    objects: dict[str, bytes] = {}
    answers: dict[str, list[int]] = {}
    asked: list[str] = []

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.asked.append(self.path)
        queued = self.answers.get(self.path)
        status = queued.pop(0) if queued else (200 if self.path in self.objects else 404)
        body = self.objects[self.path] if status == 200 else b"<Error><Code>SlowDown</Code></Error>"
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def server():
    Parts.objects, Parts.answers, Parts.asked = {}, {}, []
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Parts)
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def place(url: str, sizes: dict[str, int], within: float = 5.0) -> dict:
    return {"size": sum(sizes.values()), "within": within,
            "parts": [{"url": f"{url}{path}", "size": size} for path, size in sizes.items()]}


def read(stream: PlacedStream) -> bytes:
    buf = bytearray(stream.size)
    read_fully(stream, memoryview(buf))
    stream.close()
    return bytes(buf)


def test_the_parts_are_read_in_order_as_one_payload(server):
    Parts.objects = {"/a": b"head", "/b": b"piece-one", "/c": b"trailer"}
    broken = []
    stream = PlacedStream(place(server, {"/a": 4, "/b": 9, "/c": 7}), requests.Session(), broken.append)
    assert read(stream) == b"headpiece-onetrailer"
    assert broken == [] and Parts.asked == ["/a", "/b", "/c"]


def test_a_part_not_written_yet_is_asked_for_until_it_appears(server, monkeypatch):
    Parts.objects = {"/a": b"head"}
    waits = []

    def sleep(seconds: float) -> None:  # the part is written while the reader waits
        waits.append(seconds)
        if len(waits) == 3:
            Parts.objects["/b"] = b"late"

    monkeypatch.setattr(placed.time, "sleep", sleep)
    stream = PlacedStream(place(server, {"/a": 4, "/b": 4}), requests.Session(), lambda problem: None)
    assert read(stream) == b"headlate"
    assert Parts.asked.count("/b") == 4 and waits == [0.05, 0.1, 0.2]  # backoff, doubling


def test_a_busy_store_is_asked_again(server, monkeypatch):
    monkeypatch.setattr(placed.time, "sleep", lambda s: None)
    Parts.objects, Parts.answers = {"/a": b"data"}, {"/a": [503, 503]}
    stream = PlacedStream(place(server, {"/a": 4}), requests.Session(), lambda problem: None)
    assert read(stream) == b"data" and Parts.asked == ["/a"] * 3


def test_a_refused_or_expired_url_breaks_the_transfer_and_says_so(server):
    Parts.objects, Parts.answers = {"/a": b"data"}, {"/a": [403]}
    broken = []
    stream = PlacedStream(place(server, {"/a": 4}), requests.Session(), broken.append)
    with pytest.raises(TransferBroken, match="HTTP 403"):
        read(stream)
    assert len(broken) == 1 and "403" in broken[0]


def test_a_part_of_the_wrong_size_breaks_the_transfer(server):
    Parts.objects = {"/a": b"data-and-more"}
    broken = []
    with pytest.raises(TransferBroken, match="13 bytes, not 4"):
        read(PlacedStream(place(server, {"/a": 4}), requests.Session(), broken.append))
    assert len(broken) == 1


def test_a_part_that_never_appears_breaks_the_transfer_after_its_time(server, monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(placed.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(placed.time, "sleep", lambda s: clock.__setitem__(0, clock[0] + s))
    broken = []
    with pytest.raises(TransferBroken, match="not in the store after 2 s"):
        read(PlacedStream(place(server, {"/a": 4}, within=2.0), requests.Session(), broken.append))
    assert len(broken) == 1


def test_parts_on_a_shared_filesystem_are_read_as_files(tmp_path):
    (tmp_path / "a").write_bytes(b"abc")
    (tmp_path / "b c").write_bytes(b"de")
    got = {"size": 5, "within": 1, "parts": [{"url": f"file://{tmp_path}/a", "size": 3},
                                             {"url": f"file://{tmp_path}/b%20c", "size": 2}]}
    assert read(PlacedStream(got, requests.Session(), lambda problem: None)) == b"abcde"


def test_parts_that_do_not_add_up_are_refused():
    with pytest.raises(TransferBroken, match="do not add up"):
        PlacedStream({"size": 5, "parts": [{"url": "file:///x", "size": 3}]}, requests.Session(), print)
