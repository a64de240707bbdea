"""A relay's round close: where the root applies the outer step, a relay sends its site's mean upstream as one
host and publishes to its hosts what comes back.

In order, while the round is closing: on the work thread the site's mean is encoded with the relay's residual
(:meth:`RelayTensors.encode`; samples: the sum of its hosts', final when one of its hosts sent a final delta,
sync_dist values reduced across its hosts); on the upstream thread the delta is uploaded and the root's sync
applied to θ and verified, with a host's recovery rules (:meth:`HostRound.finish_round`). While the upstream's
round goes on (it may take a WAN round) θ does not change, so the site's hosts may download it from the relay;
just before the sync (or a fetched model) changes θ the relay holds it (:meth:`Rounds.hold_theta`: no download
starts until the close ends, those in flight keep what they have not sent, of every tensor, since the root's set
may differ from the site's). The root's sync is published unchanged (the same bytes, so its hash holds on every
host of the site); its round, its complete flag and its hash are the relay's. When the relay had to fetch the
model instead (its base was stale, the hash differed) there is no sync to pass on: its hosts fetch θ from the
relay; so too when θ became the upstream's later model while the round waited to go upstream (a resumed relay
whose upstream moved on): the site's deltas of the θ before are not sent. A close that fails upstream is tried again with the same delta (taken once upstream).
"""

from __future__ import annotations

import asyncio
import time

from ..coordinator.model import CoordinatorModel
from ..coordinator.making import SyncInMaking
from ..coordinator.close import ClosingRound, Published
from ..core.phases import COORDINATOR, SYNC_PREPARE, PhaseRecord
from ..core.streaming import MessageReader
from ..core.wire import Message
from ..host.round import Into
from .upstream import Upstream


class UpstreamClose:
    """The :class:`~lightning_nodeox.coordinator.rounds.RoundClose` of a site relay."""

    streams = False  # the site's mean is taken once every delta of the site is in

    def __init__(self, upstream: Upstream) -> None:
        self.upstream = upstream
        self._pending: tuple[int, MessageReader, bool] | None = None  # (round, delta, final) encoded, not yet through

    async def close(self, rounds: ClosingRound, model: CoordinatorModel, round_: int, since: float) -> Published:
        state, upstream = rounds.state, self.upstream
        await upstream.ready.wait()  # the site's first host provided the model; the relay provides it upstream
        hr = upstream.round
        if state.round != round_:  # meanwhile θ became the upstream's model of a later round (a resumed relay whose
            # upstream moved on): the site's deltas were against the θ before; dropped, as the upstream would a
            # host's stale delta, and its hosts fetch θ
            await state.in_worker(model.end_round)
            upstream.log.info("round %d's deltas were of the model before %s moved on to round %d: not sent; the "
                              "site's hosts fetch its model", round_, upstream.url, hr.round)
            return Published(None, hr.complete, hr.round)
        if self._pending is None or self._pending[0] != round_:
            final = rounds.deltas.final
            samples, metrics = model.weight, rounds.round_metrics()

            def encode() -> MessageReader:
                hr.tensors.take_round()
                return hr.encode(hr.tensors.live, samples, final, metrics)

            self._pending = (round_, await state.in_worker(encode), final)
        _, reader, final = self._pending
        await rounds.let_downloads_start()  # θ does not change while the upstream's round goes on ...
        passing = hr.tensors.passing = PassDown(rounds, round_, hr, asyncio.get_running_loop())
        try:
            result = await upstream.call(hr.finish_round, reader, final, Into.LIVE)  # ... until RelayTensors holds it
        finally:
            hr.tensors.passing = None
            if passing.making is not None and passing.making.ready < len(passing.making):
                passing.making.fail()  # the relay fetched the model instead: the site's hosts ask again
        self._pending = None
        upstream.keep_credential()  # the exchange joined again if the upstream had restarted
        sync = hr.tensors.last_sync
        if sync is None or sync.meta.round != hr.round - 1 or sync.meta.model_hash != hr.model_hash:
            sync = None  # θ was fetched (or the run completed before this round): nothing to pass on
            model.latest_sync = None
            model.hash = hr.model_hash
        state.record(PhaseRecord(round_, COORDINATOR, SYNC_PREPARE, since, time.time(),
                                 None if sync is None else len(sync),
                                 extra={"model_hash": hr.model_hash, "upstream": upstream.url,
                                        "samples": reader.message.meta.samples, "contributed": result.contributed}))
        return Published(sync, hr.complete, hr.round)


class PassDown:
    """The upstream's sync of round ``round_``, passed on to the site's hosts as the relay applies it (each piece
    once checked and applied to θ here): a :class:`~lightning_nodeox.coordinator.making.SyncInMaking` of the
    relay's round, fed from the upstream thread through the loop."""

    def __init__(self, rounds: ClosingRound, round_: int, hr, loop: asyncio.AbstractEventLoop) -> None:
        self.rounds, self.round, self.hr, self.loop = rounds, round_, hr, loop
        self.making: SyncInMaking | None = None

    def begin(self, sync: Message) -> None:
        if sync.meta.round == self.round:  # (another round's: not the site's to take)
            self.loop.call_soon_threadsafe(self._begin, sync, self.hr.complete)

    def _begin(self, sync: Message, complete: bool) -> None:
        if self.making is not None:
            return  # asked again after a download broke off: the same sync, already passing
        self.making = SyncInMaking(self.round, sync, complete)
        self.rounds.pass_down(self.making)  # the site's hosts waiting for the round start downloading

    def sealed(self, k: int) -> None:
        self.loop.call_soon_threadsafe(lambda: self.making is not None and self.making.sealed(k))

    def finished(self) -> None:
        self.loop.call_soon_threadsafe(lambda: self.making is not None and self.making.finished())
