"""The round: deltas in, a round's close, its sync published, hosts waiting for it.

A rejected upload changes nothing: it is checked completely (on the parse thread) before its first byte reaches
the accumulator (on the work thread, in order with the round's close).

When a round closes (the rule, also in docs/clusters.md):
- round 0 (only) waits until ``--hosts`` hosts have joined (or for ``--round-timeout``); later rounds never wait
  for hosts that have not joined, whatever ``--hosts`` (also after a restart with a larger one);
- a round closes once every *live* host has sent its delta (begun it: its first piece is in; the close then
  takes each piece as it arrives, see :class:`OuterStep`): a host is live while it is training and has been
  heard from within ``--lease`` seconds (hosts send heartbeats); a host whose lease expires is dropped (no
  longer waited for) until it is heard from again;
- with ``--round-timeout S``, a round also closes after S seconds without the live hosts still missing;
- never with fewer than ``--min-hosts`` deltas (default 1), lowered to the number of hosts still in the run
  (neither finished nor left), so finishing hosts never block the end. While it cannot close, the
  coordinator says every ``status_interval`` seconds whom it waits for, and why
  (:mod:`~lightning_nodeox.coordinator.waiting`).

Stopping together: a host's final delta (its training ended: max_steps, max_epochs, early stopping) makes
its round the run's last one. That round's sync completes the run, so every host ends on the same model
after the same round, and a host that is still training stops at its next round boundary. Nothing else completes
it: hosts that leave or are no longer heard from never end the run (see
:mod:`~lightning_nodeox.coordinator.membership` for a run left without live hosts). Once complete, the coordinator
may stop when every host has left or is no longer heard from.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from ..core.logs import Named
from ..core.phases import AGGREGATE, COORDINATOR, RECEIVE, SYNC_PREPARE, PhaseRecord
from ..core.protocol import Reason, Refusal
from ..core.specs import PayloadError
from ..core import safetensors
from ..core.wire import PayloadSizeError, Message, check_codec, fit_metrics
from .hosts import HostState
from .intake import MAX_SAMPLES
from .metrics import reduce_metrics
from .making import SyncInMaking
from .model import CoordinatorModel, ModelStream
from .recovery import Recovery
from .runstate import RunState

log = logging.getLogger(__name__)

BeforePublish = Callable[[RunState, int, Message], Awaitable[None]]


@dataclass
class Published:
    """What a round's close publishes: its sync (None: none to pass on, hosts fetch the model), whether the run
    completed with it, and the round that opens next."""

    sync: Message | None
    complete: bool
    next_round: int


class RoundClose(Protocol):
    """How a round's accumulated deltas become what it publishes (the root: :class:`OuterStep`; a site relay
    sends them upstream, :mod:`lightning_nodeox.relay.close`). Called on the loop while the round is closing;
    ``since``: when its own part began (its sync_prepare record starts there: a close that streams, at the round's
    close; one that takes the deltas whole, once they are in). ``streams``: whether it takes
    the round's deltas piece by piece as they arrive (the round then starts closing once every delta has begun),
    or whole (once every delta is in)."""

    streams: bool

    async def close(self, rounds: Rounds, model: CoordinatorModel, round_: int, since: float) -> Published: ...


class OuterStep:
    """The root coordinator's close, piece by piece: the sync's header goes out at once; each piece of it (the
    outer step of the round's mean, quantized, applied to θ: :meth:`CoordinatorModel.close_piece`) is made once
    every delta of the round has its tensors in it accumulated, and may be sent while later pieces of the deltas
    still arrive; a final delta in the round completes the run."""

    streams = True  # the close starts once every delta has begun, not once every delta is in

    async def close(self, rounds: Rounds, model: CoordinatorModel, round_: int, since: float) -> Published:
        state = rounds.state
        await rounds.keep_downloads(set(model.moving))  # the round's set: the other tensors stay as they are
        closing = await state.in_worker(model.open_sync, round_, rounds.round_metrics())
        making = rounds.making = SyncInMaking(round_, closing.sync, rounds.stopping)
        await state.notify()  # hosts waiting for the round start downloading
        try:
            for q, piece in enumerate(closing.sync.layout.pieces):
                await rounds.inputs(closing.indices[piece.stop - 1] + 1)
                await state.in_worker(model.close_piece, closing, q)
                making.sealed(q)
            closed = await state.in_worker(model.finish_sync, closing)
        except BaseException:
            making.fail()
            raise
        making.finished()
        message = closed.sync
        refused = {}
        if closed.not_finite:
            refused = {"refused": f"not finite: {', '.join(closed.not_finite[:5])}"}
            rounds.log.error("round %d refused where its result would make %s NaN or Inf: those pieces of the sync "
                             "change nothing (the rest applies; the model is %s). A host's training diverged, or a "
                             "delta is too large for the model's dtype (lower the learning rate, clip gradients)", round_,
                             ", ".join(closed.not_finite[:5]), message.meta.model_hash)
        state.record(PhaseRecord(round_, COORDINATOR, SYNC_PREPARE, since, time.time(), len(message),
                                 extra={"model_hash": message.meta.model_hash, **refused}))
        return Published(message, rounds.stopping, round_ + 1)


@dataclass
class DeltaIntake:
    """One host's delta of the open round while its pieces arrive (:meth:`Rounds.begin_delta`)."""

    host: str
    message: Message
    indices: tuple[int, ...]  # the model's index of each tensor it carries
    samples: int
    start: float
    queued: int = 0  # pieces handed to the accumulator
    taken: int = 0  # pieces accumulated
    cut: str = ""  # why the rest of it is dropped ("" while it goes on)

    @property
    def done(self) -> bool:
        return self.taken == len(self.message.layout.pieces)

    @property
    def begun(self) -> bool:
        """Whether a piece of it was taken (or it has none)."""
        return self.queued > 0 or not self.message.layout.pieces

    def frontier(self, model_tensors: int) -> int:
        """The model's tensors below this index are all in, as far as this delta goes (all, once it is
        accumulated or cut)."""
        if self.cut or self.done:
            return model_tensors
        return self.indices[self.message.layout.pieces[self.taken].first]


class Rounds:
    """The open round's deltas and its close; syncs for the hosts that wait for them. ``before_publish`` (for
    comparisons only, benchmarks/exchange.py) is awaited with each round's sync before it is published;
    ``close_with``: how a round's deltas become its sync (default: the outer step)."""

    def __init__(self, state: RunState, recovery: Recovery, before_publish: BeforePublish | None = None,
                 close_with: RoundClose | None = None) -> None:
        self.state = state
        self.log = Named(log, state.config.name)
        self.recovery = recovery
        self.close_with: RoundClose = close_with or OuterStep()
        self.received: dict[str, int] = {}  # the round's deltas: host -> samples
        self.metrics: dict[str, dict[str, list]] = {}  # the round's deltas' sync_dist values, by host
        self.training: set[str] = set()  # hosts whose delta is in and whose training goes on meanwhile (overlap)
        self.stopping = False  # a final delta came in this round: it is the run's last
        self.closing = False
        self.stable = True  # no close changes θ now: a full-model download may start (a relay's close is stable
        # while it waits for its upstream, until :meth:`hold_theta`)
        self.shutting_down = False  # no round starts closing
        self.downloads: set[ModelStream] = set()  # full-model downloads in flight (copy-on-publish)
        self.before_publish = before_publish
        self._accumulating: list[asyncio.Future] = []
        self.deltas: dict[str, DeltaIntake] = {}  # the open round's deltas as they arrive
        self.making: SyncInMaking | None = None  # the sync of the round closing, while it is made

    @property
    def model(self) -> CoordinatorModel | None:
        return self.state.model

    # -- deltas ---------------------------------------------------------------------------------------------
    async def wait_open(self, round_: int) -> None:
        """A call about the round after the one closing waits until that one is published: its sync streams to
        hosts while it is made (or passed down by a relay), so a quick host may be back before the round is."""
        state = self.state

        def ahead() -> bool:
            return self.closing and round_ == state.round + 1

        while ahead():
            await state.wait(lambda: not ahead(), state.config.long_poll)

    def check_upload(self, host: str, round_: int, size: int | None) -> CoordinatorModel:
        """Refuse an upload before its body is read, where its headers already show it is wrong."""
        state = self.state
        model = state.require_model()
        entry = state.hosts.known(host)
        if state.complete:
            raise Refusal(Reason.LATE, f"the run completed at round {state.published_round}; apply its last sync",
                          round=state.round)
        if round_ == state.round and host in self.received:
            cut = self.deltas[host].cut if host in self.deltas else ""
            if cut:
                raise Refusal(Reason.LATE, f"host {host}'s delta of round {round_} was cut ({cut}): its pieces taken "
                                           "stay in the round, the rest is dropped; apply its sync", round=state.round)
            raise Refusal(Reason.DUPLICATE, f"host {host} already sent its delta for round {round_}")
        if round_ != state.round or self.closing:
            closing = self.closing and round_ == state.round
            late = closing or round_ == state.published_round
            raise Refusal(Reason.LATE if late else Reason.STALE_BASE,
                          f"round {round_} is {'closing' if closing else 'not open'}; the coordinator is at round "
                          f"{state.round}{'' if late else ': fetch the model'}", round=state.round)
        if size is not None and size > model.layout.total:
            q4 = state.config.q4
            raise Refusal(Reason.INVALID, f"delta is {size} bytes but this model's {q4.name} delta is "
                                          f"{model.layout.total} bytes at most ({q4})")
        state.hosts.seen(entry)
        return model

    async def accept_delta(self, host: str, round_: int, buffer: torch.Tensor, received_at: float,
                           training: bool = False) -> dict:
        """A whole received delta (an in-process transport's): :meth:`begin_delta`, each piece, :meth:`end_delta`."""
        state = self.state
        head_end = await state.in_parser(_head_end, buffer)
        delta = await self.begin_delta(host, round_, bytes(buffer[:head_end].numpy()), buffer, received_at,
                                       training)
        try:
            pieces = len(delta.message.layout.pieces)
            for k in range(pieces - 1):
                await self.take_piece(delta, k)
            await self.end_delta(delta)  # the trailer is checked before the last piece is taken
            if pieces:
                await self.take_piece(delta, pieces - 1)
        except Refusal as e:
            raise self.cut_delta(delta, e) from None
        return {"accepted": True, "round": round_}

    async def begin_delta(self, host: str, round_: int, head: bytes, buffer: torch.Tensor, received_at: float,
                          training: bool = False) -> DeltaIntake:
        """A delta's header (``head``, its first bytes) is in: checked completely before anything of the delta is
        taken, the host then counts as sending its delta (the round may start closing once every live host
        has begun); its pieces follow into ``buffer`` (:meth:`take_piece`). ``training``: the host trains on while
        its round is open (overlap), so it does not wait in it (see :meth:`trains_on`)."""
        state = self.state
        await self.wait_open(round_)
        model = self.check_upload(host, round_, buffer.numel())
        try:
            message = await state.in_parser(lambda: Message.read_head(head, buffer, total=buffer.numel()))
        except PayloadSizeError as e:
            q4 = state.config.q4
            raise Refusal(Reason.INVALID, f"delta rejected: it is {buffer.numel()} bytes but this model's {q4.name} "
                                          f"delta is {e.expected} bytes for the tensors its header names ({q4}): "
                                          f"{e}") from None
        except PayloadError as e:
            raise Refusal(Reason.INVALID, f"delta rejected: {e}") from None
        meta = message.meta
        self.check_upload(host, round_, None)  # the round may have moved while the header was checked
        try:
            if meta.kind != "delta" or meta.round != round_ or meta.host != host:
                raise PayloadError(f"payload says kind={meta.kind} round={meta.round} host={meta.host}, "
                                   f"but was sent as round {round_}'s delta of host {host}")
            check_codec(meta.codec, state.config.q4)
            model.positions(meta.tensors)  # the model's tensors, in its order (those that moved on the host)
        except PayloadError as e:
            raise Refusal(Reason.INVALID, f"delta rejected: {e}") from None
        if meta.samples > MAX_SAMPLES:
            raise Refusal(Reason.INVALID, f"delta rejected: {meta.samples} samples in one round; at most {MAX_SAMPLES} "
                                          "(2^24) are taken from one host")
        if meta.base_hash != model.hash:
            raise Refusal(Reason.STALE_BASE, f"delta of host {host} was computed against model {meta.base_hash}, but "
                                             f"round {round_} started from {model.hash}; fetch the model and rejoin",
                          model_hash=model.hash)
        self.received[host] = meta.samples
        self.metrics[host] = meta.metrics
        self.trains_on(host, training)
        self.stopping = self.stopping or meta.final
        entry = state.hosts[host]
        entry.state = HostState.FINISHED if meta.final else HostState.TRAINING
        delta = self.deltas[host] = DeltaIntake(host, message, model.begin_delta(message, meta.samples),
                                                meta.samples, received_at)
        await state.notify()
        asyncio.ensure_future(self.maybe_close())
        return delta

    async def take_piece(self, delta: DeltaIntake, k: int) -> None:
        """Piece ``k`` of ``delta`` is in its buffer: checked (its CRC, its scales), then handed to the
        accumulator (not waiting for it); a bad piece is refused (:meth:`cut_delta` says what becomes of it)."""
        state, message = self.state, delta.message
        try:
            await state.in_parser(message.check_piece, k)
        except PayloadError as e:
            raise Refusal(Reason.INVALID, f"delta rejected: {e}") from None
        if not message.weighted_scales_finite(delta.samples):
            raise Refusal(Reason.INVALID, f"delta rejected: {delta.samples} samples with scales up to "
                                          f"{message.max_scale:.3g} would overflow the accumulator; the host's training "
                                          "diverged or its sample count is wrong")
        if delta.cut or self.deltas.get(delta.host) is not delta:
            return  # the round closed on without the rest of it
        delta.queued = k + 1
        if k == 0:
            asyncio.ensure_future(self.maybe_close())
        model = state.require_model()
        future = asyncio.ensure_future(state.in_worker(model.accumulate_piece, message, k, delta.samples,
                                                       delta.indices))
        self._accumulating.append(future)
        future.add_done_callback(lambda f: self._after_accumulate(f, delta, k))

    async def end_delta(self, delta: DeltaIntake) -> None:
        """The delta's trailer is in (checked before its last piece is taken: a delta of one piece is taken whole
        or not at all)."""
        try:
            await self.state.in_parser(delta.message.read_trailer)
        except PayloadError as e:
            raise Refusal(Reason.INVALID, f"delta rejected: {e}") from None

    def cut_delta(self, delta: DeltaIntake, why: BaseException) -> BaseException:
        """The rest of ``delta`` will not come (a bad piece, a broken or too slow upload): nothing accepted is lost.
        A delta none of whose pieces was taken is as if never sent (its refusal stands; the host may send it
        again); otherwise its pieces taken stay in the round and the rest is dropped (the round no longer waits for
        it), and the host is told so as a late delta: it applies the round's sync. Returns the error to raise."""
        if self.deltas.get(delta.host) is not delta or delta.cut:
            return why
        pieces = len(delta.message.layout.pieces)
        if delta.queued == 0:
            del self.deltas[delta.host]
            self.received.pop(delta.host, None)
            self.metrics.pop(delta.host, None)
            self.training.discard(delta.host)
            model = self.state.model
            if model is not None:
                model.weight -= max(delta.samples, 0)
                model.deltas -= 1
            asyncio.ensure_future(self.state.notify())
            return why
        delta.cut = str(why)  # text: a log record keeps its arguments (an exception would keep its frames)
        self.log.warning("host %s's delta of round %d was cut after %d of its %d pieces (%s): those are taken, the "
                         "rest is dropped from the round", delta.host, self.state.round, delta.queued, pieces,
                         delta.cut)
        asyncio.ensure_future(self.state.notify())
        asyncio.ensure_future(self.maybe_close())
        return Refusal(Reason.LATE, f"the delta was cut after {delta.queued} of its {pieces} pieces ({delta.cut}): those "
                                    f"were taken, the rest is dropped from round {self.state.round}; apply its sync",
                       round=self.state.round)

    def _after_accumulate(self, future: asyncio.Future, delta: DeltaIntake, k: int) -> None:
        if future.cancelled():
            return
        if future.exception() is not None:
            self.log.error("accumulating host %s's delta failed: %r", delta.host, future.exception())
            return
        delta.taken = max(delta.taken, k + 1)
        if delta.done:
            self.state.record(PhaseRecord(self.state.round, COORDINATOR, RECEIVE, delta.start, time.time(),
                                          len(delta.message), extra={"from_host": delta.host}))
        asyncio.ensure_future(self.state.notify())
        asyncio.ensure_future(self.maybe_close())

    def inputs_in(self, below: int) -> bool:
        """Whether every delta of the round has its tensors below model index ``below`` accumulated."""
        model = self.state.model
        n = len(model.specs) if model is not None else 0
        return all(d.frontier(n) >= below for d in self.deltas.values())

    async def inputs(self, below: int) -> None:
        """Wait until :meth:`inputs_in` ``(below)`` (a delta that breaks off is cut by its upload's handler, so this
        never waits for a piece that will not come)."""
        while not await self.state.wait(lambda: self.inputs_in(below), self.state.config.long_poll):
            pass

    async def accumulated(self) -> None:
        """Wait until every delta accepted so far has been accumulated."""
        if self._accumulating:
            await asyncio.gather(*list(self._accumulating), return_exceptions=True)

    # -- closing a round ------------------------------------------------------------------------------------
    def needed(self) -> int:
        """The fewest deltas this round closes with: --min-hosts, lowered to the hosts still in the run."""
        return max(1, min(self.state.config.quorum, self.state.hosts.in_run(self.received)))

    def joins_awaited(self) -> int:
        """How many more hosts the open round waits to join: round 0 waits for ``--hosts``, later rounds for none."""
        state = self.state
        return max(state.config.hosts - len(state.hosts), 0) if state.round == 0 else 0

    def missing(self) -> list[str]:
        """The hosts whose delta the open round still waits for (live ones that have not sent), sorted."""
        return sorted(h.id for h in self.state.hosts.expected(self.received) if h.id not in self.received)

    def _ready_to_close(self) -> bool:
        state = self.state
        if state.model is None or self.closing or self.shutting_down or not self.received:
            return False
        if not self.close_with.streams and not self.inputs_in(len(state.model.specs)):
            return False  # a close that takes the round's deltas whole waits until they are in
        if not all(d.begun for d in self.deltas.values()):
            return False  # a delta counts once its first piece is taken (a bad first piece: as if never sent)
        if len(self.received) < self.needed():
            return False
        everyone = not self.joins_awaited() and not self.missing()
        timeout = state.config.round_timeout
        return everyone or (timeout is not None and time.time() - state.round_opened >= timeout)

    async def maybe_close(self) -> None:
        """Close the open round if it may close (see the module's rules)."""
        if not self._ready_to_close():
            return
        self.closing, self.stable = True, False
        try:
            await self._close()
        except Exception:  # noqa: BLE001 - the model and its hash still agree (close_round); tried again later
            self.log.exception("closing round %d failed; it is tried again", self.state.round)
        finally:
            self.closing, self.stable = False, True
        await self.state.notify()

    async def _close(self) -> None:
        state = self.state
        model = state.require_model()
        round_ = state.round
        late = self.missing()
        if late:  # alive but slow: still in the run, so the next round waits for them again
            self.log.warning("round %d closes on its --round-timeout without host(s) %s", round_,
                             ", ".join(late))
        start = since = time.time()
        aggregating = asyncio.ensure_future(self._aggregated(round_, start))
        if not self.close_with.streams:  # it takes the deltas whole: its own part starts once they are in
            await aggregating
            since = time.time()
        await self.recovery.saved()  # the last round's state is on disk before θ changes again
        try:
            closed = await self.close_with.close(self, model, round_, since)
        finally:
            self.making = None
        await aggregating
        await asyncio.gather(*self._accumulating)
        self._accumulating = []
        if closed.sync is not None and self.before_publish is not None:  # a comparison hook: benchmarks/exchange.py
            try:
                await self.before_publish(state, round_, closed.sync)
            except Exception:  # noqa: BLE001 - the round is applied: publish it regardless
                self.log.exception("before_publish of round %d failed", round_)
        # the round's state changes together, on the loop, after the last await
        if closed.sync is not None:
            model.publish(closed.sync)
        self.received, self.metrics, self.training, self.deltas = {}, {}, set(), {}
        state.complete = state.complete or closed.complete
        state.published_round = closed.next_round - 1
        state.round = closed.next_round
        state.round_opened = time.time()
        self.check_finished()
        if state.complete:
            self.log.info("the run completed after round %d; final model %s", state.published_round,
                          model.hash)
        self.recovery.save_round()
        state.sample_memory()

    async def _aggregated(self, round_: int, start: float) -> None:
        """Record the round's aggregation: from its close's start until every delta's last piece is in."""
        await self.inputs(len(self.state.require_model().specs))
        await asyncio.gather(*self._accumulating, return_exceptions=True)
        self.state.record(PhaseRecord(round_, COORDINATOR, AGGREGATE, start, time.time(),
                                      extra={"hosts": sorted(self.received), "samples": sum(self.received.values())}))

    def round_metrics(self) -> dict[str, list]:
        reduced = reduce_metrics([(self.received[h], m) for h, m in self.metrics.items() if m])
        kept, dropped = fit_metrics(reduced)
        if dropped:
            self.log.warning("round %d's sync has no room for metrics %s", self.state.round, dropped)
        return kept

    async def keep_downloads(self, changing: set[int] | None) -> None:
        """Copy-on-publish: full-model downloads in flight keep the θ they started with (of the tensors
        ``changing``, by index; None: all of them)."""
        streams = list(self.downloads)
        if streams:
            copies = await self.state.in_worker(lambda: [s.unsent(changing) for s in streams])
            for stream, kept in zip(streams, copies):
                stream.keep(kept)

    async def wait_stable(self) -> None:
        """Return once no round's close is changing θ (a full-model download starts only then)."""
        while not self.stable:
            await self.state.wait(lambda: self.stable, self.state.config.long_poll)

    async def hold_theta(self) -> None:
        """θ is about to change outside the close's own step (a relay applying its upstream's sync, or fetching
        its model): no download starts until the close ends, those in flight keep what they have not sent, and a
        save in flight (which may read θ) is on disk first."""
        if self.stable:
            self.stable = False
            await self.recovery.saved()
            await self.keep_downloads(None)

    async def stop_closing(self) -> None:
        """No round starts closing from now on; returns once one that is closing has published (at shutdown)."""
        self.shutting_down = True
        while self.closing:
            await self.state.wait(lambda: not self.closing, self.state.config.long_poll)

    def check_finished(self) -> None:
        """Finished (the coordinator may stop) once the run is complete and every host is gone."""
        state = self.state
        if state.complete and state.hosts.all_gone():
            state.finished.set()

    def trains_on(self, host: str, training: bool) -> None:
        """What ``host`` said with its delta or its latest sync poll of the open round: whether its training goes
        on meanwhile (overlap; it posts its own values) or waits for the sync (the default, also of hosts that
        never say)."""
        if training and host in self.received:
            self.training.add(host)
        else:
            self.training.discard(host)

    # -- syncs ----------------------------------------------------------------------------------------------
    def is_last(self, round_: int) -> bool:
        """Whether round ``round_``'s sync is the run's last: the run completed with that round."""
        return self.state.complete and self.state.published_round == round_

    async def wait_sync(self, round_: int, wait: float, host: str | None = None, training: bool = False,
                        sending: bool = False) -> Message | SyncInMaking | None:
        """Round ``round_``'s sync once its close has begun (while it is made: a :class:`SyncInMaking`) or once
        published; None if not within ``wait`` seconds or if the run completed before that round closed
        (``state.complete`` tells which). ``training``: the host trains on meanwhile (:meth:`trains_on`);
        ``sending``: its delta of the round is on its way (it polls while it uploads), so none is no refusal."""
        state, hosts = self.state, self.state.hosts
        await self.wait_open(round_)
        entry = hosts.get(host or "")
        if entry is not None and entry.state is HostState.LEFT:
            hosts.known(host)
        if round_ < state.published_round:
            raise Refusal(Reason.GONE, f"the sync of round {round_} is gone; the model is at round {state.round}: "
                                  "fetch GET /v1/model", round=state.round)
        if round_ > state.round:
            state.require_model()  # a resumed run whose saved state is behind this host: it gives its model back
            raise Refusal(Reason.NOT_OPEN, f"round {round_} has not started; the coordinator is at round {state.round}",
                          round=state.round)
        if (round_ == state.round and not self.closing and not state.complete and entry is not None and not sending
                and host not in self.received and entry.state in (HostState.TRAINING, HostState.DROPPED)):
            raise Refusal(Reason.NO_DELTA, f"the coordinator holds no delta of host {host} for round {round_} (it "
                                           "restarted, or the delta was never sent): send it again")
        if entry is not None:
            entry.seen, entry.heard = time.monotonic(), True
            if round_ == state.round:
                self.trains_on(host, training)

        def left() -> bool:
            return entry is not None and entry.state is HostState.LEFT

        def making() -> SyncInMaking | None:
            return self.making if self.making is not None and self.making.round == round_ else None

        if not await state.wait(lambda: state.published_round >= round_ or state.complete or left() or making(),
                                wait):
            return None
        if left():
            hosts.known(host)
        if making() is not None and state.published_round < round_:
            if entry is not None:
                hosts.seen(entry)
            return making()
        if state.published_round < round_:
            return None  # complete: no more rounds
        sync = state.model.latest_sync if state.model is not None else self.recovery.saved_sync
        if state.published_round != round_ or sync is None or sync.meta.round != round_:
            raise Refusal(Reason.GONE, f"the sync of round {round_} is gone; fetch GET /v1/model", round=state.round)
        if entry is not None:
            hosts.seen(entry)  # a dropped host that fetches a sync is back: the next round waits for it again
        return sync


def _head_end(buffer: torch.Tensor) -> int:
    """Where a whole message's header ends (its data starts)."""
    try:
        return safetensors.split(buffer.numpy(), "payload")[1]
    except PayloadError as e:
        raise Refusal(Reason.INVALID, f"delta rejected: {e}") from None
