"""The coordinator as a transport sees it: one typed interface holding every operation of the protocol (join, leave,
heartbeat, a delta received piece by piece, a sync sent as it is made, the model both ways, phase records, values,
status). A transport maps its own framing onto these calls and nothing else: HTTP in
:mod:`~lightning_nodeox.coordinator.server`, direct calls in the tests' in-process transport; a new transport is
one new module beside them.

A transport hands the service a :class:`Body` for what it receives (exact reads, and a way to cut the connection)
and a :class:`Sink` for what it sends; the service reads and writes through them, within the time limits of
``--transfer-timeout`` (plus one second per MB; past it the transfer is cut and refused as too slow). Refusals are
:class:`~lightning_nodeox.core.protocol.Refusal`; the transport translates them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar

import torch

from ...core import safetensors
from ...core.logs import Named
from ...core.phases import COORDINATOR, MODEL_MATERIALIZE, PhaseRecord
from ...core.protocol import DataSpec, JoinReply, Reason, Refusal, ValuesReply
from ...core.specs import PayloadError, TensorSpec
from .. import intake
from ..config import CoordinatorConfig
from ..lifecycle import CoordinatorRun
from ..making import SyncBroken, SyncInMaking
from ..payloads import Place
from ..deltas import Delta
from ..uploads import ReceiveBuffers, Uploads

log = logging.getLogger(__name__)

T = TypeVar("T")

READ_CHUNK = 8 << 20  # bytes of the model read from θ at a time
MIN_RATE = 1e6  # bytes/s: a transfer slower than this (after --transfer-timeout) is cut off
MAX_MODEL_DOWNLOADS = 2  # full-model downloads at once (each may keep up to the model's size at a publish)
# refusals of a delta the round will not take (a retry would not be either): its host's data lease is void
DROPPED = frozenset({Reason.LATE, Reason.STALE_BASE, Reason.INVALID, Reason.LEASE_VOID})


class Body(Protocol):
    """A body a transport receives: its declared size (None: not declared), exact reads, and a cut."""

    size: int | None

    async def read_into(self, view: memoryview) -> None:
        """Exactly ``len(view)`` more bytes into ``view``; a body that ends before refuses as ``INVALID``."""

    async def read(self) -> bytes:
        """The rest of the body, whole (small bodies only: their size was checked)."""

    def cut(self) -> None:
        """Break the connection off (the transfer was too slow): what it held is released."""


class Sink(Protocol):
    """Where a transport sends a payload: begun with its size and whether the run completes with it; or, when
    ``places`` (the caller reads a store) and the run's store holds the payload, told where it is instead."""

    places: bool

    async def locate(self, place: Place, held: int | None = None) -> None:
        """Answer with where the payload is (:class:`~lightning_nodeox.coordinator.payloads.Place`); ``held``: a
        sync's :attr:`~lightning_nodeox.core.protocol.SyncReady.held`."""

    async def begin(self, size: int, complete: bool, held: int | None = None) -> None: ...

    async def write(self, view: memoryview) -> None: ...

    async def end(self) -> None:
        """Everything written has left (the payload's buffer may change after this)."""

    def cut(self) -> None: ...


class CoordinatorService:
    """Every operation a transport needs, over one :class:`~lightning_nodeox.coordinator.lifecycle.CoordinatorRun`
    (which starts, ticks and ends the run; this class never does)."""

    def __init__(self, run: CoordinatorRun) -> None:
        self._run = run
        self.log = Named(log, run.config.name)
        self.uploads = Uploads()
        self._buffers = ReceiveBuffers()
        self._budget = intake.TelemetryBudget()
        self.sent_bytes = {"sync": 0, "model": 0}  # what this coordinator sent itself (not through the store)

    @property
    def config(self) -> CoordinatorConfig:
        return self._run.config

    @property
    def complete(self) -> bool:
        """Whether the run completed (a sync poll answered with none tells the host so)."""
        return self._run.state.complete

    # -- who -------------------------------------------------------------------------------------------------
    def authenticate(self, host: str, credential: str, *, left_ok: bool = False) -> str:
        """The id of the host a call names, if ``credential`` is its (a host that left: only to say goodbye again,
        ``left_ok``)."""
        return self._run.membership.authenticate(intake.host_id(host), credential, left_ok=left_ok).id

    async def join(self, host: str, specs: tuple[TensorSpec, ...], credential: str = "",
                   model_hash: str | None = None, round_: int | None = None,
                   data: DataSpec | None = None) -> JoinReply:
        return await self._run.membership.join(host, specs, credential, model_hash, round_, data)

    async def heartbeat(self, host: str) -> dict:
        return await self._run.membership.heartbeat(host)

    async def leave(self, host: str) -> None:
        await self._run.membership.leave(host)

    # -- the model -------------------------------------------------------------------------------------------
    async def receive_model(self, host: str, body: Body) -> dict:
        """The providing host's model (checked before a byte of it is read or allocated for)."""
        membership = self._run.membership
        if body.size is None:
            raise Refusal(Reason.LENGTH_REQUIRED, "the model upload needs a Content-Length")
        membership.check_model_upload(host, body.size)
        buf = torch.empty(body.size, dtype=torch.uint8)
        await self._within(body.read_into(memoryview(buf.numpy())), body.size, f"host {host}'s model upload",
                           body.cut)
        return await membership.put_model(host, buf)

    async def send_model(self, host: str, sink: Sink) -> None:
        """The full model, streamed from θ's tensors; a round that closes meanwhile copies aside what is not sent
        yet (copy-on-publish) instead of waiting for the download."""
        state, rounds = self._run.state, self._run.rounds
        state.require_model()
        if self._run.payloads is not None and sink.places:
            final = state.complete
            place = await self._run.payloads.model_place()
            if place is not None:
                await sink.locate(place)
                if final:
                    rounds.served_final(host)
                return
        await rounds.wait_stable()  # θ is not being changed by a round's close
        if len(rounds.downloads) >= MAX_MODEL_DOWNLOADS:
            raise Refusal(Reason.BUSY, f"{MAX_MODEL_DOWNLOADS} model downloads are in flight; try again shortly")
        start, round_, final = time.time(), state.round, state.complete
        stream = state.require_model().stream(round_)
        rounds.downloads.add(stream)

        async def send() -> None:
            await sink.begin(stream.size, False)
            for chunk in stream.chunks(READ_CHUNK):
                await sink.write(chunk)
                self.sent_bytes["model"] += len(chunk)
            await sink.end()

        try:
            await self._within(send(), stream.size, f"host {host}'s model download", sink.cut)
        except Refusal:
            return  # cut off: it has begun, so there is nothing more to say
        finally:
            rounds.downloads.discard(stream)
        if final:
            rounds.served_final(host)
        state.record(PhaseRecord(round_, COORDINATOR, MODEL_MATERIALIZE, start, time.time(), stream.size,
                                 extra={"for_host": host, "kept_bytes": stream.kept_bytes}))

    # -- a round ---------------------------------------------------------------------------------------------
    async def receive_delta(self, host: str, round_: int, body: Body, *, training: bool = False) -> dict:
        """A delta, taken piece by piece as it arrives: its header is checked first, each piece then (its CRC, its
        scales) and handed to the accumulator while the next one is still on the way. A buffer is taken only for
        a host the round expects with no upload of its own in flight (else ``BUSY``); at most ``MAX_UPLOADS`` bodies
        are read at once (the others wait their turn, unread). ``training``: the host trains on meanwhile."""
        try:
            return await self._receive_delta(host, round_, body, training)
        except Refusal as e:
            if e.reason in DROPPED:  # the round will not take it: the data it trained goes back
                self._run.state.data.refused(host)
            raise

    async def _receive_delta(self, host: str, round_: int, body: Body, training: bool) -> dict:
        deltas = self._run.rounds.deltas
        start = time.time()
        await deltas.wait_open(round_, host)  # (a host back from the round closing, whose sync it took as it streamed)
        deltas.check_upload(host, round_, body.size)
        self.uploads.claim(host)
        try:
            async with self.uploads.reading:
                model = deltas.check_upload(host, round_, body.size)  # the round may have moved meanwhile
                buf = self._buffers.get(body.size or model.layout.total)  # a delta of the tensors that moved
                try:
                    await self._within(self._receive_pieces(host, round_, body, buf, start, training), len(buf),
                                       f"host {host}'s delta upload", body.cut)
                finally:
                    asyncio.ensure_future(self._recycle_after_accumulating(buf))
        finally:
            self.uploads.release(host)
        return {"accepted": True, "round": round_}

    async def _receive_pieces(self, host: str, round_: int, body: Body, buf: torch.Tensor, start: float,
                              training: bool) -> None:
        """The delta's header, then each piece into ``buf``, each handed on as soon as it is in; an upload that
        breaks off, or a bad piece, cuts the delta there (:meth:`RoundDeltas.cut_delta`)."""
        deltas, view = self._run.rounds.deltas, memoryview(buf.numpy())
        prefix = safetensors.PREFIX_BYTES
        await body.read_into(view[:prefix])
        try:
            head_end = prefix + safetensors.header_length(bytes(view[:prefix]), len(view), "payload")
        except PayloadError as e:
            raise Refusal(Reason.INVALID, f"delta rejected: {e}") from None
        await body.read_into(view[prefix:head_end])
        delta = await deltas.begin_delta(host, round_, bytes(view[:head_end]), buf, start, training)
        try:
            await self._take_pieces(delta, body, view, head_end)
        except asyncio.CancelledError:  # too slow: the connection is cut
            deltas.cut_delta(delta, Refusal(Reason.TOO_SLOW, "the upload was too slow"))
            raise
        except Refusal as e:  # a bad piece
            cut = deltas.cut_delta(delta, e)
            if cut is e:
                raise
            raise cut from None
        except Exception as e:  # the connection broke
            deltas.cut_delta(delta, e)
            raise

    async def _take_pieces(self, delta: Delta, body: Body, view: memoryview, at: int) -> None:
        deltas = self._run.rounds.deltas
        message = delta.message
        last = len(message.layout.pieces) - 1
        for k in range(last + 1):
            end = message.wire_end(k) if k < last else len(view)  # the last piece with the trailer
            await body.read_into(view[at:end])
            if k == last:
                await deltas.end_delta(delta)  # the trailer is checked before the last piece is taken
            await deltas.take_piece(delta, k)
            at = end
        if last < 0:
            await body.read_into(view[at:])
            await deltas.end_delta(delta)

    async def delta_place(self, host: str, round_: int, sizes: list[int]) -> dict:
        """Where ``host`` writes its delta of round ``round_`` in the run's store (``--store-deltas``), its parts
        of ``sizes`` bytes (checked as an upload of their sum would be)."""
        store_deltas = self._run.store_deltas
        if store_deltas is None:
            raise Refusal(Reason.INVALID, "this run takes deltas over HTTP (its coordinator has no --store-deltas)")
        self._run.rounds.deltas.check_upload(host, round_, sum(sizes))
        return await store_deltas.place(host, round_, sizes)

    async def receive_placed_delta(self, host: str, round_: int, id_: str, *, training: bool = False) -> dict:
        """``host``'s delta of round ``round_``, written to the store at its place ``id_``: read from there, then
        its parts deleted."""
        store_deltas = self._run.store_deltas
        if store_deltas is None:
            raise Refusal(Reason.INVALID, "this run takes deltas over HTTP (its coordinator has no --store-deltas)")
        reply = await self.receive_delta(host, round_, store_deltas.body(host, round_, id_), training=training)
        await store_deltas.taken(host)
        return reply

    async def _recycle_after_accumulating(self, buf: torch.Tensor) -> None:
        await self._run.rounds.deltas.accumulated()
        self._buffers.put(buf)

    async def send_sync(self, host: str, round_: int, wait: float, sink: Sink, *, training: bool = False,
                        sending: bool = False) -> bool:
        """Round ``round_``'s sync into ``sink``: once published, from its message; while its round closes, as its
        pieces are made (its host applies each as it arrives). False: none within ``wait`` seconds (at most
        ``--long-poll``), or the run completed before that round (:attr:`complete`). ``training``: the host trains
        on meanwhile; ``sending``: its delta of the round is on its way."""
        run = self._run
        wait = min(wait, run.config.long_poll)
        found = await run.rounds.wait_sync(round_, wait, host, training, sending)
        if found is None:
            return False
        making = found if isinstance(found, SyncInMaking) else None
        message = found.sync if making is not None else found
        complete = making.complete if making is not None else run.rounds.is_last(round_)
        held = run.rounds.held(host, round_)
        if await self._locate_sync(host, round_, message, making, complete, held, sink):
            return True
        model = run.state.model  # None while a resumed run serves its saved sync without a model
        if model is not None:
            model.reading(message, +1)
        try:

            async def send() -> None:
                await sink.begin(len(message), complete, held)
                if making is None:
                    await sink.write(message.view())
                    self.sent_bytes["sync"] += len(message)
                else:
                    async for part in making.parts():
                        await sink.write(part)
                        self.sent_bytes["sync"] += len(part)
                await sink.end()

            await self._within(send(), len(message), f"host {host}'s sync download of round {round_}", sink.cut,
                               extra=run.config.long_poll if making else 0.0)
            if complete:
                run.rounds.served_final(host)
        except (Refusal, SyncBroken):
            pass  # it has begun: the host sees a broken download and asks again
        finally:
            if model is not None:
                model.reading(message, -1)
        return True

    async def _locate_sync(self, host: str, round_: int, message, making: SyncInMaking | None, complete: bool,
                           held: int | None, sink: Sink) -> bool:
        """Tell ``sink`` where round ``round_``'s sync is in the run's store, when it is there (a sync served from
        the run's saved state is written there first); False: it is sent as bytes."""
        payloads = self._run.payloads
        if payloads is None or not sink.places:
            return False
        place = payloads.sync_place(round_, message, complete)
        if place is None and making is None and round_ not in payloads.syncs:
            payloads.sync_held(round_, message)
            place = payloads.sync_place(round_, message, complete)
        if place is None:
            return False
        await sink.locate(place, held)
        if complete:
            self._run.rounds.served_final(host)
        return True

    # -- outside rounds --------------------------------------------------------------------------------------
    async def take_records(self, host: str, body: Body) -> dict:
        """A host's batch of phase records, into the run's log (a flood costs its sender's budget, not our time)."""
        if body.size is None:
            raise Refusal(Reason.LENGTH_REQUIRED, "an event batch needs a Content-Length")
        if body.size > intake.MAX_EVENTS_BYTES:
            raise Refusal(Reason.TOO_LARGE, f"event batch of {body.size} bytes is larger than "
                                            f"{intake.MAX_EVENTS_BYTES}; send smaller batches")
        self._budget.charge(host, body.size)  # before reading
        batch = intake.parse_records(await body.read(), host, self.config.name)
        self._run.state.record(*batch.records)
        return batch.answer()

    async def lease_data(self, host: str, epoch: int | None, units: int = 1, seq: int | None = None) -> dict:
        """Up to ``units`` units of the data ledger's epoch ``epoch`` for ``host`` (:mod:`..data`), as a dict;
        ``seq``: the call's number (a retry gets the same answer). None before the run's model is there: a resumed
        run's ledger is the one of the model that comes back (``NO_MODEL``: the host joins again, and may give it
        back), so no unit that model trained is leased again."""
        state = self._run.state
        state.hosts.known(host)
        state.require_model()
        return (await state.data.lease_call(host, epoch, units, seq)).to_dict()

    async def exchange_values(self, host: str, key: str, payload: object, wait: float) -> ValuesReply | None:
        """A host's values under ``key``; None when not answered within ``wait`` seconds (the host asks again)."""
        return await self._run.values.exchange(host, key, payload, min(wait, self.config.long_poll))

    def status(self) -> dict:
        """The run at a glance, with what is live now (``GET /v1/status``, the status page, ``nodeox status``)."""
        run = self._run
        return {**run.status(), "uploads": len(self.uploads.hosts), "live": run.watch.snapshot(self.uploads.hosts),
                "sent_bytes": dict(self.sent_bytes)}

    # -- limits ----------------------------------------------------------------------------------------------
    def transfer_seconds(self, size: int) -> float:
        """How long a transfer of ``size`` bytes may take: --transfer-timeout plus one second per MB."""
        return self.config.transfer_timeout + size / MIN_RATE

    async def _within(self, work: Awaitable[T], size: int, what: str, cut: Callable[[], None], *,
                      extra: float = 0.0) -> T:
        """Await ``work``; past its time limit cut the transfer (freeing what it held) and refuse as too slow."""
        seconds = self.transfer_seconds(size) + extra
        try:
            return await asyncio.wait_for(work, seconds)
        except asyncio.TimeoutError:
            cut()
            self.log.warning("%s took longer than %.0f s; connection cut", what, seconds)
            raise Refusal(Reason.TOO_SLOW, f"{what} took longer than {seconds:.0f} s") from None
