"""The open round's deltas: each host's as its pieces arrive, checked and handed to the accumulator.

A rejected upload changes nothing: it is checked completely (on the parse thread) before its first byte reaches
the accumulator (on the work thread, in order with the round's close). A delta that breaks off is cut where it
broke: its pieces taken stay in the round (:meth:`RoundDeltas.cut_delta`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import torch

from ..core.logs import Named
from ..core.phases import COORDINATOR, RECEIVE, PhaseRecord
from ..core.protocol import Reason, Refusal
from ..core.specs import PayloadError
from ..core.wire import Message, PayloadSizeError, check_codec
from .history import SyncHistory
from .hosts import HostState
from .intake import MAX_SAMPLES
from .merging import staleness_rule
from .model import CoordinatorModel
from .phase import RoundPhase
from .runstate import RunState

log = logging.getLogger(__name__)


@dataclass
class Delta:
    """One host's delta of the open round while its pieces arrive (:meth:`RoundDeltas.begin_delta`), with what it
    said: its samples, its sync_dist values, and whether its host trains on meanwhile (overlap)."""

    host: str
    message: Message
    indices: tuple[int, ...]  # the model's index of each tensor it carries
    samples: int
    metrics: dict[str, list]
    start: float
    training: bool = False  # its host's training goes on while the round is open (overlap)
    base_round: int = 0  # the round whose model it was computed from (earlier than the open one: a late delta)
    weight: float = 0.0  # its weight in the round's mean: its samples, discounted when late (coordinator/merging)
    queued: int = 0  # pieces handed to the accumulator
    taken: int = 0  # pieces accumulated
    cut: str = ""  # why the rest of it is dropped ("" while it goes on)
    covered: bool = False  # it reported data (noted by the run's data ledger before it was taken)

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


class RoundDeltas:
    """The open round's deltas, one per host (:class:`Delta`), whether one of them is final (the round is then the
    run's last), and their accumulation in flight. ``on_change`` is awaited whenever the round may close now."""

    def __init__(self, state: RunState, phase: RoundPhase, on_change: Callable[[], Awaitable[None]],
                 history: SyncHistory) -> None:
        """``history``: the syncs kept, whose base hashes a late delta's is checked against (``--merge async``)."""
        self.state = state
        self.phase = phase
        self.on_change = on_change
        self.history = history
        self.merge = state.config.merge
        self.rule = staleness_rule(self.merge.staleness_rule)
        self.log = Named(log, state.config.name)
        self.by_host: dict[str, Delta] = {}
        self.final = False  # a final delta came in this round: it is the run's last
        self.accumulating: list[asyncio.Future] = []

    def reset(self) -> None:
        """The round published: the next one starts with no delta."""
        self.by_host, self.final, self.accumulating = {}, False, []

    @property
    def received(self) -> dict[str, int]:
        """The round's deltas: host -> samples."""
        return {h: d.samples for h, d in self.by_host.items()}

    @property
    def whole(self) -> dict[str, int]:
        """The round's deltas taken whole (not cut): host -> samples."""
        return {h: d.samples for h, d in self.by_host.items() if not d.cut}

    def taken(self) -> list[tuple[str, int]]:
        """The ``(host, base round)`` of the round's deltas that reported data and were taken whole (the data
        ledger commits those at publish)."""
        return [(h, d.base_round) for h, d in self.by_host.items() if d.covered and not d.cut]

    @property
    def training(self) -> set[str]:
        """Hosts whose delta is in and whose training goes on meanwhile (overlap)."""
        return {h for h, d in self.by_host.items() if d.training}

    def metrics_of(self, host: str) -> dict[str, list]:
        delta = self.by_host.get(host)
        return delta.metrics if delta is not None else {}

    async def wait_open(self, round_: int, host: str | None = None) -> None:
        """A call about the round after the one closing waits until that one is published: its sync streams to
        hosts while it is made (or passed down by a relay), so a quick host may be back before the round is.
        Under ``--merge async`` a delta of the round closing, or of an earlier one, waits too: it goes into the
        round that opens next; so does a delta of ``host`` while the open round holds its late one (it trained on
        without waiting for that round: :meth:`Downloads.behind`)."""
        state = self.state
        late_ok = self.merge.is_async

        def ahead() -> bool:
            if late_ok and host is not None and round_ == state.round:
                held = self.by_host.get(host)
                if held is not None and held.base_round != round_:
                    return True
            return self.phase.closing and (round_ == state.round + 1 or (late_ok and round_ <= state.round))

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
        if round_ == state.round and host in self.by_host:
            cut = self.by_host[host].cut
            if cut:
                raise Refusal(Reason.LATE, f"host {host}'s delta of round {round_} was cut ({cut}): its pieces taken "
                                           "stay in the round, the rest is dropped; apply its sync", round=state.round)
            raise Refusal(Reason.DUPLICATE, f"host {host} already sent its delta for round {round_}")
        if self.merge.is_async and round_ < state.round:
            self._check_late(host, round_, entry)
        elif round_ != state.round or self.phase.closing:
            closing = self.phase.closing and round_ == state.round
            late = closing or round_ == state.published_round
            raise Refusal(Reason.LATE if late else Reason.STALE_BASE,
                          f"round {round_} is {'closing' if closing else 'not open'}; the coordinator is at round "
                          f"{state.round}{'' if late else ': fetch the model'}", round=state.round)
        if size is not None and size > model.layout.total:
            codec = state.config.codec
            raise Refusal(Reason.INVALID, f"delta is {size} bytes but this model's {codec.name} delta is "
                                          f"{model.layout.total} bytes at most ({codec})")
        state.hosts.seen(entry)
        return model

    def _check_late(self, host: str, round_: int, entry) -> None:
        """``--merge async``: a delta of round ``round_``, earlier than the open one, is merged into it unless it
        was merged already (a retry: ``DUPLICATE``), or is too stale (``STALE_BASE``: its host fetches the model)."""
        state = self.state
        if round_ <= entry.merged_base:
            raise Refusal(Reason.DUPLICATE, f"host {host}'s delta of round {round_} was merged already")
        held = self.by_host.get(host)
        if held is not None:
            raise Refusal(Reason.BUSY, f"host {host}'s delta of round {held.base_round} is in round {state.round}; "
                                       "apply its sync before sending another")
        staleness = state.round - round_
        if staleness > self.merge.max_staleness:
            raise Refusal(Reason.STALE_BASE, f"host {host}'s delta of round {round_} is {staleness} rounds behind round "
                                             f"{state.round}, beyond --max-staleness {self.merge.max_staleness}: "
                                             "fetch the model", round=state.round)

    async def begin_delta(self, host: str, round_: int, head: bytes, buffer: torch.Tensor, received_at: float,
                          training: bool = False) -> Delta:
        """A delta's header (``head``, its first bytes) is in: checked completely before anything of the delta is
        taken, the host then counts as sending its delta (the round may start closing once every live host
        has begun); its pieces follow into ``buffer`` (:meth:`take_piece`). ``training``: the host trains on while
        its round is open (overlap), so it does not wait in it (see :meth:`trains_on`)."""
        state = self.state
        await self.wait_open(round_, host)
        model = self.check_upload(host, round_, buffer.numel())
        try:
            message = await state.in_parser(lambda: Message.read_head(head, buffer, total=buffer.numel()))
        except PayloadSizeError as e:
            codec = state.config.codec
            raise Refusal(Reason.INVALID, f"delta rejected: it is {buffer.numel()} bytes but this model's {codec.name} "
                                          f"delta is {e.expected} bytes for the tensors its header names ({codec}): "
                                          f"{e}") from None
        except PayloadError as e:
            raise Refusal(Reason.INVALID, f"delta rejected: {e}") from None
        meta = message.meta
        self.check_upload(host, round_, None)  # the round may have moved while the header was checked
        try:
            if meta.kind != "delta" or meta.round != round_ or meta.host != host:
                raise PayloadError(f"payload says kind={meta.kind} round={meta.round} host={meta.host}, "
                                   f"but was sent as round {round_}'s delta of host {host}")
            check_codec(meta.codec, state.config.codec)
            model.positions(meta.tensors)  # the model's tensors, in its order (those that moved on the host)
        except PayloadError as e:
            raise Refusal(Reason.INVALID, f"delta rejected: {e}") from None
        if meta.samples > MAX_SAMPLES:
            raise Refusal(Reason.INVALID, f"delta rejected: {meta.samples} samples in one round; at most {MAX_SAMPLES} "
                                          "(2^24) are taken from one host")
        base = model.hash if round_ == state.round else self.history.base_hash(round_)
        if meta.base_hash != base:
            raise Refusal(Reason.STALE_BASE, f"delta of host {host} was computed against model {meta.base_hash}, but "
                                             f"round {round_} started from {base or 'a model no longer kept'}; fetch "
                                             "the model and rejoin", model_hash=model.hash)
        if meta.covered is not None:  # noted before the delta is taken: a refusal here changes nothing
            state.data.covered(host, round_, meta.covered)
        self.final = self.final or meta.final
        entry = state.hosts[host]
        entry.state = HostState.FINISHED if meta.final else HostState.TRAINING
        staleness = state.round - round_
        weight = self.rule.weight(meta.samples, staleness) if staleness else float(meta.samples)
        entry.merged_base, entry.merged_into = round_, state.round
        delta = self.by_host[host] = Delta(host, message, model.begin_delta(message, weight), meta.samples,
                                           meta.metrics, received_at, training, covered=meta.covered is not None,
                                           base_round=round_, weight=weight)
        if staleness:
            self.log.info("host %s's delta of round %d is merged into round %d (%d round%s late, weight %.4g of its "
                          "%d samples)", host, round_, state.round, staleness, "s" if staleness > 1 else "", weight,
                          meta.samples)
        await state.notify()
        asyncio.ensure_future(self.on_change())
        return delta

    async def take_piece(self, delta: Delta, k: int) -> None:
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
        if delta.cut or self.by_host.get(delta.host) is not delta:
            return  # the round closed on without the rest of it
        delta.queued = k + 1
        if k == 0:
            asyncio.ensure_future(self.on_change())
        model = state.require_model()
        future = asyncio.ensure_future(state.in_worker(model.accumulate_piece, message, k, delta.weight,
                                                       delta.indices))
        self.accumulating.append(future)
        future.add_done_callback(lambda f: self._after_accumulate(f, delta, k))

    async def end_delta(self, delta: Delta) -> None:
        """The delta's trailer is in (checked before its last piece is taken: a delta of one piece is taken whole
        or not at all)."""
        try:
            await self.state.in_parser(delta.message.read_trailer)
        except PayloadError as e:
            raise Refusal(Reason.INVALID, f"delta rejected: {e}") from None

    def cut_delta(self, delta: Delta, why: BaseException) -> BaseException:
        """The rest of ``delta`` will not come (a bad piece, a broken or too slow upload): nothing accepted is lost.
        A delta none of whose pieces was taken is as if never sent (its refusal stands; the host may send it
        again); otherwise its pieces taken stay in the round and the rest is dropped (the round no longer waits for
        it), and the host is told so as a late delta: it applies the round's sync. Returns the error to raise."""
        if self.by_host.get(delta.host) is not delta or delta.cut:
            return why
        if delta.covered and delta.queued == 0:  # as if never sent: its report too (it may be sent again)
            self.state.data.withdraw(delta.host, delta.base_round)
        elif delta.covered:  # not taken whole: the data it trained goes back (its host leases again)
            self.state.data.refused(delta.host)
        pieces = len(delta.message.layout.pieces)
        if delta.queued == 0:
            del self.by_host[delta.host]
            entry = self.state.hosts.get(delta.host)
            if entry is not None and entry.merged_base == delta.base_round:
                entry.merged_base = entry.merged_into = delta.base_round - 1  # it may be sent again
            model = self.state.model
            if model is not None:
                model.weight -= max(delta.weight, 0)
                model.deltas -= 1
            asyncio.ensure_future(self.state.notify())
            return why
        delta.cut = str(why)  # text: a log record keeps its arguments (an exception would keep its frames)
        self.log.warning("host %s's delta of round %d was cut after %d of its %d pieces (%s): those are taken, the "
                         "rest is dropped from the round", delta.host, self.state.round, delta.queued, pieces,
                         delta.cut)
        asyncio.ensure_future(self.state.notify())
        asyncio.ensure_future(self.on_change())
        return Refusal(Reason.LATE, f"the delta was cut after {delta.queued} of its {pieces} pieces ({delta.cut}): those "
                                    f"were taken, the rest is dropped from round {self.state.round}; apply its sync",
                       round=self.state.round)

    def _after_accumulate(self, future: asyncio.Future, delta: Delta, k: int) -> None:
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
        asyncio.ensure_future(self.on_change())

    def inputs_in(self, below: int) -> bool:
        """Whether every delta of the round has its tensors below model index ``below`` accumulated."""
        model = self.state.model
        n = len(model.specs) if model is not None else 0
        return all(d.frontier(n) >= below for d in self.by_host.values())

    async def inputs(self, below: int) -> None:
        """Wait until :meth:`inputs_in` ``(below)`` (a delta that breaks off is cut by its upload's handler, so this
        never waits for a piece that will not come)."""
        while not await self.state.wait(lambda: self.inputs_in(below), self.state.config.long_poll):
            pass

    async def accumulated(self) -> None:
        """Wait until every delta accepted so far has been accumulated."""
        if self.accumulating:
            await asyncio.gather(*list(self.accumulating), return_exceptions=True)

    def trains_on(self, host: str, training: bool) -> None:
        """What ``host`` said with its delta or its latest sync poll of the open round: whether its training goes
        on meanwhile (overlap; it posts its own values) or waits for the sync (the default, also of hosts that
        never say)."""
        delta = self.by_host.get(host)
        if delta is not None:
            delta.training = training

