"""Admission at a site relay: a coordinator's (:class:`~lightning_nodeox.coordinator.membership.Membership`),
except where the site's model comes from.

The first host that joins a relay without a model makes the relay join upstream with that host's tensors: when
the upstream has its model, the relay fetches it (once per site, across the WAN) and it becomes the relay's θ
before the host is answered, so the site's hosts fetch it from the relay, not from upstream; when the upstream
asks for the model, the relay asks its host (it provides it as to any coordinator), then provides it upstream.
Either way the relay's round is the upstream's, and its close waits until θ is the upstream's model
(:attr:`Upstream.ready`).
"""

from __future__ import annotations

import asyncio
import logging

import torch

from ..core.modelfile import read_model
from ..core.protocol import JoinReply, Reason, Refusal
from ..core.specs import PayloadError, TensorSpec, check_same_model
from ..coordinator.membership import Membership
from ..coordinator.model import CoordinatorModel
from ..coordinator.recovery import Recovery
from ..coordinator.rounds import Rounds
from ..coordinator.runstate import RunState
from ..host.round import Into
from .upstream import Upstream

log = logging.getLogger(__name__)


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
                log.info("nodeox relay: %s asks for the model; the site's first host provides it", upstream.url)
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

    async def put_model(self, host: str, data: torch.Tensor) -> dict:
        """The site's first host's model becomes the relay's θ; asked for it, the relay provides it upstream."""
        answer = await super().put_model(host, data)
        if self._providing:
            self._providing = False
            model, upstream = self.state.model, self.upstream
            hr = await self._attach(model, self.state.round, ready=False)
            try:
                theirs = await upstream.call(upstream.provide, model, self.state.round)
            except Refusal as e:
                if e.reason is not Reason.HAS_MODEL:
                    raise
                await upstream.call(hr.fetch_model, Into.LIVE)  # another provided it first: θ becomes theirs
                model.hash, model.latest_sync = hr.model_hash, None  # the site's hosts find their base stale
                theirs = hr.model_hash
            if theirs != model.hash:
                raise RuntimeError(f"{upstream.url} hashed the site's model as {theirs}, the relay as {model.hash}")
            upstream.ready.set()
        return answer

    async def _attach(self, model: CoordinatorModel, round_: int, *, ready: bool = True):
        upstream = self.upstream
        hr = await upstream.call(upstream.attach, model, self.state.config.q4, round_, self.state.pool.threads)
        if ready:
            upstream.ready.set()
        return hr
