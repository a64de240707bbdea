"""The coordinator's connections cannot be exhausted: half-sent requests are closed after ``--idle-timeout``,
at most ``--max-connections`` are open (a new one closes the one waiting longest; it is refused only when every
one is busy), the open-file limit is raised to its hard limit, and what aiohttp refuses itself (a header over its
limit, a malformed request line) is answered with the JSON error."""

from __future__ import annotations

import json
import selectors
import socket
import time
from pathlib import Path

import pytest
import requests
from helpers import SPECS, model_file

from lightning_nodeox.coordinator.connections import Connections, connection_limit
from lightning_nodeox.core.protocol import CREDENTIAL_HEADER, JOIN, MODEL
from lightning_nodeox.host.client import HttpClient

HALF_SENT = f"POST {JOIN} HTTP/1.1\r\nHost: coordinator\r\nContent-Type: application/json\r\n"  # no blank line


class Conn:
    def __init__(self, name: str) -> None:
        self.name = name
        self.closed = False

    def force_close(self) -> None:
        self.closed = True


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_connection_beyond_the_limit_closes_the_one_waiting_longest_and_is_refused_only_when_all_are_busy() -> None:
    clock = Clock()
    conns = Connections(limit=3, idle_timeout=10, clock=clock)
    a, b, c, d, e = (Conn(n) for n in "abcde")
    for conn in (a, b, c):
        assert conns.opened(conn)
        clock.now += 1
    conns.busy(a)  # a request arrived on a: a is not waiting, b has waited longest
    assert conns.opened(d)
    assert (a.closed, b.closed, c.closed, d.closed) == (False, True, False, False)
    conns.closed(b)  # its connection_lost comes later: nothing counted twice
    assert len(conns) == 3
    conns.busy(c)
    conns.busy(d)
    assert not conns.opened(e)  # every open one is busy
    assert not e.closed and len(conns) == 3
    conns.idle(a)  # a's response is out: it waits again, from now
    assert conns.opened(e) and a.closed
    assert conns.status() == {"open": 3, "busy": 2, "limit": 3, "idle_timeout": 10, "evicted": 2, "refused": 1,
                              "timed_out": 0}


def test_a_connection_waiting_longer_than_the_idle_timeout_is_closed_and_a_busy_one_never() -> None:
    clock = Clock()
    conns = Connections(limit=10, idle_timeout=5, clock=clock)
    slow, busy, fresh = Conn("slow"), Conn("busy"), Conn("fresh")
    conns.opened(slow)
    conns.opened(busy)
    conns.busy(busy)
    clock.now = 4
    conns.opened(fresh)
    assert conns.sweep() == 0
    clock.now = 5
    assert conns.sweep() == 1 and slow.closed
    clock.now = 60  # a long poll or a long transfer
    assert conns.sweep() == 1 and fresh.closed and not busy.closed
    conns.idle(busy)
    clock.now = 64.9
    assert conns.sweep() == 0
    clock.now = 65
    assert conns.sweep() == 1 and busy.closed
    assert (len(conns), conns.timed_out) == (0, 3)


def test_the_default_connection_limit_leaves_files_for_the_run() -> None:
    assert connection_limit(1024) == 768
    assert connection_limit(256) == 128
    assert connection_limit(1 << 20) == 16384


# -- a real coordinator --------------------------------------------------------------------------------------------


def open_half_sent(url: str, n: int) -> list[socket.socket]:
    socks = []
    for _ in range(n):
        s = connect(url)
        s.sendall(HALF_SENT.encode())
        socks.append(s)
    return socks


def is_open(s: socket.socket) -> bool:
    s.setblocking(False)
    try:
        return s.recv(1) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        s.setblocking(True)


def closed_at(socks: list[socket.socket], until: float) -> dict[socket.socket, float]:
    """When each socket saw its end (EOF or reset), watching until ``until`` (monotonic)."""
    sel = selectors.DefaultSelector()
    for s in socks:
        sel.register(s, selectors.EVENT_READ)
    ended = {}
    while len(ended) < len(socks) and time.monotonic() < until:
        for key, _ in sel.select(timeout=0.05):
            try:
                data = key.fileobj.recv(4096)
            except OSError:
                data = b""
            if not data:
                ended[key.fileobj] = time.monotonic()
                sel.unregister(key.fileobj)
    sel.close()
    return ended


def connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def read_to_end(s: socket.socket) -> bytes:
    answer = b""
    while chunk := s.recv(4096):
        answer += chunk
    return answer


def parse(answer: bytes) -> tuple[bytes, dict]:
    """An HTTP answer's status line and JSON body."""
    head, _, body = answer.partition(b"\r\n\r\n")
    return head.split(b"\r\n")[0], json.loads(body)


def status(url: str) -> dict:
    return requests.get(f"{url}/v1/status", timeout=10).json()


@pytest.mark.slow
def test_half_sent_requests_beyond_the_connection_limit_never_hold_a_join_or_a_heartbeat_and_close_after_the_idle_timeout(
        coordinator) -> None:
    coord = coordinator(1, "--max-connections", "32", "--idle-timeout", "3", "--lease", "10")
    opened = time.monotonic()
    socks = open_half_sent(coord.url, 100)
    client = HttpClient(coord.url, host="a", retry_for=0.0)  # one try each: no retry may hide a refusal
    start = time.monotonic()
    reply = client.join([s.as_json() for s in SPECS])
    lease = client.heartbeat()
    took = time.monotonic() - start
    assert reply.credential and lease == 10.0
    assert took < 3.0  # at once, not after the half-sent ones time out
    client.session.close()
    still_open = [s for s in socks if is_open(s)]
    assert 24 <= len(still_open) <= 32  # the latest ones; the earlier were closed to make room
    assert not any(is_open(s) for s in socks[:60])
    ended = closed_at(still_open, until=opened + 3 + 4)
    assert len(ended) == len(still_open)  # every half-sent one is closed ...
    waited = [ended[s] - opened for s in still_open]
    assert min(waited) >= 3 - 0.5 and max(waited) <= 3 + 3  # ... after the idle timeout, not before
    conns = status(coord.url)["connections"]
    assert conns["evicted"] + conns["timed_out"] == 100
    assert (conns["open"], conns["limit"], conns["idle_timeout"], conns["refused"]) == (1, 32, 3, 0)
    for s in socks:
        s.close()


@pytest.mark.slow
def test_a_connection_beyond_the_limit_while_every_one_is_busy_is_refused_at_once_as_busy(coordinator) -> None:
    coord = coordinator(1, "--max-connections", "2")
    client = HttpClient(coord.url, host="a", retry_for=10)
    client.join([s.as_json() for s in SPECS])
    client.session.close()
    body = model_file()
    head = (f"PUT {MODEL}?host=a HTTP/1.1\r\nHost: coordinator\r\n{CREDENTIAL_HEADER}: {client._credential}\r\n"
            f"Content-Type: application/octet-stream\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n")
    uploads = [connect(coord.url) for _ in range(2)]
    for s in uploads:
        s.sendall(head.encode())  # the body is read in the handler: both connections are busy
    time.sleep(1.0)
    start = time.monotonic()
    with connect(coord.url) as s:
        answer = read_to_end(s)
    took = time.monotonic() - start
    status_line, error = parse(answer)
    assert status_line == b"HTTP/1.1 503 Service Unavailable"
    assert error["reason"] == "busy" and "2 connections open, all busy (--max-connections)" in error["error"]
    assert took < 1.0
    answers = []
    for s in uploads:  # the busy ones were never touched: each finishes its upload
        s.sendall(body)
        answers.append(parse(read_to_end(s)))
        s.close()
    assert [line for line, _ in answers] == [b"HTTP/1.1 200 OK", b"HTTP/1.1 409 Conflict"]
    assert answers[1][1]["reason"] == "has_model"
    assert status(coord.url)["connections"]["refused"] == 1


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/limits").exists(), reason="reads /proc/PID/limits")
def test_the_coordinator_raises_its_open_file_limit_to_the_hard_limit_and_sizes_its_connection_limit_from_it(
        coordinator) -> None:
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    low = min(hard, 1024) // 2
    resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard))  # the coordinator inherits the low soft limit
    try:
        coord = coordinator(1)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    line = next(line for line in Path(f"/proc/{coord.pid}/limits").read_text().splitlines()
                if line.startswith("Max open files"))
    assert line.split()[3:5] == [str(hard), str(hard)]
    assert status(coord.url)["connections"]["limit"] == connection_limit(hard)


@pytest.mark.slow
def test_a_header_over_the_limit_or_a_malformed_request_line_gets_the_json_error(coordinator) -> None:
    coord = coordinator(1)
    response = requests.get(f"{coord.url}/v1/health", headers={"X-Padding": "x" * 10_000}, timeout=10)
    assert response.status_code == 413
    assert response.headers["Content-Type"].startswith("application/json")
    assert response.json() == {"error": "the request line or a header is longer than the coordinator's limit of 8190 "
                                        "bytes", "reason": "too_large", "limit": 8190}
    with connect(coord.url) as s:
        s.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        status_line, error = parse(read_to_end(s))
    assert status_line.endswith(b" 400 Bad Request")
    assert error["reason"] == "invalid" and error["error"].startswith("malformed HTTP request: ")
    assert requests.get(f"{coord.url}/v1/health", timeout=10).json() == {"ok": True}  # and it goes on serving
