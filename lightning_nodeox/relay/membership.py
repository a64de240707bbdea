"""Admission at a site relay: a coordinator's (:class:`~lightning_nodeox.coordinator.membership.Membership`),
except where the site's model comes from.

The first host that joins a relay without a model makes the relay join upstream with that host's tensors: when
the upstream has its model, the relay fetches it (once per site, across the WAN) and it becomes the relay's θ
before the host is answered, so the site's hosts fetch it from the relay, not from upstream; when the upstream
asks for the model, the relay asks its host (it provides it as to any coordinator), then provides it upstream
(:meth:`SiteModel.join_upstream_with_model`, from the relay's ticker, which also joins a resumed relay
again once its θ is back). Either way the relay's round is the upstream's, and its close waits until θ is the
upstream's model (:attr:`Upstream.ready`).
"""

from __future__ import annotations

import asyncio
import logging

from ..coordinator.service import RoundMean, SiteControl
from ..core.logs import Named
from ..core.modelfile import read_model
from ..core.protocol import Reason, Refusal
from ..core.specs import PayloadError, TensorSpec, check_same_model
from .upstream import Upstream

log = logging.getLogger(__name__)


class SiteModel:
    """Where a relay's θ comes from (its upstream, or the site's first host) and how it becomes its upstream
    host's model."""

    def __init__(self, upstream: Upstream, control: SiteControl) -> None:
        self.upstream = upstream
        self.control = control
        self.log = Named(log, control.config.name)
        self._joining = asyncio.Lock()
        self._providing = False  # the upstream asked for the model: the site's first host provides it

    async def before_join(self, specs: tuple[TensorSpec, ...]) -> None:
        """A host joins while the relay has no model: join upstream with its tensors (see the module)."""
        async with self._joining:  # hosts joining at once: one joins upstream, the others find it done
            control, upstream = self.control, self.upstream
            if control.model is not None or self._providing:
                return
            reply = await upstream.call(upstream.join, specs)
            if reply.complete:
                raise Refusal(Reason.INVALID, f"the run at {upstream.url} completed at round {reply.round - 1}; "
                                              "this relay has nothing to take part in")
            control.start_at(reply.round)
            if reply.provide_model:
                self._providing = True
                self.log.info("%s asks for the model; the site's first host provides it", upstream.url)
                return
            data = await upstream.call(upstream.fetch)
            try:
                _, _, theirs, tensors = await control.in_parser(read_model, data)
                check_same_model(theirs, specs, f"the model of {upstream.url}")
            except PayloadError as e:
                raise Refusal(Reason.INVALID, f"{e}: the site's hosts must train the upstream run's model") from None
            model = await control.build_model(theirs, tensors)
            if model.hash != reply.model_hash:
                raise RuntimeError(f"the model fetched from {upstream.url} hashes to {model.hash}, not its "
                                   f"{reply.model_hash}")
            await self._attach(model, reply.round)
            await control.use_model(model, f"upstream {upstream.url}")

    def upstream_pending(self) -> bool:
        """Whether the relay holds θ that is not yet its upstream host's model: the site's first host provided it
        (the upstream asked for it), or a resumed relay's θ is back."""
        return self.control.model is not None and not self.upstream.ready.is_set()

    async def join_upstream_with_model(self) -> None:
        """Make the θ the relay holds its upstream host's model: join upstream (again) saying which model it holds,
        providing it when asked, fetching the upstream's when it differs (:meth:`HostRound.rejoin`). A failure is
        logged; the relay's ticker tries again."""
        control, upstream = self.control, self.upstream
        model = control.model
        hr = upstream.round or await self._attach(model, control.round, ready=False)
        try:
            await upstream.call(upstream.rejoin)
        except Exception:  # tried again at the next tick
            self.log.exception("joining %s with the site's model failed; trying again", upstream.url)
            return
        finally:
            await control.release_theta()  # a fetch held θ (SiteControl.hold_theta): downloads may start again
        if hr.model_hash != model.hash:  # the upstream's model is another (it moved on, or another provided it)
            await control.adopt(hr.round, hr.model_hash)  # the site's hosts fetch θ from the relay
        self.log.info("the site's model is %s's at round %d (%s)", upstream.url, hr.round, hr.model_hash)
        upstream.ready.set()
        await control.notify()

    async def _attach(self, model: RoundMean, round_: int, *, ready: bool = True):
        upstream, loop = self.upstream, asyncio.get_running_loop()

        def before_change() -> None:  # on the upstream thread: the loop holds θ (downloads keep their copies)
            asyncio.run_coroutine_threadsafe(self.control.hold_theta(), loop).result()

        hr = await upstream.call(upstream.attach, model, self.control.config.q4, round_, self.control.codec_threads,
                                 before_change)
        if ready:
            upstream.ready.set()
        return hr
