"""HTTP client of the coordinator (requests): timeouts, retries with backoff, clear errors, clock offset."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import requests
import torch

log = logging.getLogger(__name__)


class CoordinatorError(RuntimeError):
    """The coordinator refused a request (4xx); ``status`` and ``body`` say why."""

    def __init__(self, status: int, message: str, body: dict | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.body = body or {}


class CoordinatorUnreachable(ConnectionError):
    """The coordinator did not answer within the retry budget."""


class ExchangeCancelled(RuntimeError):
    """This host stopped waiting for the coordinator (its training was interrupted)."""


@dataclass
class ClockSample:
    rtt: float
    offset: float  # coordinator clock - host clock


class ClockOffset:
    """Coordinator-minus-host clock offset from request round trips (the fastest recent trip wins)."""

    def __init__(self, keep: int = 32) -> None:
        self._samples: list[ClockSample] = []
        self._keep = keep
        self._lock = threading.Lock()

    def add(self, sent: float, received: float, server_time: float) -> None:
        sample = ClockSample(received - sent, server_time - (sent + received) / 2)
        with self._lock:
            self._samples = [*self._samples[-(self._keep - 1):], sample]

    def best(self) -> ClockSample | None:
        with self._lock:
            return min(self._samples, key=lambda s: s.rtt) if self._samples else None

    @property
    def offset(self) -> float:
        best = self.best()
        return 0.0 if best is None else best.offset


class CoordinatorClient:
    """Talks to one coordinator. Connection errors and 5xx are retried with exponential backoff for up to
    ``retry_for`` seconds; a 4xx raises :class:`CoordinatorError` at once."""

    def __init__(self, url: str, *, host: str, token: str | None = None, connect_timeout: float = 5.0,
                 read_timeout: float = 120.0, retry_for: float = 60.0, clock: ClockOffset | None = None) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"coordinator URL {url!r} must start with http:// or https://; "
                             "set NODEOX_COORDINATOR_URL=http://HOST:PORT")
        self.url = url.rstrip("/")
        self.host = host
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.retry_for = retry_for
        self.clock = clock or ClockOffset()
        self._local = threading.local()
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._cancelled = threading.Event()

    def cancel(self) -> None:
        """Make waits and retries in progress give up (``ExchangeCancelled``) at their next poll."""
        self._cancelled.set()

    @property
    def session(self) -> requests.Session:
        s = getattr(self._local, "session", None)
        if s is None:
            s = self._local.session = requests.Session()
            s.headers.update(self._headers)
        return s

    def request(self, method: str, path: str, *, ok: tuple[int, ...] = (200,), read_timeout: float | None = None,
                retry_for: float | None = None, **kwargs) -> requests.Response:
        url = f"{self.url}{path}"
        deadline = time.monotonic() + (self.retry_for if retry_for is None else retry_for)
        delay, attempt = 0.2, 0
        while True:
            attempt += 1
            if self._cancelled.is_set():
                raise ExchangeCancelled(f"{method} {path} cancelled: this host's training was interrupted")
            if hasattr(kwargs.get("data"), "rewind"):
                kwargs["data"].rewind()
            sent = time.time()
            try:
                response = self.session.request(
                    method, url, timeout=(self.connect_timeout, read_timeout or self.read_timeout), **kwargs)
            except (requests.ConnectionError, requests.Timeout) as e:
                problem: str = f"{type(e).__name__}: {e}"
            else:
                received = time.time()
                stamp = response.headers.get("X-Nodeox-Time")
                if stamp:
                    self.clock.add(sent, received, float(stamp))
                if response.status_code in ok:
                    return response
                body = _json_or_none(response)
                message = (body or {}).get("error") or response.reason or ""
                if response.status_code < 500:
                    raise CoordinatorError(response.status_code, f"{method} {url} -> {response.status_code}: {message}",
                                           body)
                problem = f"HTTP {response.status_code}: {message}"
            if time.monotonic() + delay > deadline:
                raise CoordinatorUnreachable(
                    f"coordinator at {self.url} did not answer {method} {path} after {attempt} tries "
                    f"({problem}). Check NODEOX_COORDINATOR_URL and that `nodeox coordinator` is running there.")
            log.warning("nodeox: %s %s failed (%s); retrying in %.1fs", method, path, problem, delay)
            time.sleep(delay)
            delay = min(delay * 2, 5.0)

    # -- calls ---------------------------------------------------------------------------------------------------
    def join(self, tensors: list) -> dict:
        while True:
            reply = self.request("POST", "/v1/join", json={"host": self.host, "tensors": tensors}).json()
            if not reply.get("retry"):
                return reply

    def put_model(self, body) -> dict:
        return self.request("PUT", f"/v1/model?host={self.host}", data=body,
                            headers={"Content-Type": "application/octet-stream"}).json()

    def post_delta(self, round_: int, body: memoryview) -> dict:
        return self.request("POST", f"/v1/rounds/{round_}/delta?host={self.host}", data=body, ok=(202,),
                            headers={"Content-Type": "application/octet-stream"}).json()

    def wait_sync(self, round_: int, poll: float = 30.0) -> requests.Response:
        """Long-poll until round ``round_``'s sync is ready; the response is open for streaming
        (status 204 with ``X-Nodeox-Complete: 1`` when the run completed before that round)."""
        while True:
            response = self.request("GET", f"/v1/rounds/{round_}/sync?wait={poll}&host={self.host}", ok=(200, 204),
                                    stream=True,
                                    read_timeout=poll + self.read_timeout)
            if response.status_code == 200 or response.headers.get("X-Nodeox-Complete") == "1":
                return response
            response.close()

    def get_model(self) -> requests.Response:
        return self.request("GET", f"/v1/model?host={self.host}", stream=True)

    def post_events(self, records: list[dict], *, retry_for: float = 0.0) -> None:
        self.request("POST", "/v1/events", json={"records": records}, retry_for=retry_for)

    def leave(self) -> None:
        self.request("POST", f"/v1/hosts/{self.host}/leave", retry_for=10.0)


READ_CHUNK = 8 << 20


class BodyReader:
    """``readinto`` over a streamed response body, in reads of at most 8 MiB (urllib3's own ``readinto``
    of a large buffer is several times slower)."""

    def __init__(self, response: requests.Response) -> None:
        self._raw = response.raw

    def readinto(self, view: memoryview) -> int:
        data = self._raw.read(min(len(view), READ_CHUNK))
        view[: len(data)] = data
        return len(data)


def read_into(response: requests.Response, buffer: torch.Tensor | None = None) -> torch.Tensor:
    """The body of a streamed response, read into ``buffer`` (reused when its size fits)."""
    size = int(response.headers.get("Content-Length", -1))
    if size < 0:
        raise CoordinatorError(0, "coordinator response has no Content-Length")
    if buffer is None or buffer.numel() != size:
        buffer = torch.empty(size, dtype=torch.uint8)
    view = memoryview(buffer.numpy())
    body = BodyReader(response)
    pos = 0
    try:
        while pos < size:
            n = body.readinto(view[pos:])
            if not n:
                raise CoordinatorUnreachable(f"download from the coordinator broke off after {pos} of {size} bytes")
            pos += n
    finally:
        response.close()
    return buffer


def _json_or_none(response: requests.Response) -> dict | None:
    try:
        value = response.json()
    except ValueError:
        return None
    return value if isinstance(value, dict) else None
