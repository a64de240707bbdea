"""How a round's accumulated deltas become what it publishes: the interface (:class:`RoundClose`) and the root
coordinator's close, the outer step piece by piece (:class:`OuterStep`); a site relay's close sends them upstream
instead (:mod:`lightning_nodeox.relay.close`)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

from ..core.logs import Named
from ..core.phases import COORDINATOR, SYNC_PREPARE, PhaseRecord
from ..core.wire import Message
from .deltas import RoundDeltas
from .making import SyncInMaking
from .model import CoordinatorModel
from .runstate import RunState


@dataclass
class Published:
    """What a round's close publishes: its sync (None: none to pass on, hosts fetch the model), whether the run
    completed with it, and the round that opens next."""

    sync: Message | None
    complete: bool
    next_round: int


class ClosingRound(Protocol):
    """What a close sees of the round it closes (:class:`~lightning_nodeox.coordinator.rounds.Rounds`)."""

    state: RunState
    log: Named
    deltas: RoundDeltas

    async def keep_downloads(self, changing: set[int] | None) -> None: ...

    def round_metrics(self) -> dict[str, list]: ...

    async def making_sync(self, sync: Message) -> SyncInMaking:
        """The round's sync, sent to the hosts waiting for it as its pieces are sealed."""

    def pass_down(self, making: SyncInMaking) -> None:
        """Another's sync in the making (a relay's upstream's) is the round's."""

    async def let_downloads_start(self) -> None:
        """θ stays as it is until the close holds it again (:meth:`hold_theta`)."""

    async def hold_theta(self) -> None: ...

    async def before_trailer(self, round_: int, model_hash: str) -> None:
        """The close has made round ``round_``'s model ``model_hash``; its sync's trailer goes out after this
        (the outer state is made durable here)."""


class RoundClose(Protocol):
    """How a round's accumulated deltas become what it publishes (the root: :class:`OuterStep`; a site relay
    sends them upstream, :mod:`lightning_nodeox.relay.close`). Called on the loop while the round is closing;
    ``since``: when its own part began (its sync_prepare record starts there: a close that streams, at the round's
    close; one that takes the deltas whole, once they are in). ``streams``: whether it takes
    the round's deltas piece by piece as they arrive (the round then starts closing once every delta has begun),
    or whole (once every delta is in)."""

    streams: bool

    async def close(self, rounds: ClosingRound, model: CoordinatorModel, round_: int, since: float) -> Published: ...


class UpstreamClose:
    """The close of a run whose rounds close upstream (a site relay's, :mod:`~lightning_nodeox.coordinator.link`):
    the site's deltas, taken whole, go upstream; what comes back is published."""

    streams = False  # the site's mean is taken once every delta of the site is in

    def __init__(self, site) -> None:
        self.site = site

    async def close(self, rounds: ClosingRound, model: CoordinatorModel, round_: int, since: float) -> Published:
        return await self.site.close_round(round_, since)


class OuterStep:
    """The root coordinator's close, piece by piece: the sync's header goes out at once; each piece of it (the
    outer step of the round's mean, quantized, applied to θ: :meth:`CoordinatorModel.close_piece`) is made once
    every delta of the round has its tensors in it accumulated, and may be sent while later pieces of the deltas
    still arrive; a final delta in the round completes the run."""

    streams = True  # the close starts once every delta has begun, not once every delta is in

    async def close(self, rounds: ClosingRound, model: CoordinatorModel, round_: int, since: float) -> Published:
        state = rounds.state
        await rounds.keep_downloads(set(model.moving))  # the round's set: the other tensors stay as they are
        closing = await state.in_worker(model.open_sync, round_, rounds.round_metrics())
        making = await rounds.making_sync(closing.sync)  # hosts waiting for the round start downloading
        try:
            for q, piece in enumerate(closing.sync.layout.pieces):
                await rounds.deltas.inputs(closing.indices[piece.stop - 1] + 1)
                await state.in_worker(model.close_piece, closing, q)
                making.sealed(q)
            closed = await state.in_worker(model.finish_sync, closing)
            await rounds.before_trailer(round_ + 1, closed.sync.meta.model_hash)
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
        return Published(message, rounds.deltas.final, round_ + 1)
