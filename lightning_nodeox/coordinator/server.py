"""The coordinator's HTTP server (aiohttp): the protocol's routes (:mod:`lightning_nodeox.core.protocol`), mapped
onto the coordinator's run (:class:`~lightning_nodeox.coordinator.lifecycle.CoordinatorRun`, which also starts and
ends it); refusals become JSON errors with the status their reason maps to. This module holds only what is HTTP:
routes, authentication and the mapping of errors, reading bodies, and TLS and binding.

Every response carries the coordinator's clock in ``X-Nodeox-Time``, for clock alignment. Calls that name a
host are authenticated by that host's credential (:mod:`~lightning_nodeox.coordinator.membership`); request
bodies go through :mod:`~lightning_nodeox.coordinator.intake` before anything else sees them. With ``--tls-cert``
it serves HTTPS.

Slow and stuck peers cannot hold the run: every body read and every response write has a time limit of
``--transfer-timeout`` plus one second per MB (then the connection is cut and its buffer released); a receive
buffer is taken only for a host the round expects, with no upload of its own in flight (else ``BUSY``), and
at most ``MAX_UPLOADS`` bodies are read at once (others wait their turn, unread); at most
``MAX_MODEL_DOWNLOADS`` full-model downloads run at once, for joined hosts only, and a round never waits for
one (copy-on-publish, :class:`~lightning_nodeox.coordinator.model.ModelStream`). Connections are counted and
limited (:mod:`~lightning_nodeox.coordinator.connections`): one that waits ``--idle-timeout`` for its request's
headers is closed, and at most ``--max-connections`` are open.

What aiohttp refuses before any route sees it (a request line or header over ``MAX_HEADER_BYTES``, a malformed
request) is answered with the same JSON error as a refusal.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging
import os
import ssl
import time
from pathlib import Path

import torch
from aiohttp import web
from aiohttp.http_exceptions import LineTooLong

from ..core import protocol as proto
from ..core import safetensors
from ..core.logs import Named
from ..core.phases import COORDINATOR, MODEL_MATERIALIZE, PhaseRecord
from ..core.protocol import HTTP_STATUS, Reason, Refusal
from ..core.specs import PayloadError
from . import intake, lifecycle, statuspage
from .config import CoordinatorConfig, parse_bind
from .connections import RESERVED_FILES, Connections, connection_limit, raise_open_file_limit
from .lifecycle import CoordinatorRun
from .making import SyncBroken, SyncInMaking

log = logging.getLogger(__name__)

RUN = web.AppKey("run", CoordinatorRun)
TOKEN = web.AppKey("token", str)
BUFFERS = web.AppKey("buffers", object)
UPLOADS = web.AppKey("uploads", object)
BUDGET = web.AppKey("budget", intake.TelemetryBudget)
CONNECTIONS = web.AppKey("connections", Connections)
LOG = web.AppKey("log", Named)  # the module's logger, named as its run
SEND_CHUNK = 8 << 20  # bytes handed to the transport at a time, so its buffer never holds a whole payload
MIN_RATE = 1e6  # bytes/s: a transfer slower than this (after --transfer-timeout) is cut off
MAX_UPLOADS = 8  # delta bodies read at once (each needs a receive buffer of the delta's size)
MAX_MODEL_DOWNLOADS = 2  # full-model downloads at once (each may keep up to the model's size at a publish)
MAX_HEADER_BYTES = 8190  # the request line and each header field (aiohttp's default, stated)
BACKLOG = 128  # connections queued before they are accepted; also the most asyncio accepts at once, uncounted
SHUTDOWN_GRACE = 5.0  # seconds a request in flight has to end once the coordinator is told to stop (then cut)


class ReceiveBuffers:
    """Byte buffers for incoming deltas, reused across rounds (at most ``keep`` idle ones are kept)."""

    def __init__(self, keep: int = 2) -> None:
        self.keep = keep
        self._idle: list[torch.Tensor] = []

    def get(self, size: int) -> torch.Tensor:
        while self._idle:
            buf = self._idle.pop()
            if buf.numel() == size:
                return buf
        return torch.empty(size, dtype=torch.uint8)

    def put(self, buf: torch.Tensor) -> None:
        if len(self._idle) < self.keep:
            self._idle.append(buf)


async def write_chunked(response: web.StreamResponse, view: memoryview) -> None:
    """Send ``view`` a slice at a time, waiting for the socket to drain in between (no copy of the whole)."""
    for start in range(0, len(view), SEND_CHUNK):
        await response.write(view[start : start + SEND_CHUNK])


async def finish(request: web.Request, response: web.StreamResponse, timeout: float = 30.0) -> None:
    """End the response and wait until the transport has sent everything (it may still reference our buffer)."""
    await response.write_eof()
    transport = request.transport
    deadline = time.monotonic() + timeout
    while transport is not None and transport.get_write_buffer_size() > 0 and time.monotonic() < deadline:
        await asyncio.sleep(0.005)


class Uploads:
    """Delta uploads in flight: one per host, ``limit`` bodies read at once (the others wait, unread)."""

    def __init__(self, limit: int = MAX_UPLOADS) -> None:
        self.hosts: set[str] = set()
        self.reading = asyncio.Semaphore(limit)

    def claim(self, host: str) -> None:
        if host in self.hosts:
            raise Refusal(Reason.BUSY, f"host {host} already has an upload in flight; try again when it has ended")
        self.hosts.add(host)

    def release(self, host: str) -> None:
        self.hosts.discard(host)


def transfer_seconds(config: CoordinatorConfig, size: int) -> float:
    """How long a transfer of ``size`` bytes may take: --transfer-timeout plus one second per MB."""
    return config.transfer_timeout + size / MIN_RATE


async def within(request: web.Request, seconds: float, work, what: str):
    """Await ``work``; past ``seconds`` cut the connection (freeing what it held) and refuse as too slow."""
    try:
        return await asyncio.wait_for(work, seconds)
    except asyncio.TimeoutError:
        if request.transport is not None:
            request.transport.abort()
        request.app[LOG].warning("%s took longer than %.0f s; connection cut", what, seconds)
        raise Refusal(Reason.TOO_SLOW, f"{what} took longer than {seconds:.0f} s") from None


def error(reason: Reason, message: str, **extra) -> web.Response:
    return web.json_response({"error": message, "reason": reason.value, **extra}, status=HTTP_STATUS[reason])


@web.middleware
async def errors_and_auth(request: web.Request, handler):
    request.app[CONNECTIONS].busy(request.protocol)  # its headers are in: no longer waiting (Handler.log_access)
    try:
        token = request.app[TOKEN]
        if token and request.path != proto.HEALTH and not _authorized(request, token):
            raise Refusal(Reason.UNAUTHORIZED, "missing or wrong bearer token: set NODEOX_TOKEN to the "
                                               "coordinator's token (the status page: open the link the "
                                               "coordinator printed, which carries it)")
        return await handler(request)
    except Refusal as e:
        return error(e.reason, str(e), **e.extra)
    except PayloadError as e:
        return error(Reason.INVALID, str(e))
    except web.HTTPException as e:
        if e.status >= 400:
            reason = Reason.TOO_LARGE if e.status == 413 else Reason.INVALID
            return web.json_response({"error": e.reason, "reason": reason.value}, status=e.status)
        raise
    except (ConnectionResetError, asyncio.CancelledError):
        raise
    except Exception as e:  # noqa: BLE001 - a bug must not take the coordinator down; say it and go on
        request.app[LOG].exception("%s %s failed", request.method, request.path)
        return web.json_response({"error": f"coordinator error: {type(e).__name__}: {e}"}, status=500)


def _same(given: str, token: str) -> bool:
    return hmac.compare_digest(given.encode("utf-8", "surrogateescape"), token.encode())


def _authorized(request: web.Request, token: str) -> bool:
    """The bearer token; for the status page's reads only (``GET`` of the page, its files and the status), also
    the page's cookie, or on the page itself ``?token=`` (the link the coordinator prints)."""
    if _same(request.headers.get("Authorization", ""), f"Bearer {token}"):
        return True
    if request.method != "GET" or not (request.path in (statuspage.PAGE, proto.STATUS)
                                       or request.path.startswith(statuspage.FILES)):
        return False
    given = request.cookies.get(statuspage.cookie_name(request.url.port), "")
    if request.path == statuspage.PAGE:
        given = request.query.get("token", "") or given
    return bool(given) and _same(given, token)


def protocol_error(status: int, exc: BaseException | None, message: str | None, said: Named) -> web.Response:
    """The JSON error for a request aiohttp refused before any route saw it (``status`` is aiohttp's)."""
    if isinstance(exc, LineTooLong):
        return error(Reason.TOO_LARGE, f"the request line or a header is longer than the coordinator's limit of "
                                       f"{MAX_HEADER_BYTES} bytes", limit=MAX_HEADER_BYTES)
    if status < 500:
        return error(Reason.INVALID, f"malformed HTTP request: {message or exc}")
    said.error("request failed", exc_info=exc)
    return web.json_response({"error": f"coordinator error: {type(exc).__name__}: {exc}"}, status=status)


class Handler(web.RequestHandler):
    """aiohttp's handler of one connection, counted in :class:`Connections` (one refused there is answered
    ``BUSY`` and closed), answering what aiohttp refuses itself with the JSON error (:func:`protocol_error`)."""

    def __init__(self, server: web.Server, connections: Connections, said: Named, **kwargs) -> None:
        super().__init__(server, **kwargs)
        self._nodeox_connections = connections
        self._nodeox_log = said
        self._nodeox_admitted = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._nodeox_admitted = self._nodeox_connections.opened(self)
        if not self._nodeox_admitted:
            transport.write(_refused(self._nodeox_connections.limit))  # type: ignore[attr-defined]
            transport.close()
            self.force_close()  # aiohttp never sees this connection: it reads and answers nothing more
            return
        super().connection_made(transport)

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._nodeox_admitted:
            self._nodeox_connections.closed(self)
            super().connection_lost(exc)

    def log_access(self, request, response, time) -> None:  # called once a response has been sent
        self._nodeox_connections.idle(self)
        super().log_access(request, response, time)

    def handle_error(self, request, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        self._nodeox_log.info("refused a request from %s: %s", request.remote, message or exc)
        if request.writer.output_size > 0:  # as aiohttp: a response has begun, so the connection is broken
            raise ConnectionError("the response has begun; cannot send an error instead")
        response = protocol_error(status, exc, message, self._nodeox_log)
        response.force_close()
        return response


def _refused(limit: int) -> bytes:
    """The whole answer to a connection refused because all ``limit`` open ones are busy."""
    body = json.dumps({"error": f"the coordinator has {limit} connections open, all busy (--max-connections); try "
                                "again shortly", "reason": Reason.BUSY.value}).encode()
    head = (f"HTTP/1.1 {HTTP_STATUS[Reason.BUSY]} Service Unavailable\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n")
    return head.encode() + body


async def stamp_time(request: web.Request, response: web.StreamResponse) -> None:
    response.headers[proto.TIME_HEADER] = repr(time.time())


def _caller(request: web.Request, host: str | None = None, *, left_ok: bool = False) -> str:
    """The id of the host a call names (``?host=ID`` unless given), authenticated by its credential (a host that
    left only to say goodbye again: ``left_ok``)."""
    host = request.query.get("host", "") if host is None else host
    if not host:
        raise Refusal(Reason.INVALID, "query parameter host=ID is missing")
    credential = request.headers.get(proto.CREDENTIAL_HEADER, "")
    return request.app[RUN].membership.authenticate(intake.host_id(host), credential, left_ok=left_ok).id


async def _body(request: web.Request, limit: int) -> bytes:
    """A JSON request's body, at most ``limit`` bytes."""
    if (request.content_length or 0) > limit:
        raise Refusal(Reason.TOO_LARGE, f"request body of {request.content_length} bytes is larger than {limit}")
    return await request.read()


def _wait(request: web.Request) -> float:
    """A long-poll's ``?wait=S`` seconds (0 when not given)."""
    try:
        wait = float(request.query.get("wait", 0) or 0)
    except ValueError:
        wait = float("nan")
    if not 0 <= wait < float("inf"):
        raise Refusal(Reason.INVALID, f"wait must be a number of seconds, got {request.query.get('wait')!r}")
    return wait


def _training(request: web.Request) -> bool:
    """A delta's or sync poll's ``?training=1``: the host's training goes on while its round is open (overlap);
    absent (hosts that never say): it waits for the sync."""
    return request.query.get("training") == "1"


def _int(text: str, what: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise Refusal(Reason.INVALID, f"{what} must be an integer, got {text!r}") from None


async def read_body_into(request: web.Request, buf: torch.Tensor) -> None:
    """Stream the request body into ``buf`` (exactly its size), one copy from the socket's chunks."""
    view = memoryview(buf.numpy())
    pos, size = 0, len(view)
    async for chunk in request.content.iter_any():
        end = pos + len(chunk)
        if end > size:
            raise Refusal(Reason.INVALID, f"body is longer than its Content-Length ({size} bytes)")
        view[pos:end] = chunk
        pos = end
    if pos != size:
        raise Refusal(Reason.INVALID, f"body is truncated: {pos} of {size} bytes arrived")


# -- handlers -----------------------------------------------------------------------------------------------------


async def health(request: web.Request) -> web.Response:
    return web.json_response({"ok": True})


async def status(request: web.Request) -> web.Response:
    run = request.app[RUN]
    return web.json_response({**run.status(), "uploads": len(request.app[UPLOADS].hosts),
                              "connections": request.app[CONNECTIONS].status(),
                              "live": run.watch.snapshot(request.app[UPLOADS].hosts)})


async def status_page(request: web.Request) -> web.Response:
    """The status page; opened with ``?token=`` (the printed link) it keeps the token in a cookie of this
    coordinator's port (HttpOnly, path /) and sends the browser on to the page without it."""
    token = request.query.get("token")
    if token:
        response = web.HTTPFound(statuspage.PAGE)
        response.set_cookie(statuspage.cookie_name(request.url.port), token, httponly=True, path="/",
                            samesite="Strict", secure=request.secure)
        raise response
    return web.Response(body=statuspage.asset("index.html"), content_type="text/html", charset="utf-8",
                        headers={"Cache-Control": "no-store"})


async def status_file(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    if name not in statuspage.ASSETS:
        raise web.HTTPNotFound()
    return web.Response(body=statuspage.asset(name), content_type=statuspage.ASSETS[name], charset="utf-8")


async def join(request: web.Request) -> web.Response:
    host, specs, held = intake.parse_join(await _body(request, intake.MAX_JSON_BYTES))
    credential = request.headers.get(proto.CREDENTIAL_HEADER, "")  # a rejoin may present its old one
    reply = await request.app[RUN].membership.join(host, specs, credential, *held)
    return web.json_response(reply.to_json())


async def heartbeat(request: web.Request) -> web.Response:
    host = _caller(request, request.match_info["host"])
    return web.json_response(await request.app[RUN].membership.heartbeat(host))


async def put_model(request: web.Request) -> web.Response:
    host = _caller(request)
    run = request.app[RUN]
    size = request.content_length
    if size is None:
        raise Refusal(Reason.LENGTH_REQUIRED, "the model upload needs a Content-Length")
    run.membership.check_model_upload(host, size)  # before reading (or allocating for) a single byte
    buf = torch.empty(size, dtype=torch.uint8)
    await within(request, transfer_seconds(run.config, size), read_body_into(request, buf),
                 f"host {host}'s model upload")
    return web.json_response(await run.membership.put_model(host, buf))


async def get_model(request: web.Request) -> web.StreamResponse:
    """The full model, streamed from θ's tensors; a round that closes meanwhile copies aside what is not sent
    yet (copy-on-publish) instead of waiting for the download."""
    run = request.app[RUN]
    state, rounds = run.state, run.rounds
    host = _caller(request)
    state.require_model()
    await rounds.wait_stable()  # θ is not being changed by a round's close
    if len(rounds.downloads) >= MAX_MODEL_DOWNLOADS:
        raise Refusal(Reason.BUSY, f"{MAX_MODEL_DOWNLOADS} model downloads are in flight; try again shortly")
    start, round_ = time.time(), state.round
    stream = state.model.stream(round_)
    rounds.downloads.add(stream)
    response = web.StreamResponse(headers={"Content-Type": proto.OCTETS, "Content-Length": str(stream.size)})

    async def send() -> None:
        await response.prepare(request)
        for chunk in stream.chunks(SEND_CHUNK):
            await response.write(chunk)
        await finish(request, response)

    try:
        await within(request, transfer_seconds(run.config, stream.size), send(), f"host {host}'s model download")
    except Refusal:
        return response
    finally:
        rounds.downloads.discard(stream)
    state.record(PhaseRecord(round_, COORDINATOR, MODEL_MATERIALIZE, start, time.time(), stream.size,
                             extra={"for_host": host, "kept_bytes": stream.kept_bytes}))
    return response


async def post_delta(request: web.Request) -> web.Response:
    """A delta, taken piece by piece as it arrives (:meth:`Rounds.begin_delta`): its header is checked first,
    each piece then (its CRC, its scales) and handed to the accumulator while the next one is still on the wire."""
    run = request.app[RUN]
    rounds = run.rounds
    host, round_ = _caller(request), _int(request.match_info["round"], "round")
    start = time.time()
    await rounds.wait_open(round_)  # (a host back from the round closing, whose sync it took as it streamed)
    rounds.check_upload(host, round_, request.content_length)  # a buffer only for an expected host ...
    uploads: Uploads = request.app[UPLOADS]
    uploads.claim(host)  # ... with no upload in flight
    try:
        async with uploads.reading:
            model = rounds.check_upload(host, round_, request.content_length)  # the round may have moved
            buffers: ReceiveBuffers = request.app[BUFFERS]
            buf = buffers.get(request.content_length or model.layout.total)  # a delta of the tensors that moved
            try:
                await within(request, transfer_seconds(run.config, len(buf)),
                             receive_delta(request, rounds, host, round_, buf, start), f"host {host}'s delta upload")
            except BaseException:
                asyncio.ensure_future(_recycle_after(run, buffers, buf))
                raise
    finally:
        uploads.release(host)
    # the buffer is released back once the delta has been accumulated
    asyncio.ensure_future(_recycle_after(run, buffers, buf))
    return web.json_response({"accepted": True, "round": round_}, status=202)


async def receive_delta(request: web.Request, rounds, host: str, round_: int, buf: torch.Tensor,
                        start: float) -> None:
    """Read the delta's header, then each piece into ``buf``, handing each on as soon as it is in; an upload
    that breaks off, or a bad piece, cuts the delta there (:meth:`Rounds.cut_delta`)."""
    view = memoryview(buf.numpy())
    prefix = safetensors.PREFIX_BYTES
    await read_into(request, view[:prefix])
    try:
        head_end = prefix + safetensors.header_length(bytes(view[:prefix]), len(view), "payload")
    except PayloadError as e:
        raise Refusal(Reason.INVALID, f"delta rejected: {e}") from None
    await read_into(request, view[prefix:head_end])
    delta = await rounds.begin_delta(host, round_, bytes(view[:head_end]), buf, start, _training(request))
    try:
        message = delta.message
        at, last = head_end, len(message.layout.pieces) - 1
        for k in range(last + 1):
            end = message.wire_end(k) if k < last else len(view)  # the last piece with the trailer
            await read_into(request, view[at:end])
            if k == last:
                await rounds.end_delta(delta)
            await rounds.take_piece(delta, k)
            at = end
        if last < 0:
            await read_into(request, view[at:])
            await rounds.end_delta(delta)
    except asyncio.CancelledError:  # too slow (within): the connection is cut
        rounds.cut_delta(delta, Refusal(Reason.TOO_SLOW, "the upload was too slow"))
        raise
    except Refusal as e:  # a bad piece
        cut = rounds.cut_delta(delta, e)
        if cut is e:
            raise
        raise cut from None
    except Exception as e:  # the connection broke
        rounds.cut_delta(delta, e)
        raise


async def read_into(request: web.Request, view: memoryview) -> None:
    """Exactly ``len(view)`` more bytes of the request body into ``view``."""
    pos, size = 0, len(view)
    while pos < size:
        chunk = await request.content.read(size - pos)
        if not chunk:
            raise Refusal(Reason.INVALID, f"body is truncated: it ended {size - pos} bytes early")
        view[pos : pos + len(chunk)] = chunk
        pos += len(chunk)


async def _recycle_after(run: CoordinatorRun, buffers: ReceiveBuffers, buf: torch.Tensor) -> None:
    await run.rounds.accumulated()
    buffers.put(buf)


async def get_sync(request: web.Request) -> web.StreamResponse:
    """Round ``round``'s sync: once published, from its message; while its round closes, streamed as its pieces
    are made (its host applies each as it arrives)."""
    run = request.app[RUN]
    state = run.state
    host = _caller(request)
    round_ = _int(request.match_info["round"], "round")
    wait = min(_wait(request), run.config.long_poll)
    found = await run.rounds.wait_sync(round_, wait, host, _training(request), request.query.get("sending") == "1")
    if found is None:
        return web.Response(status=204, headers={proto.COMPLETE_HEADER: "1" if state.complete else "0"})
    making = found if isinstance(found, SyncInMaking) else None
    message = found.sync if making is not None else found
    model = state.model  # None while a resumed run serves its saved sync without a model
    if model is not None:
        model.reading(message, +1)
    try:
        complete = making.complete if making is not None else run.rounds.is_last(round_)
        response = web.StreamResponse(headers={"Content-Type": proto.OCTETS, "Content-Length": str(len(message)),
                                               proto.COMPLETE_HEADER: "1" if complete else "0"})

        async def send() -> None:
            await response.prepare(request)
            if making is None:
                await write_chunked(response, message.view())
            else:
                async for part in making.parts():
                    await write_chunked(response, part)
            await finish(request, response)

        await within(request, transfer_seconds(run.config, len(message)) + (run.config.long_poll if making else 0),
                     send(), f"host {host}'s sync download of round {round_}")
    except (Refusal, SyncBroken):
        return response
    finally:
        if model is not None:
            model.reading(message, -1)
    return response


async def post_events(request: web.Request) -> web.Response:
    host = _caller(request)
    size = request.content_length
    if size is None:
        raise Refusal(Reason.LENGTH_REQUIRED, "an event batch needs a Content-Length")
    if size > intake.MAX_EVENTS_BYTES:
        raise Refusal(Reason.TOO_LARGE, f"event batch of {size} bytes is larger than {intake.MAX_EVENTS_BYTES}; "
                                        "send smaller batches")
    request.app[BUDGET].charge(host, size)  # before reading: a flood costs its sender's budget, not our time
    batch = intake.parse_records(await request.read(), host, request.app[RUN].config.name)
    request.app[RUN].state.record(*batch.records)
    return web.json_response(batch.answer())


async def exchange_values(request: web.Request) -> web.Response:
    """A host's values under a key (:mod:`~lightning_nodeox.coordinator.values`); 204 when not answered within
    ``wait`` seconds (the host posts again)."""
    run = request.app[RUN]
    host, key = _caller(request), intake.values_key(request.match_info["key"])
    payload = intake.parse_values(await _body(request, proto.MAX_VALUES_BYTES))
    reply = await run.values.exchange(host, key, payload, min(_wait(request), run.config.long_poll))
    if reply is None:
        return web.Response(status=204)
    return web.json_response(reply.to_json())


async def leave(request: web.Request) -> web.Response:
    host = _caller(request, request.match_info["host"], left_ok=True)
    await request.app[RUN].membership.leave(host)
    return web.json_response({"left": True})


def make_app(run: CoordinatorRun, token: str | None, connections: Connections) -> web.Application:
    app = web.Application(middlewares=[errors_and_auth], client_max_size=intake.MAX_JSON_BYTES)
    app[RUN] = run
    app[LOG] = Named(log, run.config.name)
    app[TOKEN] = token or ""
    app[CONNECTIONS] = connections
    app[BUFFERS] = ReceiveBuffers()
    app[UPLOADS] = Uploads()
    app[BUDGET] = intake.TelemetryBudget()
    app.on_response_prepare.append(stamp_time)
    app.router.add_get(proto.HEALTH, health)
    app.router.add_get(proto.STATUS, status)
    app.router.add_get(statuspage.PAGE, status_page)
    app.router.add_get(statuspage.FILES + "{name}", status_file)
    app.router.add_post(proto.JOIN, join)
    app.router.add_put(proto.MODEL, put_model)
    app.router.add_get(proto.MODEL, get_model)
    app.router.add_post(proto.DELTA, post_delta)
    app.router.add_get(proto.SYNC, get_sync)
    app.router.add_post(proto.EVENTS, post_events)
    app.router.add_post(proto.LEAVE, leave)
    app.router.add_post(proto.HEARTBEAT, heartbeat)
    app.router.add_post(proto.VALUES, exchange_values)
    return app


# -- the process --------------------------------------------------------------------------------------------------


def tls_context(config: CoordinatorConfig) -> ssl.SSLContext | None:
    if config.tls_cert is None:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(str(config.tls_cert), str(config.tls_key))
    except (ssl.SSLError, OSError) as e:
        raise SystemExit(f"nodeox: cannot use --tls-cert {config.tls_cert} with --tls-key {config.tls_key}: {e}") from None
    return context


def bound_url(scheme: str, bind_host: str, sockname: tuple) -> str:
    """The URL of the socket really bound: its address (the name given, when a name was given) and port,
    IPv6 literals in brackets."""
    address, port = sockname[0], sockname[1]
    try:
        ipaddress.ip_address(bind_host)
    except ValueError:
        address = bind_host  # a name (a TLS certificate names it, not its address)
    return f"{scheme}://[{address}]:{port}" if ":" in address else f"{scheme}://{address}:{port}"



async def serve(config: CoordinatorConfig, ready_file: Path | None = None, before_publish=None,
                make_run: lifecycle.MakeRun | None = None) -> int:
    """Run the coordinator over HTTP until the run completes (or a signal); returns the exit status. Its URL is
    written to ``ready_file`` once it listens; ``before_publish`` (for comparisons only) is awaited with each
    round's sync before it is published; ``make_run`` builds the run (a site relay's, :mod:`lightning_nodeox.relay`)."""
    open_files = raise_open_file_limit(config.name)

    async def listen(run: CoordinatorRun):
        config = run.config  # as taken up: a resumed run's settings
        connections = Connections(config.max_connections or connection_limit(open_files), config.idle_timeout)
        app = make_app(run, config.token, connections)
        said = app[LOG]
        if connections.limit > open_files - RESERVED_FILES:
            said.warning("--max-connections %d leaves fewer than %d of the %d files this process may open for the "
                         "run itself; lower it or raise the open-file limit (ulimit -Hn)", connections.limit,
                         RESERVED_FILES, open_files)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=SHUTDOWN_GRACE)  # a held upload cannot stall a stop
        await runner.setup()
        loop = asyncio.get_running_loop()

        def handler() -> Handler:
            return Handler(runner.server, connections, said, loop=loop, access_log=None, max_line_size=MAX_HEADER_BYTES,
                           max_field_size=MAX_HEADER_BYTES)

        host, port = parse_bind(config.bind)
        tls = tls_context(config)
        server = await loop.create_server(handler, host, port, ssl=tls, backlog=BACKLOG,
                                          ssl_handshake_timeout=config.idle_timeout if tls else None)
        sweeping = asyncio.ensure_future(connections.sweep_forever())
        url = bound_url(config.scheme, host, server.sockets[0].getsockname())
        info = {"url": url, "pid": os.getpid(), "started": time.time()}
        (Path(config.run_dir) / "coordinator.json").write_text(json.dumps(info))
        if ready_file is not None:
            ready_file.write_text(url)
        print(f"{config.name} listening on {url} (run dir {config.run_dir}, {config.hosts} hosts)", flush=True)
        print(f"{config.name} status page: {statuspage.link(url, config.token)}", flush=True)
        said.info("at most %d connections (open-file limit %d); one waiting %g s for a request is closed",
                  connections.limit, open_files, connections.idle_timeout)

        async def stop() -> None:
            sweeping.cancel()
            server.close()
            await runner.cleanup()

        return stop

    return await lifecycle.run(config, listen, before_publish=before_publish, make_run=make_run)
