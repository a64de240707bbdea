"""An in-process transport: the real coordinator run, served in this process on an event loop of its own
(:func:`~lightning_nodeox.coordinator.service.embed`), and a client that calls its service directly. It is the
second transport the coordinator's service allows (the first is HTTP) and runs what HTTP runs (the same checks, the
same piece loop), so tests can drive each recovery rule of a host's round without a network, and break things on
purpose."""

from __future__ import annotations

import asyncio
import io
import threading
from pathlib import Path

from lightning_nodeox.coordinator.config import CoordinatorConfig
from lightning_nodeox.coordinator.service import CoordinatorService, Embedded, embed
from lightning_nodeox.core.ledger_terms import LeaseReply, reply_from_dict
from lightning_nodeox.core.protocol import (DataSpec, JoinReply, Reason, Refusal, RunComplete, SyncReady, SyncReply, Upload,
                                           ValuesReply)
from lightning_nodeox.core.specs import specs_from_json
from lightning_nodeox.core.transport import delta_outcome, sync_outcome
from lightning_nodeox.host.clock import ClockOffset


class MemoryBody:
    """A body held in memory, as the service reads it (:class:`~lightning_nodeox.coordinator.service.Body`)."""

    def __init__(self, data: bytes | bytearray | memoryview) -> None:
        self._data = memoryview(data)
        self.size: int | None = len(self._data)
        self._at = 0

    async def read_into(self, view: memoryview) -> None:
        end = self._at + len(view)
        if end > len(self._data):
            raise Refusal(Reason.INVALID, f"body is truncated: it ended {end - len(self._data)} bytes early")
        view[:] = self._data[self._at : end]
        self._at = end

    async def read(self) -> bytes:
        rest, self._at = bytes(self._data[self._at :]), len(self._data)
        return rest

    def cut(self) -> None:
        pass


class MemorySink:
    """A payload sent into memory, as the service writes it (:class:`~lightning_nodeox.coordinator.service.Sink`)."""

    places = False  # the bytes themselves, never where they are in a store

    def __init__(self) -> None:
        self.data = bytearray()
        self.complete = False
        self.held: int | None = None
        self.ended = False

    async def locate(self, place, held: int | None = None) -> None:
        raise AssertionError("an in-process sink is never told a place")

    async def begin(self, size: int, complete: bool, held: int | None = None) -> None:
        self.complete, self.held = complete, held

    async def write(self, view: memoryview) -> None:
        self.data += view

    async def end(self) -> None:
        self.ended = True

    def cut(self) -> None:
        pass


def read_all(body) -> bytearray:
    """Everything a host's message or model reader gives."""
    data = bytearray()
    while chunk := body.read(1 << 20):
        data += bytes(chunk)
    return data


class BytesBody:
    """A received body held in memory; ``break_after`` bytes, then it ends early (a broken download)."""

    def __init__(self, data: bytes, break_after: int | None = None) -> None:
        self.size = len(data)
        self._data = io.BytesIO(data if break_after is None else data[:break_after])

    def readinto(self, view: memoryview) -> int:
        return self._data.readinto(view)

    def close(self) -> None:
        pass


class LocalCoordinator:
    """A coordinator's run served in this process (:func:`~lightning_nodeox.coordinator.service.embed`) on a
    background event loop; ``tick()`` is one pass of its periodic work (the server's ticker runs it four times a
    second). ``store``: its state is saved in ``run_dir`` (and a saved run there is resumed); else nothing is saved.
    ``crash()`` ends it as kill -9 would: no shutdown save. ``site``: its rounds close upstream (a site
    relay's :class:`~lightning_nodeox.relay.run.Site`). ``run``, ``state``, ``rounds``, ``membership``: its insides, for tests to look at; the clients
    call only :attr:`service`."""

    def __init__(self, run_dir: Path, hosts: int = 2, *, store: bool = False, site=None, **config) -> None:
        self.config = CoordinatorConfig(hosts=hosts, run_dir=run_dir, bind="127.0.0.1:0", threads=1, **config)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.embedded: Embedded = self.call(embed(self.config, keep_state=store, site=site))
        self.service: CoordinatorService = self.embedded.service
        self.run = self.embedded.run
        self.config = self.run.config  # as taken up: a resumed run's settings
        self.state, self.rounds, self.membership = self.run.state, self.run.rounds, self.run.membership

    def call(self, coroutine, timeout: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def tick(self) -> None:
        self.call(self.embedded.tick())

    def close(self) -> None:
        self._stop(save=True)

    def crash(self) -> None:
        """Stop at once, without the shutdown's save (a save in flight finishes: its thread is joined)."""
        self._stop(save=False)

    def _stop(self, *, save: bool) -> None:
        self.call(self.embedded.stop(save=save))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


class LocalClient:
    """The protocol's calls for host ``host`` (a :class:`~lightning_nodeox.core.transport.HostClient`), straight
    into ``LocalCoordinator.service``: the same operations, checks and piece loop the HTTP server runs.

    ``break_next_sync``: the next sync download ends half-way."""

    url = "local://coordinator"

    def __init__(self, coordinator: LocalCoordinator, host: str, data: DataSpec | None = None) -> None:
        self.coordinator = coordinator  # another one: the host's coordinator restarted
        self.host = host
        self.data = data  # declared with every join (the data ledger)
        self.break_next_sync = False
        self.credential = ""
        self.clock = ClockOffset()  # one process, one clock: offset 0

    @property
    def service(self) -> CoordinatorService:
        return self.coordinator.service

    @property
    def joined(self) -> bool:
        return bool(self.credential)

    def cancel(self) -> None:
        pass

    def _call(self, coroutine):
        return self.coordinator.call(coroutine)

    def _me(self, *, left_ok: bool = False) -> str:
        return self.service.authenticate(self.host, self.credential, left_ok=left_ok)

    def join(self, tensors: list, *, model_hash: str | None = None, round_: int | None = None) -> JoinReply:
        reply = self._call(self.service.join(self.host, specs_from_json(tensors), self.credential, model_hash, round_,
                                             data=self.data))
        self.credential = reply.credential or self.credential
        return reply

    def put_model(self, body) -> str:
        return self._call(self.service.receive_model(self._me(), MemoryBody(read_all(body))))["model_hash"]

    def post_delta(self, round_: int, body, *, training: bool = False) -> Upload:
        if hasattr(body, "read"):  # a message streamed as it is encoded
            body.rewind()
            body = read_all(body)

        def post():
            return self._call(self.service.receive_delta(self._me(), round_, MemoryBody(bytes(body)),
                                                         training=training))

        return delta_outcome(post, self.host, round_)

    def wait_sync(self, round_: int, poll: float = 5.0, *, training=None) -> SyncReply:
        while True:
            reply = self.poll_sync(round_, poll, training=bool(training and training()))
            if reply is not None:
                return reply

    def poll_sync(self, round_: int, poll: float = 5.0, *, training: bool = False,
                  sending: bool = False) -> SyncReply | None:
        return sync_outcome(lambda: self._sync_reply(round_, poll, training, sending))

    def _sync_reply(self, round_: int, poll: float, training: bool = False, sending: bool = False) -> SyncReply | None:
        sink = MemorySink()
        if self._call(self.service.send_sync(self._me(), round_, poll, sink, training=training, sending=sending)):
            data = bytes(sink.data)
            broken, self.break_next_sync = self.break_next_sync, False
            return SyncReady(round_, BytesBody(data, len(data) // 2 if broken else None), sink.complete, sink.held)
        return RunComplete() if self.service.complete else None

    def exchange_values(self, key: str, payload: object, poll: float = 1.0) -> ValuesReply:
        while True:
            reply = self._call(self.service.exchange_values(self._me(), key, payload, poll))
            if reply is not None:
                return reply

    def lease(self, epoch: int | None, units: int = 1) -> LeaseReply:
        return reply_from_dict(self._call(self.service.lease_data(self._me(), epoch, units)))

    def get_model(self) -> BytesBody:
        sink = MemorySink()
        self._call(self.service.send_model(self._me(), sink))
        return BytesBody(bytes(sink.data))

    def post_events(self, records: list[dict], *, retry_for: float = 0.0) -> None:
        pass

    def status(self) -> dict:
        return self.service.status()

    def heartbeat(self) -> float:
        return float(self._call(self.service.heartbeat(self._me()))["lease"])

    def leave(self) -> None:
        self._call(self.service.leave(self._me(left_ok=True)))
