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
- (``--merge async``: on a quorum instead, and a late delta is merged into a later round:
  :mod:`~lightning_nodeox.coordinator.quorum`, :mod:`~lightning_nodeox.coordinator.merging`)
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
from typing import Protocol

from ..core.logs import Named
from ..core.phases import AGGREGATE, COORDINATOR, DATA, PhaseRecord
from ..core.protocol import Reason, Refusal
from ..core.wire import Message, fit_metrics
from .close import OuterStep, RoundClose
from .deltas import RoundDeltas
from .history import SyncHistory
from .hosts import Host, HostState
from .metrics import reduce_metrics
from .making import SyncInMaking
from .open_round import OpenRound
from .model import CoordinatorModel, ModelStream
from .phase import RoundPhase
from .quorum import CloseRule, close_rule
from .recovery import Recovery
from .runstate import RunState

log = logging.getLogger(__name__)

BeforePublish = Callable[[RunState, int, Message], Awaitable[None]]


class Payloads(Protocol):
    """Where the run's syncs are written besides (with ``--store``: :mod:`~lightning_nodeox.coordinator.payloads`)."""

    def sync_begun(self, making: SyncInMaking) -> None: ...

    async def trim(self, published_round: int) -> None: ...


class Rounds:
    """The open round's close and the syncs hosts wait for, over the round's :class:`RoundPhase` and its deltas
    (:class:`RoundDeltas`). ``before_publish`` (for comparisons only, benchmarks/exchange.py) is awaited with each
    round's sync before it is published; ``close_with``: how a round's deltas become its sync (default: the outer
    step)."""

    def __init__(self, state: RunState, recovery: Recovery, before_publish: BeforePublish | None = None,
                 close_with: RoundClose | None = None) -> None:
        self.state = state
        self.log = Named(log, state.config.name)
        self.recovery = recovery
        self.close_with: RoundClose = close_with or OuterStep()
        self.phase = RoundPhase()
        merge = state.config.merge
        self.history = SyncHistory(merge.kept_back, state)
        self.rule: CloseRule = close_rule(merge)
        self.deltas = RoundDeltas(state, self.phase, self.maybe_close, self.history)
        self.open = OpenRound(state, self.deltas)
        self._recheck: asyncio.TimerHandle | None = None
        self.downloads: set[ModelStream] = set()  # full-model downloads in flight (copy-on-publish)
        self.before_publish = before_publish
        self.making: SyncInMaking | None = None  # the sync of the round closing, while it is made
        self.payloads: Payloads | None = None  # with --store: syncs written there (coordinator/payloads.py)

    @property
    def model(self) -> CoordinatorModel | None:
        return self.state.model

    @property
    def closing(self) -> bool:
        return self.phase.closing

    @property
    def received(self) -> dict[str, int]:
        """The open round's deltas: host -> samples."""
        return self.deltas.received

    async def making_sync(self, sync: Message) -> SyncInMaking:
        """The sync of the round closing is made from now on: hosts waiting for it start downloading it as its
        pieces come."""
        making = SyncInMaking(self.state.round, sync, self.deltas.final)
        self.pass_down(making)
        return making

    def pass_down(self, making: SyncInMaking) -> None:
        """``making`` is the sync of the round closing (a relay's: its upstream's, passed down as it applies it)."""
        self.making = making
        if self.payloads is not None:
            self.payloads.sync_begun(making)
        asyncio.ensure_future(self.state.notify())  # hosts waiting for the round start downloading

    # -- closing a round ------------------------------------------------------------------------------------
    def _ready_to_close(self) -> bool:
        state = self.state
        if state.model is None or not self.phase.may_close or not self.deltas.by_host:
            return False
        if not self.recovery.durable:
            return False  # the last state is not on disk: a restart would go behind a round published now
        if not self.close_with.streams and not self.deltas.inputs_in(len(state.model.specs)):
            return False  # a close that takes the round's deltas whole waits until they are in
        if not all(d.begun for d in self.deltas.by_host.values()):
            return False  # a delta counts once its first piece is taken (a bad first piece: as if never sent)
        now = time.time()
        if self.rule.ready(self.open, now):
            return True
        self._recheck_at(self.rule.recheck_at(self.open, now))
        return False

    def _recheck_at(self, when: float | None) -> None:
        """Check again at ``when`` (a quorum's grace window, or a host due, ends then)."""
        if self._recheck is not None:
            self._recheck.cancel()
            self._recheck = None
        if when is not None:
            loop = asyncio.get_running_loop()
            self._recheck = loop.call_later(max(0.0, when - time.time()) + 1e-3,
                                            lambda: asyncio.ensure_future(self.maybe_close()))

    async def maybe_close(self) -> None:
        """Close the open round if it may close (see the module's rules)."""
        if not self._ready_to_close():
            return
        self.phase.begin_close()
        try:
            await self._close()
        except Exception:  # noqa: BLE001 - the model and its hash still agree (close_round); tried again later
            self.log.exception("closing round %d failed; it is tried again", self.state.round)
        finally:
            self.phase.end_close()
        await self.state.notify()

    async def _close(self) -> None:
        state = self.state
        model = state.require_model()
        round_ = state.round
        late = self.open.missing()
        if late and not state.config.merge.is_async:  # alive but slow: the next round waits for them again
            self.log.warning("round %d closes on its --round-timeout without host(s) %s", round_,
                             ", ".join(late))
        merged = self.rule.merged(self.open, late)
        start = since = time.time()
        aggregating = asyncio.ensure_future(self._aggregated(round_, start, merged))
        if not self.close_with.streams:  # it takes the deltas whole: its own part starts once they are in
            await aggregating
            since = time.time()
        await self.recovery.saved()  # the last round's state is on disk before θ changes again
        try:
            closed = await self.close_with.close(self, model, round_, since)
        finally:
            self.making = None
        await aggregating
        await asyncio.gather(*self.deltas.accumulating)
        if closed.sync is not None and self.before_publish is not None:  # a comparison hook: benchmarks/exchange.py
            try:
                await self.before_publish(state, round_, closed.sync)
            except Exception:  # noqa: BLE001 - the round is applied: publish it regardless
                self.log.exception("before_publish of round %d failed", round_)
        # the round's state changes together, on the loop, after the last await
        if closed.sync is not None:
            model.publish(closed.sync)
            self.history.add(closed.sync)
        self.rule.published(round_, {h: d.start for h, d in self.deltas.by_host.items()}, merged)
        if closed.complete and not state.complete:
            state.final_members, state.completed_at = set(self.received), time.monotonic()
        data = state.data.publish(self.deltas.taken(), self.deltas.whole)  # what its deltas trained: committed
        self.deltas.reset()
        state.complete = state.complete or closed.complete
        state.published_round = closed.next_round - 1
        state.round = closed.next_round
        state.round_opened = time.time()
        self.check_finished()
        if data is not None:
            now = time.time()
            state.record(PhaseRecord(round_, COORDINATOR, DATA, now, now, extra=data))
        if state.complete:
            self.log.info("the run completed after round %d; final model %s", state.published_round,
                          model.hash)
        self.recovery.save_round()
        if self.payloads is not None:
            asyncio.ensure_future(self.payloads.trim(state.published_round))
        state.sample_memory()

    async def _aggregated(self, round_: int, start: float, merged: dict) -> None:
        """Record the round's aggregation: from its close's start until every delta's last piece is in."""
        await self.deltas.inputs(len(self.state.require_model().specs))
        await asyncio.gather(*self.deltas.accumulating, return_exceptions=True)
        self.state.record(PhaseRecord(round_, COORDINATOR, AGGREGATE, start, time.time(),
                                      extra={"hosts": sorted(self.received), "samples": sum(self.received.values()),
                                             **merged}))

    def round_metrics(self) -> dict[str, list]:
        reduced = reduce_metrics([(d.samples, d.metrics) for d in self.deltas.by_host.values() if d.metrics])
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
        while not self.phase.stable:
            await self.state.wait(lambda: self.phase.stable, self.state.config.long_poll)

    async def hold_theta(self) -> None:
        """θ is about to change outside the close's own step (a relay applying its upstream's sync, or fetching
        its model): no download starts until the close ends, those in flight keep what they have not sent, and a
        save in flight (which may read θ) is on disk first."""
        if self.phase.hold():
            await self.recovery.saved()
            await self.keep_downloads(None)

    async def before_trailer(self, round_: int, model_hash: str) -> None:
        """The outer state and data ledger of round ``round_``'s model are on disk before its sync is whole for any
        host (the ledger as the publish of round ``round_ - 1`` will leave it)."""
        data = self.state.data.ahead(self.deltas.taken())
        await self.recovery.save_ahead(round_, model_hash, data)

    async def let_downloads_start(self) -> None:
        """θ stays as it is while the round's close waits (a relay's, for its upstream): full-model downloads may
        start, until :meth:`hold_theta`."""
        self.phase.steady()
        await self.state.notify()

    async def release_theta(self) -> None:
        """θ changed outside a close (:meth:`hold_theta` while the round was open) and is stable again."""
        self.phase.release()
        await self.state.notify()

    async def stop_closing(self) -> None:
        """No round starts closing from now on; returns once one that is closing has published (at shutdown)."""
        self.phase.stop()
        while self.closing:
            await self.state.wait(lambda: not self.closing, self.state.config.long_poll)

    def check_finished(self) -> None:
        """Finished (the coordinator may stop) once the run is complete and every host is gone; a host whose
        delta was in the final round is gone only once it left or was sent the final sync or model whole, or
        ``--final-wait`` seconds after the run completed (a host paused past its lease still gets the final model
        meanwhile)."""
        state = self.state
        if not state.complete or state.finished.is_set():
            return
        waited = state.completed_at is not None and time.monotonic() - state.completed_at >= state.config.final_wait
        if state.hosts.all_gone(() if waited else state.final_members - state.final_served):
            state.finished.set()

    def served_final(self, host: str) -> None:
        """Host ``host`` was sent the run's final sync or model whole: the run's end no longer waits for it."""
        self.state.final_served.add(host)
        self.check_finished()

    # -- syncs ----------------------------------------------------------------------------------------------
    async def _taken_within(self, entry: Host, round_: int, wait: float) -> float | None:
        """``--merge async``: a host's delta of round ``round_`` on its way may yet be merged into a later round, so
        its sync waits until the delta is taken (the reply then says where: :meth:`held`); the seconds of ``wait``
        left, or None when it was not taken within them."""
        began = time.monotonic()
        if not await self.state.wait(lambda: entry.merged_base >= round_, wait):
            return None
        return max(0.0, wait - (time.monotonic() - began))

    def held(self, host: str, round_: int) -> int | None:
        """The later round than ``round_`` whose sync carries ``host``'s latest delta (``--merge async``: a late
        delta's host applies the syncs up to it), or None."""
        entry = self.state.hosts.get(host)
        return entry.merged_into if entry is not None and entry.merged_into > round_ else None

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
        await self.deltas.wait_open(round_)
        entry = hosts.get(host or "")
        if entry is not None and entry.state is HostState.LEFT:
            hosts.known(host)
        if entry is not None and sending and state.config.merge.is_async:
            wait = await self._taken_within(entry, round_, wait)
            if wait is None:
                return None
        if round_ < state.published_round:
            kept = self.history.get(round_)
            if kept is None:
                raise Refusal(Reason.GONE, f"the sync of round {round_} is gone; the model is at round {state.round}: "
                                           "fetch GET /v1/model", round=state.round)
            if entry is not None:
                hosts.seen(entry)
            return kept
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
                self.deltas.trains_on(host, training)

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

