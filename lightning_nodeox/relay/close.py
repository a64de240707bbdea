"""A relay's round close: where the root applies the outer step, a relay sends its site's mean upstream as one
host and publishes to its hosts what comes back.

In order, while the round is closing: on the work thread the site's mean is encoded with the relay's residual
(:meth:`RelayTensors.encode`; samples: the sum of its hosts', final when one of its hosts sent a final delta,
sync_dist values reduced across its hosts); on the upstream thread the delta is uploaded and the root's sync
applied to θ and verified, with a host's recovery rules (:meth:`HostRound.finish_round`). While the upstream's
round goes on (it may take a WAN round) θ does not change, so the site's hosts may download it from the relay;
just before the sync (or a fetched model) changes θ the relay holds it (:meth:`SiteControl.hold_theta`: no download
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

from ..coordinator.service import PassedSync, Published, SiteControl
from ..core.phases import COORDINATOR, SYNC_PREPARE, PhaseRecord
from ..core.streaming import MessageReader
from ..core.wire import Message
from ..host.round import Into
from .data import SiteData
from .upstream import Upstream


class UpstreamClose:
    """A site relay's round close (:meth:`~lightning_nodeox.relay.run.Site.close_round`)."""

    def __init__(self, upstream: Upstream, control: SiteControl, data: SiteData) -> None:
        self.upstream = upstream
        self.control = control
        self.data = data
        self._pending: tuple[int, MessageReader, bool] | None = None  # (round, delta, final) encoded, not yet through

    async def close(self, round_: int, since: float) -> Published:
        control, upstream = self.control, self.upstream
        await upstream.ready.wait()  # the site's first host provided the model; the relay provides it upstream
        hr = upstream.round
        model = control.model
        if control.round != round_:  # meanwhile θ became the upstream's model of a later round (a resumed relay whose
            # upstream moved on): the site's deltas were against the θ before; dropped, as the upstream would a
            # host's stale delta, and its hosts fetch θ
            await control.in_worker(model.end_round)
            self.data.not_sent()  # the data they trained goes back to the site's block
            upstream.log.info("round %d's deltas were of the model before %s moved on to round %d: not sent; the "
                              "site's hosts fetch its model", round_, upstream.url, hr.round)
            return Published(None, hr.complete, hr.round)
        if self._pending is None or self._pending[0] != round_:
            final = control.final
            samples, metrics = round(model.weight), control.round_metrics()
            covered = self.data.carried(control.taken())  # what the site's taken deltas trained
            self.data.sending()

            def encode() -> MessageReader:
                hr.tensors.take_round()
                return hr.encode(hr.tensors.live, samples, final, metrics, covered)

            self._pending = (round_, await control.in_worker(encode), final)
        _, reader, final = self._pending
        await control.let_downloads_start()  # θ does not change while the upstream's round goes on ...
        passing = hr.tensors.passing = PassDown(control, round_, hr, asyncio.get_running_loop())
        try:
            result = await upstream.call(hr.finish_round, reader, final, Into.LIVE)  # ... until RelayTensors holds it
        finally:
            hr.tensors.passing = None
            if passing.passed is not None and not passing.passed.whole:
                passing.passed.fail()  # the relay fetched the model instead: the site's hosts ask again
        self._pending = None
        if result.lease_void:  # the root did not take it: the site's units went back there
            self.data.upstream_void()
        upstream.keep_credential()  # the exchange joined again if the upstream had restarted
        sync = hr.tensors.last_sync
        if sync is None or sync.meta.round != hr.round - 1 or sync.meta.model_hash != hr.model_hash:
            sync = None  # θ was fetched (or the run completed before this round): nothing to pass on
            control.forget_sync(hr.model_hash)
        control.record(PhaseRecord(round_, COORDINATOR, SYNC_PREPARE, since, time.time(),
                                   None if sync is None else len(sync),
                                   extra={"model_hash": hr.model_hash, "upstream": upstream.url,
                                          "samples": reader.message.meta.samples, "contributed": result.contributed}))
        return Published(sync, hr.complete, hr.round)


class PassDown:
    """The upstream's sync of round ``round_``, passed on to the site's hosts as the relay applies it (each piece
    once checked and applied to θ here, :meth:`SiteControl.pass_down`), fed from the upstream thread through the
    loop."""

    def __init__(self, control: SiteControl, round_: int, hr, loop: asyncio.AbstractEventLoop) -> None:
        self.control, self.round, self.hr, self.loop = control, round_, hr, loop
        self.passed: PassedSync | None = None

    def begin(self, sync: Message) -> None:
        if sync.meta.round == self.round:  # (another round's: not the site's to take)
            self.loop.call_soon_threadsafe(self._begin, sync, self.hr.complete)

    def _begin(self, sync: Message, complete: bool) -> None:
        if self.passed is not None:
            return  # asked again after a download broke off: the same sync, already passing
        self.passed = self.control.pass_down(self.round, sync, complete)  # the site's hosts waiting start

    def sealed(self, k: int) -> None:
        self.loop.call_soon_threadsafe(lambda: self.passed is not None and self.passed.sealed(k))

    def finished(self) -> None:
        self.loop.call_soon_threadsafe(lambda: self.passed is not None and self.passed.finished())
