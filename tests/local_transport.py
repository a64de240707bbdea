"""An in-process transport: the real coordinator run (``CoordinatorRun``, started, ticked and ended by its own
lifecycle) on an event loop of its own, and a client that calls it directly. It is the second client/server pair
the protocol allows (the first is HTTP), so tests can drive each recovery rule of a host's round without a
network, and break things on purpose."""

from __future__ import annotations

import asyncio
import io
import threading
import time
from pathlib import Path

import torch

from lightning_nodeox.coordinator.config import CoordinatorConfig
from lightning_nodeox.coordinator.lifecycle import CoordinatorRun
from lightning_nodeox.coordinator.making import SyncInMaking
from lightning_nodeox.coordinator.runlog import RunLog
from lightning_nodeox.coordinator.state import RunStore, SavedRun, take_up
from lightning_nodeox.core.pool import WorkerPool
from lightning_nodeox.core.protocol import JoinReply, RunComplete, SyncReady, SyncReply, Upload, ValuesReply
from lightning_nodeox.core.specs import specs_from_json
from lightning_nodeox.core.transport import delta_outcome, sync_outcome
from lightning_nodeox.host.clock import ClockOffset


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
    """A ``CoordinatorRun`` on a background event loop; ``tick()`` is one pass of its periodic work (the server's
    ticker runs it four times a second). ``store``: its state is saved in ``run_dir`` (and a saved run there is
    resumed); else nothing is saved. ``crash()`` ends it as kill -9 would: no shutdown save. ``make_run``: the
    kind of run (default ``CoordinatorRun``)."""

    def __init__(self, run_dir: Path, hosts: int = 2, *, store: bool = False, make_run=CoordinatorRun, **config) -> None:
        self.config = CoordinatorConfig(hosts=hosts, run_dir=run_dir, bind="127.0.0.1:0", threads=1, **config)
        self.store = RunStore(run_dir) if store else None
        saved = None
        if self.store is not None:
            self.config, saved = take_up(self.config)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.pool = WorkerPool(self.config.q4, "cpu", 1)
        self.runlog = RunLog(run_dir)
        self.make_run = make_run  # a CoordinatorRun, or another kind of run (a site relay's)
        self.run: CoordinatorRun = self.call(self._start(saved))
        self.state, self.rounds, self.membership = self.run.state, self.run.rounds, self.run.membership

    async def _start(self, saved: SavedRun | None) -> CoordinatorRun:
        run = self.make_run(self.config, self.runlog, self.pool, self.store)
        await run.start(saved)
        return run

    def call(self, coroutine, timeout: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def tick(self) -> None:
        self.call(self.run.tick())

    def close(self) -> None:
        self.call(self.run.save_at_shutdown())
        self._stop()

    def crash(self) -> None:
        """Stop at once, without the shutdown's save (a save in flight finishes: its thread is joined)."""
        self._stop()

    def _stop(self) -> None:
        self.run.close()
        self.pool.close()
        self.runlog.close()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


class LocalClient:
    """The protocol's calls for host ``host`` (a :class:`~lightning_nodeox.core.transport.HostClient`), straight
    into ``LocalCoordinator.run``.

    ``break_next_sync``: the next sync download ends half-way. ``drop_sync_of``: the sync of that round is
    never applied by this host (as if lost), so its next delta is computed against a stale model."""

    url = "local://coordinator"

    def __init__(self, coordinator: LocalCoordinator, host: str) -> None:
        self.coordinator = coordinator
        self.state, self.rounds, self.membership = coordinator.state, coordinator.rounds, coordinator.membership
        self.host = host
        self.break_next_sync = False
        self.credential = ""
        self.clock = ClockOffset()  # one process, one clock: offset 0

    @property
    def joined(self) -> bool:
        return bool(self.credential)

    def cancel(self) -> None:
        pass

    def join(self, tensors: list, *, model_hash: str | None = None, round_: int | None = None) -> JoinReply:
        reply = self.coordinator.call(self.membership.join(self.host, specs_from_json(tensors), self.credential,
                                                       model_hash, round_))
        self.credential = reply.credential or self.credential
        return reply

    def put_model(self, body) -> str:
        data = bytearray()
        while chunk := body.read(1 << 20):
            data += bytes(chunk)
        tensor = torch.frombuffer(data, dtype=torch.uint8)
        return self.coordinator.call(self.membership.put_model(self.host, tensor))["model_hash"]

    def post_delta(self, round_: int, body, *, training: bool = False) -> Upload:
        if hasattr(body, "read"):  # a message streamed as it is encoded
            body.rewind()
            data = bytearray()
            while chunk := body.read(1 << 20):
                data += bytes(chunk)
            body = data
        buffer = torch.frombuffer(bytearray(body), dtype=torch.uint8)

        async def post() -> None:
            self.rounds.check_upload(self.host, round_, buffer.numel())
            await self.rounds.accept_delta(self.host, round_, buffer, time.time(), training)

        return delta_outcome(lambda: self.coordinator.call(post()), self.host, round_)

    def wait_sync(self, round_: int, poll: float = 5.0, *, training=None) -> SyncReply:
        while True:
            reply = self.poll_sync(round_, poll, training=bool(training and training()))
            if reply is not None:
                return reply

    def poll_sync(self, round_: int, poll: float = 5.0, *, training: bool = False,
                  sending: bool = False) -> SyncReply | None:
        return sync_outcome(lambda: self._sync_reply(round_, poll, training, sending))

    def _sync_reply(self, round_: int, poll: float, training: bool = False, sending: bool = False) -> SyncReply | None:
        found = self.coordinator.call(self.rounds.wait_sync(round_, poll, self.host, training, sending))
        if found is not None:
            if isinstance(found, SyncInMaking):  # streamed as its pieces are made: taken whole here
                async def whole() -> bytes:
                    return b"".join([bytes(part) async for part in found.parts()])

                complete, data = found.complete, self.coordinator.call(whole())
            else:
                complete, data = self.rounds.is_last(round_), bytes(found.view())
            broken, self.break_next_sync = self.break_next_sync, False
            return SyncReady(round_, BytesBody(data, len(data) // 2 if broken else None), complete)
        return RunComplete() if self.state.complete else None

    def exchange_values(self, key: str, payload: object, poll: float = 1.0) -> ValuesReply:
        while True:
            reply = self.coordinator.call(self.coordinator.run.values.exchange(self.host, key, payload, poll))
            if reply is not None:
                return reply

    def get_model(self) -> BytesBody:
        async def chunks() -> bytes:
            model = self.state.require_model()
            return b"".join(bytes(v) for v in model.model_chunks(self.state.round))

        return BytesBody(self.coordinator.call(chunks()))

    def post_events(self, records: list[dict], *, retry_for: float = 0.0) -> None:
        pass

    def heartbeat(self) -> float:
        return float(self.coordinator.call(self.membership.heartbeat(self.host))["lease"])

    def leave(self) -> None:
        self.coordinator.call(self.membership.leave(self.host))
