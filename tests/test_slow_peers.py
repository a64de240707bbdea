"""Slow and stuck peers cannot hold the coordinator: a trickling upload is cut at its time limit (and its host's
upload slot and buffer freed), a stalled model download never delays a round's close (and still delivers the
model it started with), and a round that cannot close says why."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import requests
import torch
from helpers import body_bytes, delta_message, model_file, raw_request

from lightning_nodeox.core.hashing import model_hash
from lightning_nodeox.core.modelfile import read_model
from lightning_nodeox.core.protocol import CREDENTIAL_HEADER, SyncReady, Upload
from lightning_nodeox.core.specs import spec_of
from lightning_nodeox.core.wire import Message
from lightning_nodeox.host.client import HttpClient
from lightning_nodeox.host.heartbeat import Heartbeat

pytestmark = pytest.mark.slow  # every test here starts processes


def delta(named, deltas, *, round_: int, host: str, base_hash: str) -> Message:
    return delta_message(deltas, round_=round_, host=host, base_hash=base_hash, samples=8, specs=spec_of(named))


def joined(url: str, named, hosts: str) -> tuple[list[HttpClient], str]:
    clients = [HttpClient(url, host=h, retry_for=20) for h in hosts]
    specs = [s.as_json() for s in spec_of(named)]
    clients[0].join(specs)
    initial = clients[0].put_model(memoryview(model_file(named)))
    for c in clients[1:]:
        c.join(specs)
    return clients, initial


def status(url: str) -> dict:
    return requests.get(f"{url}/v1/status", timeout=10).json()


def upload_begun(url: str) -> tuple[HttpClient, socket.socket, bytes]:
    """Host a joined, and its round-0 delta upload begun by hand: the headers sent, the body (returned) not yet."""
    named = [("w", torch.randn(64, 64)), ("b", torch.randn(64))]
    (a,), initial = joined(url, named, "a")
    body = bytes(delta(named, [torch.randn(64, 64) * 0.01, torch.zeros(64)], round_=0, host="a",
                       base_hash=initial).view())
    sock = raw_request(url, f"POST /v1/rounds/0/delta?host=a HTTP/1.1\r\nHost: x\r\n{CREDENTIAL_HEADER}: {a._credential}\r\n"
                            f"Content-Type: application/octet-stream\r\nContent-Length: {len(body)}\r\n\r\n")
    return a, sock, body


def test_a_trickling_upload_is_cut_at_its_time_limit_and_frees_its_slot(coordinator) -> None:
    coord = coordinator(1, "--transfer-timeout", "1")
    a, sock, body = upload_begun(coord.url)
    cut = threading.Event()

    def trickle() -> None:
        for i in range(100):  # one byte every 0.1 s: the whole body would take minutes
            try:
                sock.sendall(body[i : i + 1])
            except OSError:
                break
            time.sleep(0.1)
        cut.set()

    started = time.monotonic()
    threading.Thread(target=trickle, daemon=True).start()
    time.sleep(0.3)
    assert status(coord.url)["uploads"] == 1
    with_busy = time.monotonic()
    assert a.post_delta(0, memoryview(body)) is Upload.TAKEN  # refused as busy, retried until the slot is free
    assert 0.3 < time.monotonic() - with_busy < 6
    assert cut.wait(10) and time.monotonic() - started < 6, "the trickling upload was cut off"
    assert status(coord.url)["uploads"] == 0
    assert "host a's delta upload took longer than 1 s" in coord.log_path.read_text()
    sock.close()


def test_a_stalled_model_download_does_not_delay_the_round(coordinator) -> None:
    """A host that stops reading its full-model download: the round closes at once all the same (its unsent
    tensors are copied aside), and the download, resumed, delivers exactly the model it started with."""
    coord = coordinator(2, "--transfer-timeout", "60", "--lease", "120")  # no heartbeats here: no lease may lapse
    gen = torch.Generator().manual_seed(0)
    named = [("big", torch.randn(4 << 20, generator=gen)), ("small", torch.randn(1000, generator=gen))]
    (a, b), initial = joined(coord.url, named, "ab")
    sock = raw_request(coord.url, f"GET /v1/model?host=b HTTP/1.1\r\nHost: x\r\n{CREDENTIAL_HEADER}: {b._credential}\r\n\r\n",
                       rcvbuf=64 << 10)
    head = sock.recv(4096)  # the headers and a little of the body; then this reader stalls
    assert b" 200 " in head.split(b"\r\n")[0]
    deadline = time.monotonic() + 10
    while status(coord.url)["downloads"] != 1:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    for c in (a, b):
        d = delta(named, [torch.randn(t.shape, generator=gen) * 0.01 for _, t in named], round_=0, host=c.host,
                  base_hash=initial)
        assert c.post_delta(0, d.view()) is Upload.TAKEN
    sent = time.monotonic()
    reply = a.wait_sync(0)
    assert isinstance(reply, SyncReady)
    new_hash = Message.parse(body_bytes(reply.body)).meta.model_hash  # streamed as the round closes
    assert time.monotonic() - sent < 5, "the round waited for the download"
    assert new_hash != initial

    data = bytearray(head.split(b"\r\n\r\n", 1)[1])
    sock.settimeout(30)
    size = len(model_file(named))
    while len(data) < size:
        chunk = sock.recv(1 << 20)
        assert chunk, f"download cut after {len(data)} of {size} bytes"
        data += chunk
    sock.close()
    round_, stamped, specs, tensors = read_model(torch.frombuffer(data, dtype=torch.uint8))
    assert (round_, stamped) == (0, initial)
    assert model_hash([(s.name, t) for s, t in zip(specs, tensors)]) == initial, "the model it started with"
    got = body_bytes(b.get_model())  # and a new download gets the new model
    assert read_model(got)[1] == new_hash
    deadline = time.monotonic() + 10
    while not [e for e in coord.events() if e["phase"] == "model_materialize"]:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    kept = next(e["kept_bytes"] for e in coord.events() if e["phase"] == "model_materialize")
    assert 0 < kept <= size  # what copy-on-publish kept for the stalled download: at most the model


def test_a_round_that_cannot_close_says_whom_it_waits_for(coordinator) -> None:
    """--min-hosts 2 with host b gone (its lease expired): the round waits, and the coordinator says why every
    few seconds, naming the fix; once b is back and sends its delta, the round closes."""
    coord = coordinator(2, "--min-hosts", "2", "--lease", "1")
    named = [("w", torch.randn(32, 32))]
    (a, b), initial = joined(coord.url, named, "ab")
    alive = Heartbeat(a)  # b sends none
    assert a.post_delta(0, delta(named, [torch.ones(32, 32) * 0.01], round_=0, host="a",
                                 base_hash=initial).view()) is Upload.TAKEN
    deadline = time.monotonic() + 20
    while "cannot close" not in coord.log_path.read_text():
        assert time.monotonic() < deadline, coord.log_path.read_text()
        time.sleep(0.2)
    text = coord.log_path.read_text()
    assert "round 0 cannot close: it needs 2 deltas (--min-hosts)" in text and "b (not heard from for" in text
    assert "lower --min-hosts" in text
    assert status(coord.url)["hosts"] == {"a": "training", "b": "dropped"}
    b.heartbeat()
    assert b.post_delta(0, delta(named, [torch.ones(32, 32) * 0.01], round_=0, host="b",
                                 base_hash=initial).view()) is Upload.TAKEN
    reply = b.wait_sync(0)
    assert isinstance(reply, SyncReady)
    reply.body.close()
    assert alive.beats > 0 and alive.interval == 0.25  # four beats per lease
    alive.stop()


def test_an_upload_that_breaks_off_is_one_warning_line_naming_host_round_and_bytes(coordinator) -> None:
    coord = coordinator(1)
    a, sock, body = upload_begun(coord.url)
    sock.sendall(body[:5000])
    deadline = time.monotonic() + 10
    while status(coord.url)["uploads"] != 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    sock.close()
    while status(coord.url)["uploads"] != 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert status(coord.url)["uploads"] == 0
    assert a.post_delta(0, memoryview(body)) is Upload.TAKEN  # the host sends it again, whole
    said = coord.log_path.read_text()
    assert said.count("broke off") == 1, said
    assert (f"nodeox coordinator: host a's delta upload of round 0 broke off after 5000 of {len(body)} bytes "
            "received: the connection was lost") in said.splitlines()
    assert "Traceback" not in said and "request failed" not in said
