"""The host's HTTP transport (requests): the protocol's calls, with timeouts, retries and clear errors.

Every HTTP detail of the host side is here: statuses and headers are turned into the protocol's outcomes
(:mod:`lightning_nodeox.core.protocol`), so the host's round logic never sees them. Connection errors and
5xx (and 408, a transfer cut off as too slow) are retried with exponential backoff for up to ``retry_for``
seconds (600 by default), so a host rides out a coordinator restart, or its move to another machine: the first
failure is said, then every 30 s whom the host waits for; a refusal raises at once, and so does a TLS mistake
(:class:`~lightning_nodeox.core.protocol.TlsMismatch`: the URL's scheme is not what the coordinator speaks, or its
certificate is not trusted), which no retry mends: a connection that fails in a way such a mistake could explain
is checked with one probe of the coordinator's port (does it complete a TLS handshake, does it answer plain HTTP).

:meth:`HttpClient.cancel` stops the exchange's calls (waits and retries) at their next poll; saying goodbye
(:meth:`HttpClient.leave`), heartbeats and phase records are not cancellable and have short deadlines of
their own, so an interrupted host still tells the coordinator it left, within about ``LEAVE_WITHIN`` seconds.

After its join, every call carries the host's credential (from the join reply); the bearer token and the
credential go only to the URL this client was made for. HTTPS certificates are checked against ``ca_file``
when given, else the system's store (or ``REQUESTS_CA_BUNDLE``, the requests convention).
"""

from __future__ import annotations

import json
import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable
from urllib.parse import urlsplit

import requests
from urllib3.exceptions import HTTPError as Urllib3Error

from ..core import protocol as proto
from ..core.ledger_terms import LeaseReply, reply_from_dict
from ..core.protocol import (
    ByteStream,
    Cancelled,
    DataSpec,
    JoinReply,
    Reason,
    Refusal,
    RunComplete,
    SyncReady,
    SyncReply,
    TlsMismatch,
    TransferBroken,
    Unreachable,
    Upload,
    ValuesReply,
)
from ..core.settings import ENV_CA_FILE
from ..core.transport import delta_outcome, sync_outcome
from .clock import ClockOffset
from .placed import PlacedStream, write_part
from .settings import RETRY_FOR
from .waiting import WaitLine

log = logging.getLogger(__name__)

READ_CHUNK = 8 << 20
LEAVE_WITHIN = 5.0  # seconds of retries for the goodbye (each try waits at most this long for an answer)
EVENTS_READ_TIMEOUT = 10.0
HEARTBEAT_TIMEOUT = 5.0
DIRECT_FOR = 120.0  # seconds a host that could not read the store asks the coordinator for the bytes instead
SYNC_POLL = 2.0  # seconds a sync long-poll lasts: a cancelled host (SIGTERM) stops waiting within about this
_REASON_OF_STATUS = {400: Reason.INVALID, 401: Reason.UNAUTHORIZED, 403: Reason.FORBIDDEN, 404: Reason.INVALID,
                     405: Reason.INVALID, 409: Reason.NOT_OPEN, 410: Reason.GONE, 411: Reason.LENGTH_REQUIRED,
                     413: Reason.TOO_LARGE, 429: Reason.RATE_LIMITED}


class ResponseStream:
    """A streamed response body as a :class:`~lightning_nodeox.core.protocol.ByteStream`, read in pieces
    of at most 8 MiB (urllib3's own ``readinto`` of a large buffer is several times slower)."""

    def __init__(self, response: requests.Response) -> None:
        self._response = response
        self.size = int(response.headers.get("Content-Length", -1))
        if self.size < 0:
            response.close()
            raise TransferBroken("coordinator response has no Content-Length")

    def readinto(self, view: memoryview) -> int:
        try:
            data = self._response.raw.read(min(len(view), READ_CHUNK))
        except (OSError, requests.RequestException, Urllib3Error) as e:  # urllib3's: a body cut short
            raise TransferBroken(f"download from the coordinator broke off: {e}") from None
        view[: len(data)] = data
        return len(data)

    def close(self) -> None:
        self._response.close()


class HttpClient:
    """Talks to one coordinator over HTTP(S) on behalf of host ``host``: a
    :class:`~lightning_nodeox.core.transport.HostClient`. ``check``: what to check when the coordinator does not
    answer (how this process was told where it is)."""

    CHECK = "Check NODEOX_COORDINATOR_URL and that `nodeox coordinator` is running there."

    def __init__(self, url: str, *, host: str, token: str | None = None, ca_file: str | None = None,
                 connect_timeout: float = 5.0, read_timeout: float = 120.0, retry_for: float = RETRY_FOR,
                 clock: ClockOffset | None = None, check: str = CHECK, data: DataSpec | None = None) -> None:
        self.url = url.rstrip("/")
        self.data = data  # declared with every join: the coordinator's data ledger shares out its epochs
        self._lease_calls = 0  # each lease call's number (a retry of it sends the same)
        self.check = check
        self.host = host
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.retry_for = retry_for
        self.clock = clock or ClockOffset()
        self._local = threading.local()
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._verify = ca_file  # given per request: a session-wide setting would lose to REQUESTS_CA_BUNDLE
        self._credential = ""  # this host's, from its join
        self._cancelled = threading.Event()
        self._direct_until = 0.0  # monotonic time until which payloads are asked for as bytes (the store failed)
        self._store_deltas = False  # the coordinator takes deltas through its store (its join reply says)

    @property
    def joined(self) -> bool:
        """Whether this client holds a credential from a join (calls on the host's behalf can be made)."""
        return bool(self._credential)

    @property
    def credential(self) -> str:
        """This host's credential, from its last join ("" before one). A process that takes its place after a
        restart (a site relay, from its run directory) sets it back, so its join takes the id back at once."""
        return self._credential

    @credential.setter
    def credential(self, value: str) -> None:
        self._credential = value

    def cancel(self) -> None:
        """Make waits and retries in progress give up (:class:`Cancelled`) at their next poll."""
        self._cancelled.set()

    @property
    def session(self) -> requests.Session:
        s = getattr(self._local, "session", None)
        if s is None:
            s = self._local.session = requests.Session()
            s.headers.update(self._headers)
        return s

    def _request(self, method: str, path: str, *, ok: tuple[int, ...] = (200,), read_timeout: float | None = None,
                 retry_for: float | None = None, cancellable: bool = True, **kwargs) -> requests.Response:
        url = f"{self.url}{path}"
        headers = dict(kwargs.pop("headers", None) or {})
        if self._credential:
            headers[proto.CREDENTIAL_HEADER] = self._credential
        deadline = time.monotonic() + (self.retry_for if retry_for is None else retry_for)
        delay, attempt = 0.2, 0
        waiting = WaitLine(f"host {self.host} waits for the coordinator at {self.url} to answer {method} {path}")
        while True:
            attempt += 1
            if cancellable and self._cancelled.is_set():
                raise Cancelled(f"{method} {path} cancelled: this host's training was interrupted")
            if hasattr(kwargs.get("data"), "rewind"):
                kwargs["data"].rewind()
            sent, clock_sent = time.time(), time.monotonic()  # the round trip on a clock no step of the wall moves
            try:
                response = self.session.request(
                    method, url, timeout=(self.connect_timeout, read_timeout or self.read_timeout),
                    headers=headers, **({"verify": self._verify} if self._verify else {}), **kwargs)
            except (requests.ConnectionError, requests.Timeout) as e:
                mistake = self._tls_mistake(e)
                if mistake:
                    what, fix = mistake
                    raise TlsMismatch(f"coordinator at {self.url}: {what} ({type(e).__name__}: {e}); {fix}") from None
                problem: str = f"{type(e).__name__}: {e}"
            else:
                stamp = response.headers.get(proto.TIME_HEADER)
                if stamp:
                    self.clock.add(sent, sent + time.monotonic() - clock_sent, float(stamp))
                if response.status_code in ok:
                    return response
                body = _json_or_empty(response)
                message = body.get("error") or response.reason or ""
                if response.status_code < 500 and response.status_code != 408:
                    raise _refusal(response.status_code, f"{method} {url} -> {response.status_code}: {message}", body)
                problem = f"HTTP {response.status_code}: {message}"
            if time.monotonic() + delay > deadline:
                raise Unreachable(
                    f"coordinator at {self.url} did not answer {method} {path} after {attempt} tries "
                    f"({problem}). {self.check}")
            if attempt == 1:
                log.warning("nodeox: %s %s failed (%s); retrying for up to %.0f s", method, path, problem,
                            deadline - time.monotonic())
            else:
                waiting.still(problem)
            time.sleep(delay)
            delay = min(delay * 2, 5.0)

    def _tls_mistake(self, error: Exception) -> tuple[str, str] | None:
        """What is wrong and its fix, when ``error`` comes from a TLS mistake rather than a passing failure."""
        text = str(error)
        if isinstance(error, requests.exceptions.SSLError):
            if "CERTIFICATE_VERIFY_FAILED" in text:
                trusted = (f"{ENV_CA_FILE}={self._verify} does not verify it" if self._verify else
                           f"{ENV_CA_FILE} is not set and the system's store (or REQUESTS_CA_BUNDLE) does not trust it")
                return "its TLS certificate is not trusted", (
                    f"{trusted}: set {ENV_CA_FILE}=/path/to/cert.pem, the certificate the coordinator serves (its "
                    "--tls-cert) or the CA that signed it")
            if self._verify and any(s in text for s in ("NO_CERTIFICATE_OR_CRL_FOUND", "[X509", "[PEM")):
                return f"{ENV_CA_FILE}={self._verify} cannot be read as a certificate", (
                    f"point {ENV_CA_FILE} at the PEM certificate the coordinator serves (its --tls-cert) or its CA")
            if _speaks_plain_http(self.url, self.connect_timeout):
                return "it speaks plain HTTP, not TLS", (
                    f"use {self.url.replace('https://', 'http://', 1)} (or start the coordinator with --tls-cert and "
                    "--tls-key)")
            return None
        cut = any(s in text for s in ("Connection aborted", "Connection reset", "RemoteDisconnected", "BadStatusLine"))
        if cut and urlsplit(self.url).scheme == "http" and _speaks_tls(self.url, self.connect_timeout):
            return "it speaks TLS, not plain HTTP", (
                f"use {self.url.replace('http://', 'https://', 1)} (and set {ENV_CA_FILE}=/path/to/cert.pem when its "
                "certificate is self-signed or private)")
        return None

    # -- the protocol's calls -------------------------------------------------------------------------------------
    def join(self, tensors: list, *, model_hash: str | None = None, round_: int | None = None) -> JoinReply:
        """Join (again: with the credential of the earlier join, and saying which model and round this host holds,
        so that a restarted coordinator can take its model back from it); later calls carry the credential
        returned."""
        body = {"host": self.host, "tensors": tensors}
        if self.data is not None:
            body["data"] = self.data.to_json()
        if model_hash:
            body.update(model_hash=model_hash, round=round_)
        reply = JoinReply.from_json(self._request("POST", proto.JOIN, json=body).json())
        if reply.credential:
            self._credential = reply.credential
        self._store_deltas = reply.store_deltas
        return reply

    def put_model(self, body) -> str:
        """Upload the initial model; returns the coordinator's hash of it."""
        return self._request("PUT", proto.MODEL, params={"host": self.host}, data=body,
                             headers={"Content-Type": proto.OCTETS}).json()["model_hash"]

    def post_delta(self, round_: int, body, *, training: bool = False) -> Upload:
        """Send round ``round_``'s delta: its bytes, or (``--store-deltas``) its parts written to the run's store
        and then where they are; a store that cannot be written sends the bytes instead."""
        params = {"host": self.host, **_training(training)}
        path = proto.DELTA.format(round=round_)

        def send() -> None:
            placed = self._place_delta(round_, body) if self._store_deltas and not self._direct() else None
            if placed is not None:
                self._request("POST", path, params=params, data=json.dumps({"id": placed}), ok=(202,),
                              headers={"Content-Type": proto.PLACE})
                return
            self._request("POST", path, params=params, data=body, ok=(202,), headers={"Content-Type": proto.OCTETS})

        return delta_outcome(send, self.host, round_)

    def _place_delta(self, round_: int, body) -> str | None:
        """Write the delta ``body`` (a message reader) to the run's store where the coordinator places it, a part
        as soon as it is made; its place's id, or None when it could not be written (it is then sent itself)."""
        message = getattr(body, "message", None)
        if message is None:  # a whole message sent again: its bytes
            return None
        ranges = message.part_ranges()
        place = self._request("POST", proto.DELTA_PLACE.format(round=round_), params={"host": self.host},
                              json={"sizes": [b - a for a, b in ranges]}).json()
        body.rewind()
        try:
            for part, (a, b) in zip(place["parts"], ranges):
                write_part(self.session_plain, part["url"], _read_exactly(body, b - a),
                           timeout=(self.connect_timeout, self.read_timeout))
        except TransferBroken as e:
            self._store_failed(str(e))
            body.rewind()
            return None
        return str(place["id"])

    def wait_sync(self, round_: int, poll: float = SYNC_POLL, *,
                  training: Callable[[], bool] | None = None) -> SyncReply:
        """Long-poll until round ``round_``'s sync is ready (or the run completed, or the sync is gone); each poll
        says whether this host's training goes on meanwhile (``training()``)."""
        what = f"host {self.host} waits for round {round_}'s sync"
        waiting = WaitLine(what)
        while True:
            busy = bool(training and training())
            reply = self.poll_sync(round_, poll, training=busy)
            if reply is not None:
                return reply
            if busy:  # it trains meanwhile (overlap): not a wait yet
                waiting = WaitLine(what)
            else:
                waiting.still("the coordinator has not closed that round yet (its waiting line says why)")

    def poll_sync(self, round_: int, poll: float = SYNC_POLL, *, training: bool = False,
                  sending: bool = False) -> SyncReply | None:
        """One long poll for round ``round_``'s sync (None: not ready within ``poll`` seconds). ``sending``: this
        host's delta of the round is still on its way (its upload runs meanwhile), so its absence is no reason to
        refuse."""
        return sync_outcome(lambda: self._sync_reply(round_, proto.SYNC.format(round=round_), poll, training, sending))

    def _sync_reply(self, round_: int, path: str, poll: float, training: bool, sending: bool) -> SyncReply | None:
        params = {"wait": poll, "host": self.host, **_training(training), **({"sending": "1"} if sending else {}),
                  **self._direct()}
        response = self._request("GET", path, params=params, ok=(200, 204), stream=True,
                                 read_timeout=poll + self.read_timeout)
        complete = response.headers.get(proto.COMPLETE_HEADER) == "1"
        held = response.headers.get(proto.HELD_HEADER)
        if response.status_code == 200:
            return SyncReady(round_, self._payload(response), complete, int(held) if held is not None else None)
        response.close()
        return RunComplete() if complete else None

    def exchange_values(self, key: str, payload: object, poll: float = SYNC_POLL) -> ValuesReply:
        """Long-poll until ``key`` is answered, posting ``payload`` each time (the coordinator keeps the first)."""
        path = proto.VALUES.format(key=key)
        waiting = WaitLine(f"host {self.host} waits for the values {key} of the other hosts")
        while True:
            response = self._request("POST", path, params={"wait": poll, "host": self.host}, json={"payload": payload},
                                     ok=(200, 204), read_timeout=poll + self.read_timeout)
            if response.status_code == 200:
                return ValuesReply.from_json(response.json())
            waiting.still("not every host still in the run has posted them")

    def lease(self, epoch: int | None, units: int = 1) -> LeaseReply:
        """Up to ``units`` units of the data ledger's epoch ``epoch`` (None: its current one): a ``Lease``,
        ``Wait`` or ``EpochEnd``. Each call is numbered: a retry whose first reply was lost gets that reply."""
        self._lease_calls += 1
        body = {"epoch": epoch, "units": units, "seq": self._lease_calls}
        return reply_from_dict(self._request("POST", proto.DATA_LEASE, params={"host": self.host}, json=body).json())

    def status(self) -> dict:
        """The coordinator's run at a glance (``GET /v1/status``: its round, codec, hosts); a site relay asks it of
        its upstream before it serves."""
        return self._request("GET", proto.STATUS).json()

    def get_model(self) -> ByteStream:
        return self._payload(self._request("GET", proto.MODEL, params={"host": self.host, **self._direct()},
                                           stream=True))

    # -- payloads in the run's store --------------------------------------------------------------------------
    def _payload(self, response: requests.Response) -> ByteStream:
        """A sync's or the model's bytes: the response's own, or read from the run's store where it says."""
        if response.headers.get("Content-Type", "").split(";")[0] != proto.PLACE:
            return ResponseStream(response)
        try:
            place = response.json()
        finally:
            response.close()
        return PlacedStream(place, self.session_plain, self._store_failed,
                            timeout=(self.connect_timeout, self.read_timeout))

    def _store_failed(self, problem: str) -> None:
        """The store could not be read or written: payloads go through the coordinator for the next
        ``DIRECT_FOR`` seconds."""
        if time.monotonic() >= self._direct_until:
            log.warning("nodeox: host %s cannot use the run's store (%s); its payloads go through the coordinator "
                        "for %.0f s", self.host, problem, DIRECT_FOR)
        self._direct_until = time.monotonic() + DIRECT_FOR

    def _direct(self) -> dict[str, str]:
        return {"direct": "1"} if time.monotonic() < self._direct_until else {}

    @property
    def session_plain(self) -> requests.Session:
        """A session without the coordinator's token (the store's URLs carry their own signature)."""
        s = getattr(self._local, "plain", None)
        if s is None:
            s = self._local.plain = requests.Session()
        return s

    def post_events(self, records: list[dict], *, retry_for: float = 0.0) -> None:
        self._request("POST", proto.EVENTS, params={"host": self.host}, json={"records": records}, retry_for=retry_for,
                      read_timeout=EVENTS_READ_TIMEOUT, cancellable=False)

    def heartbeat(self) -> float:
        """Tell the coordinator this host is alive (one try); returns the lease in seconds."""
        response = self._request("POST", proto.HEARTBEAT.format(host=self.host), retry_for=0.0,
                                 read_timeout=HEARTBEAT_TIMEOUT, cancellable=False)
        return float(response.json()["lease"])

    def leave(self) -> None:
        """Say goodbye, whatever the cancel state, within about ``LEAVE_WITHIN`` seconds (plus a connect)."""
        self._request("POST", proto.LEAVE.format(host=self.host), retry_for=LEAVE_WITHIN,
                      read_timeout=LEAVE_WITHIN, cancellable=False)


def _read_exactly(body, n: int) -> bytes:
    """The next ``n`` bytes of a message reader (waiting for its maker)."""
    out = bytearray()
    while len(out) < n:
        chunk = body.read(n - len(out))
        if not chunk:
            raise TransferBroken(f"the delta ended {n - len(out)} bytes early")
        out += chunk
    return bytes(out)


def _training(training: bool) -> dict[str, str]:
    """The query parameter saying this host's training goes on while its round is open (absent: it waits)."""
    return {"training": "1"} if training else {}


def _address(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    return parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)


def _speaks_tls(url: str, timeout: float) -> bool:
    """Whether the server at ``url``'s address completes a TLS handshake (its certificate unchecked: a probe)."""
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    try:
        with socket.create_connection(_address(url), timeout=timeout) as raw, context.wrap_socket(raw):
            return True
    except (OSError, ssl.SSLError):
        return False


def _speaks_plain_http(url: str, timeout: float) -> bool:
    """Whether the server at ``url``'s address answers a plain HTTP request."""
    try:
        with socket.create_connection(_address(url), timeout=timeout) as raw:
            raw.sendall(b"HEAD / HTTP/1.0\r\n\r\n")
            start = b""
            while len(start) < 5 and (piece := raw.recv(5 - len(start))):
                start += piece
            return start == b"HTTP/"
    except OSError:
        return False


def _refusal(status: int, message: str, body: dict) -> Refusal:
    try:
        reason = Reason(body.get("reason"))
    except ValueError:
        reason = _REASON_OF_STATUS.get(status, Reason.INVALID)
    extra = {k: v for k, v in body.items() if k not in ("error", "reason")}
    return Refusal(reason, message, **extra)


def _json_or_empty(response: requests.Response) -> dict:
    try:
        value = response.json()
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
