"""Admission at a site relay: a coordinator's (:class:`~lightning_nodeox.coordinator.membership.Membership`),
except where the site's model comes from.

The first host that joins a relay without a model makes the relay join upstream with that host's tensors: when
the upstream has its model, the relay fetches it (once per site, across the WAN) and it becomes the relay's θ
before the host is answered, so the site's hosts fetch it from the relay, not from upstream; when the upstream
asks for the model, the relay asks its host (it provides it as to any coordinator), then provides it upstream
(:meth:`RelayMembership.join_upstream_with_model`, from the relay's ticker, which also joins a resumed relay
again once its θ is back). Either way the relay's round is the upstream's, and its close waits until θ is the
upstream's model (:attr:`Upstream.ready`).
"""

from __future__ import annotations

import asyncio

from ..coordinator.membership import Membership
from ..coordinator.model import CoordinatorModel
from ..coordinator.recovery import Recovery
from ..coordinator.rounds import Rounds
from ..coordinator.runstate import RunState
from ..core.modelfile import read_model
from ..core.protocol import JoinReply, Reason, Refusal
from ..core.specs import PayloadError, TensorSpec, check_same_model
from .upstream import Upstream


class RelayMembership(Membership):
    """A coordinator's admission, with the site's model taken from (or given to) the upstream."""

    def __init__(self, state: RunState, recovery: Recovery, rounds: Rounds, upstream: Upstream) -> None:
        super().__init__(state, recovery, rounds)
        self.upstream = upstream
        self._joining = asyncio.Lock()
        self._providing = False  # the upstream asked for the model: the site's first host provides it

    async def join(self, host: str, specs: tuple[TensorSpec, ...], credential: str = "",
                   model_hash: str | None = None, round_: int | None = None) -> JoinReply:
        if self.state.model is None and self.recovery.resumed is None:
            await self._join_upstream(specs)
        return await super().join(host, specs, credential, model_hash, round_)

    async def _join_upstream(self, specs: tuple[TensorSpec, ...]) -> None:
        async with self._joining:  # hosts joining at once: one joins upstream, the others find it done
            state, upstream = self.state, self.upstream
            if state.model is not None or self._providing:
                return
            reply = await upstream.call(upstream.join, specs)
            if reply.complete:
                raise Refusal(Reason.INVALID, f"the run at {upstream.url} completed at round {reply.round - 1}; "
                                              "this relay has nothing to take part in")
            state.round, state.published_round = reply.round, reply.round - 1
            if reply.provide_model:
                self._providing = True
                self.log.info("%s asks for the model; the site's first host provides it", upstream.url)
                return
            data = await upstream.call(upstream.fetch)
            try:
                _, _, theirs, tensors = await state.in_parser(read_model, data)
                check_same_model(theirs, specs, f"the model of {upstream.url}")
            except PayloadError as e:
                raise Refusal(Reason.INVALID, f"{e}: the site's hosts must train the upstream run's model") from None
            model = await state.build_model(theirs, tensors)
            if model.hash != reply.model_hash:
                raise RuntimeError(f"the model fetched from {upstream.url} hashes to {model.hash}, not its "
                                   f"{reply.model_hash}")
            await self._attach(model, reply.round)
            await self.recovery.model_arrived(model, f"upstream {upstream.url}")

    def upstream_pending(self) -> bool:
        """Whether the relay holds θ that is not yet its upstream host's model: the site's first host provided it
        (the upstream asked for it), or a resumed relay's θ is back."""
        return self.state.model is not None and not self.upstream.ready.is_set()

    async def join_upstream_with_model(self) -> None:
        """Make the θ the relay holds its upstream host's model: join upstream (again) saying which model it holds,
        providing it when asked, fetching the upstream's when it differs (:meth:`HostRound.rejoin`). A failure is
        logged; the relay's ticker tries again."""
        state, upstream = self.state, self.upstream
        model = state.model
        hr = upstream.round or await self._attach(model, state.round, ready=False)
        try:
            await upstream.call(upstream.rejoin)
        except Exception:  # tried again at the next tick
            self.log.exception("joining %s with the site's model failed; trying again", upstream.url)
            return
        finally:
            await self.rounds.release_theta()  # a fetch held θ (Rounds.hold_theta): downloads may start again
        if hr.model_hash != model.hash:  # the upstream's model is another (it moved on, or another provided it)
            model.hash, model.latest_sync = hr.model_hash, None  # the site's hosts fetch θ from the relay
            state.round, state.published_round = hr.round, hr.round - 1
        self.log.info("the site's model is %s's at round %d (%s)", upstream.url, hr.round, hr.model_hash)
        upstream.ready.set()
        await state.notify()

    async def _attach(self, model: CoordinatorModel, round_: int, *, ready: bool = True):
        upstream, loop = self.upstream, asyncio.get_running_loop()

        def before_change() -> None:  # on the upstream thread: the loop holds θ (downloads keep their copies)
            asyncio.run_coroutine_threadsafe(self.rounds.hold_theta(), loop).result()

        hr = await upstream.call(upstream.attach, model, self.state.config.q4, round_, self.state.pool.threads,
                                 before_change)
        if ready:
            upstream.ready.set()
        return hr
