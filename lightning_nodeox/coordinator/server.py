"""The coordinator's HTTP server (aiohttp): the protocol's routes (:mod:`lightning_nodeox.core.protocol`), mapped
onto the coordinator's service (:class:`~lightning_nodeox.coordinator.service.CoordinatorService`, which holds every
operation and its limits); refusals become JSON errors with the status their reason maps to. This module holds only
what is HTTP: routes, authentication and the mapping of errors, request bodies and streamed responses as the
service reads and writes them, and TLS and binding.

Every response carries the coordinator's clock in ``X-Nodeox-Time``, for clock alignment. Calls that name a
host are authenticated by that host's credential; request bodies go through
:mod:`~lightning_nodeox.coordinator.intake` before anything else sees them. With ``--tls-cert`` it serves HTTPS.

Slow and stuck peers cannot hold the run: the service limits every transfer's time (then the connection is cut and
its buffer released), the uploads read at once and the model downloads in flight. Connections are counted and
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

from aiohttp import web
from aiohttp.http_exceptions import LineTooLong

from ..core import protocol as proto
from ..core.files import write_atomic
from ..core.logs import Named
from ..core.protocol import HTTP_STATUS, Reason, Refusal
from ..core.specs import PayloadError
from . import intake, statuspage
from .config import CoordinatorConfig, parse_bind
from .connections import RESERVED_FILES, Connections, connection_limit, raise_open_file_limit
from .service import CoordinatorService, SiteLink, run

log = logging.getLogger(__name__)

SERVICE = web.AppKey("service", CoordinatorService)
TOKEN = web.AppKey("token", str)
CONNECTIONS = web.AppKey("connections", Connections)
LOG = web.AppKey("log", Named)  # the module's logger, named as its run
SEND_CHUNK = 8 << 20  # bytes handed to the transport at a time, so its buffer never holds a whole payload
MAX_HEADER_BYTES = 8190  # the request line and each header field (aiohttp's default, stated)
BACKLOG = 128  # connections queued before they are accepted; also the most asyncio accepts at once, uncounted
SHUTDOWN_GRACE = 5.0  # seconds a request in flight has to end once the coordinator is told to stop (then cut)
FINISH_TIMEOUT = 30.0  # seconds a finished response may take to leave the transport's buffer


class RequestBody:
    """A request's body as the service reads it (:class:`~lightning_nodeox.coordinator.service.Body`)."""

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.size = request.content_length

    async def read_into(self, view: memoryview) -> None:
        pos, size = 0, len(view)
        while pos < size:
            chunk = await self.request.content.read(size - pos)
            if not chunk:
                raise Refusal(Reason.INVALID, f"body is truncated: it ended {size - pos} bytes early")
            view[pos : pos + len(chunk)] = chunk
            pos += len(chunk)

    async def read(self) -> bytes:
        return await self.request.read()

    def cut(self) -> None:
        if self.request.transport is not None:
            self.request.transport.abort()


class ResponseSink:
    """A streamed response as the service writes it (:class:`~lightning_nodeox.coordinator.service.Sink`): a
    slice at a time, waiting for the socket to drain in between (no copy of the whole); or where the payload is in
    the run's store, unless the host asks for the bytes (``?direct=1``: it could not read the store)."""

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.response: web.StreamResponse | None = None
        self.places = request.query.get("direct") != "1"

    async def locate(self, place, held: int | None = None) -> None:
        self.response = web.json_response(place.to_json(), content_type=proto.PLACE,
                                          headers={proto.COMPLETE_HEADER: "1" if place.complete else "0",
                                                   **_held(held)})

    async def begin(self, size: int, complete: bool, held: int | None = None) -> None:
        self.response = web.StreamResponse(headers={"Content-Type": proto.OCTETS, "Content-Length": str(size),
                                                    proto.COMPLETE_HEADER: "1" if complete else "0", **_held(held)})
        await self.response.prepare(self.request)

    async def write(self, view: memoryview) -> None:
        for start in range(0, len(view), SEND_CHUNK):
            await self.response.write(view[start : start + SEND_CHUNK])

    async def end(self) -> None:
        """End the response and wait until the transport has sent everything (it may still reference the
        payload's buffer)."""
        await self.response.write_eof()
        transport = self.request.transport
        deadline = time.monotonic() + FINISH_TIMEOUT
        while transport is not None and transport.get_write_buffer_size() > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.005)

    def cut(self) -> None:
        if self.request.transport is not None:
            self.request.transport.abort()

    def answer(self) -> web.StreamResponse:
        """The response begun (an unbegun one, cut before it began, is empty)."""
        return self.response if self.response is not None else web.Response(status=204)


def _held(held: int | None) -> dict[str, str]:
    return {} if held is None else {proto.HELD_HEADER: str(held)}


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
    except ConnectionResetError:  # the peer went away mid-request: nothing to answer, one line to say
        request.app[LOG].warning(_broken_off(request))
        return web.Response(status=204)  # never sent (aiohttp drops a response to a closed connection)
    except asyncio.CancelledError:
        raise
    except Exception as e:  # noqa: BLE001 - a bug must not take the coordinator down; say it and go on
        request.app[LOG].exception("%s %s failed", request.method, request.path)
        return web.json_response({"error": f"coordinator error: {type(e).__name__}: {e}"}, status=500)


def _broken_off(request: web.Request) -> str:
    """One line for a request whose connection was lost: who, which round, and how much of its body came."""
    who = request.query.get("host") or request.match_info.get("host") or request.remote
    round_ = request.match_info.get("round")
    transfer = "delta upload" if request.method == "POST" else "sync download"
    what = f"{request.method} {request.path}" if round_ is None else f"{transfer} of round {round_}"
    received = (f" after {request.content.total_bytes} of {request.content_length} bytes received"
                if request.content_length else "")
    return f"host {who}'s {what} broke off{received}: the connection was lost"


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
    return request.app[SERVICE].authenticate(host, credential, left_ok=left_ok)


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


# -- handlers -----------------------------------------------------------------------------------------------------


async def health(request: web.Request) -> web.Response:
    return web.json_response({"ok": True})


async def status(request: web.Request) -> web.Response:
    return web.json_response({**request.app[SERVICE].status(), "connections": request.app[CONNECTIONS].status()})


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
    body = await _body(request, intake.MAX_JSON_BYTES)
    host, specs, held = intake.parse_join(body)
    credential = request.headers.get(proto.CREDENTIAL_HEADER, "")  # a rejoin may present its old one
    reply = await request.app[SERVICE].join(host, specs, credential, *held, data=intake.parse_join_data(body))
    return web.json_response(reply.to_json())


async def heartbeat(request: web.Request) -> web.Response:
    host = _caller(request, request.match_info["host"])
    return web.json_response(await request.app[SERVICE].heartbeat(host))


async def put_model(request: web.Request) -> web.Response:
    host = _caller(request)
    return web.json_response(await request.app[SERVICE].receive_model(host, RequestBody(request)))


async def get_model(request: web.Request) -> web.StreamResponse:
    host = _caller(request)
    sink = ResponseSink(request)
    await request.app[SERVICE].send_model(host, sink)
    return sink.answer()


async def post_delta(request: web.Request) -> web.Response:
    host, round_ = _caller(request), _int(request.match_info["round"], "round")
    service = request.app[SERVICE]
    if request.content_type == proto.PLACE:  # written to the run's store at the place it was given
        placed = intake.parse_place(await _body(request, intake.MAX_JSON_BYTES))
        reply = await service.receive_placed_delta(host, round_, placed, training=_training(request))
    else:
        reply = await service.receive_delta(host, round_, RequestBody(request), training=_training(request))
    return web.json_response(reply, status=202)


async def delta_place(request: web.Request) -> web.Response:
    host, round_ = _caller(request), _int(request.match_info["round"], "round")
    sizes = intake.parse_sizes(await _body(request, intake.MAX_JSON_BYTES))
    return web.json_response(await request.app[SERVICE].delta_place(host, round_, sizes))


async def get_sync(request: web.Request) -> web.StreamResponse:
    service = request.app[SERVICE]
    host, round_ = _caller(request), _int(request.match_info["round"], "round")
    sink = ResponseSink(request)
    if not await service.send_sync(host, round_, _wait(request), sink, training=_training(request),
                                   sending=request.query.get("sending") == "1"):
        return web.Response(status=204, headers={proto.COMPLETE_HEADER: "1" if service.complete else "0"})
    return sink.answer()


async def post_events(request: web.Request) -> web.Response:
    host = _caller(request)
    return web.json_response(await request.app[SERVICE].take_records(host, RequestBody(request)))


async def exchange_values(request: web.Request) -> web.Response:
    """A host's values under a key (:mod:`~lightning_nodeox.coordinator.values`); 204 when not answered within
    ``wait`` seconds (the host posts again)."""
    host, key = _caller(request), intake.values_key(request.match_info["key"])
    payload = intake.parse_values(await _body(request, proto.MAX_VALUES_BYTES))
    reply = await request.app[SERVICE].exchange_values(host, key, payload, _wait(request))
    if reply is None:
        return web.Response(status=204)
    return web.json_response(reply.to_json())


async def lease_data(request: web.Request) -> web.Response:
    """Units of the data ledger's epoch for the calling host (:mod:`~lightning_nodeox.coordinator.data`)."""
    host = _caller(request)
    epoch, units, seq = intake.parse_lease(await _body(request, intake.MAX_JSON_BYTES))
    return web.json_response(await request.app[SERVICE].lease_data(host, epoch, units, seq))


async def leave(request: web.Request) -> web.Response:
    host = _caller(request, request.match_info["host"], left_ok=True)
    await request.app[SERVICE].leave(host)
    return web.json_response({"left": True})


def make_app(service: CoordinatorService, token: str | None, connections: Connections) -> web.Application:
    app = web.Application(middlewares=[errors_and_auth], client_max_size=intake.MAX_JSON_BYTES)
    app[SERVICE] = service
    app[LOG] = Named(log, service.config.name)
    app[TOKEN] = token or ""
    app[CONNECTIONS] = connections
    app.on_response_prepare.append(stamp_time)
    app.router.add_get(proto.HEALTH, health)
    app.router.add_get(proto.STATUS, status)
    app.router.add_get(statuspage.PAGE, status_page)
    app.router.add_get(statuspage.FILES + "{name}", status_file)
    app.router.add_post(proto.JOIN, join)
    app.router.add_put(proto.MODEL, put_model)
    app.router.add_get(proto.MODEL, get_model)
    app.router.add_post(proto.DELTA, post_delta)
    app.router.add_post(proto.DELTA_PLACE, delta_place)
    app.router.add_get(proto.SYNC, get_sync)
    app.router.add_post(proto.EVENTS, post_events)
    app.router.add_post(proto.LEAVE, leave)
    app.router.add_post(proto.HEARTBEAT, heartbeat)
    app.router.add_post(proto.VALUES, exchange_values)
    app.router.add_post(proto.DATA_LEASE, lease_data)
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
                site: SiteLink | None = None) -> int:
    """Run the coordinator over HTTP until the run completes (or a signal); returns the exit status. Its URL is
    written to ``ready_file`` once it listens; ``before_publish`` (for comparisons only) is awaited with each
    round's sync before it is published; ``site``: the run's rounds close upstream (a site relay's, :mod:`lightning_nodeox.relay`)."""
    open_files = raise_open_file_limit(config.name)

    async def listen(service: CoordinatorService):
        config = service.config  # as taken up: a resumed run's settings
        connections = Connections(config.max_connections or connection_limit(open_files), config.idle_timeout)
        app = make_app(service, config.token, connections)
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
        write_atomic(Path(config.run_dir) / "coordinator.json", [json.dumps(info).encode()], mode=0o644)
        if ready_file is not None:
            write_atomic(ready_file, [url.encode()], mode=0o644)
        print(f"{config.name} listening on {url} (run dir {config.run_dir}, {config.hosts} hosts, codec "
              f"{config.codec}, outer optimizer {config.outer.name})", flush=True)
        print(f"{config.name} status page: {statuspage.link(url, config.token)}", flush=True)
        said.info("at most %d connections (open-file limit %d); one waiting %g s for a request is closed",
                  connections.limit, open_files, connections.idle_timeout)

        async def stop() -> None:
            sweeping.cancel()
            server.close()
            await runner.cleanup()

        return stop

    return await run(config, listen, before_publish=before_publish, site=site)
