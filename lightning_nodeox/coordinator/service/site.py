"""A run whose rounds close elsewhere: a site relay is a coordinator to its hosts and one host of its upstream.
What it plugs into its coordinator's run is a :class:`~lightning_nodeox.coordinator.link.SiteLink` (where the
site's model comes from, how a round's deltas go upstream and its sync comes back, how values are answered, and its
part of the run's start, ticks and end); what it may do to that run is a :class:`SiteControl` (given to the link at
the start), the only way it changes the coordinator's state; what a close returns is a :class:`Published`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol, TypeVar

import torch

from ...core.phases import PhaseRecord
from ...core.specs import TensorSpec
from ...core.wire import Message
from ..close import Published
from ..config import CoordinatorConfig
from ..data import RunData
from ..making import SyncInMaking
from ..model import CoordinatorModel
from ..recovery import Recovery
from ..rounds import Rounds
from ..runstate import RunState

T = TypeVar("T")

__all__ = ["Published", "RoundMean", "SiteControl", "PassedSync"]


class RoundMean(Protocol):
    """What a site reads of the coordinator's model at its round's close: θ, and the round's accumulated deltas
    (their sum ``acc`` per tensor, the samples ``weights`` behind each and ``weight`` in all, the raw tensors'
    values taken, the tensors that moved, each value's senders where the codec syncs their mean)."""

    specs: tuple[TensorSpec, ...]
    tensors: list[torch.Tensor]
    hash: str
    moving: set[int]
    weight: int
    weights: list[int]
    acc: list[torch.Tensor]
    raw_from: dict[int, str]
    raw_taken: dict[int, torch.Tensor]

    def named(self) -> list[tuple[str, torch.Tensor]]: ...

    def senders_of(self, i: int) -> torch.Tensor | None: ...

    def end_round(self) -> None: ...


class PassedSync:
    """The upstream's sync of the site's round, passed on to the site's hosts as the relay applies it: each piece
    once it is applied here (:meth:`sealed`), the whole once its hash checked (:meth:`finished`); :meth:`fail` when
    the relay fetched the model instead (the site's hosts then ask again)."""

    def __init__(self, making: SyncInMaking) -> None:
        self._making = making

    @property
    def whole(self) -> bool:
        return self._making.ready >= len(self._making)

    def sealed(self, k: int) -> None:
        self._making.sealed(k)

    def finished(self) -> None:
        self._making.finished()

    def fail(self) -> None:
        self._making.fail()


class SiteControl:
    """What a site may do to its coordinator's run (on the run's event loop): read where the run stands, run work on
    its threads, record phases, hold θ still or let it be read, adopt the upstream's model and round, and pass the
    upstream's sync down."""

    def __init__(self, state: RunState, rounds: Rounds, recovery: Recovery) -> None:
        self._state, self._rounds, self._recovery = state, rounds, recovery

    @classmethod
    def of(cls, run) -> SiteControl:
        """The control of a :class:`~lightning_nodeox.coordinator.lifecycle.CoordinatorRun`'s site."""
        return cls(run.state, run.rounds, run.recovery)

    # -- where the run stands ----------------------------------------------------------------------------------
    @property
    def config(self) -> CoordinatorConfig:
        return self._state.config

    @property
    def round(self) -> int:
        return self._state.round

    @property
    def model(self) -> RoundMean | None:
        return self._state.model

    @property
    def resumed(self) -> bool:
        """Whether the run was resumed from its saved state (its model then comes back from its hosts)."""
        return self._recovery.resumed is not None

    @property
    def codec_threads(self) -> int:
        return self._state.pool.threads

    @property
    def final(self) -> bool:
        """Whether a final delta came in the round closing (it is then the run's last)."""
        return self._rounds.deltas.final

    def busy(self) -> bool:
        """Whether the site has a host live, or a delta in the open round."""
        return bool(self._state.hosts.live() or self._rounds.deltas.by_host)

    def round_metrics(self) -> dict[str, list]:
        return self._rounds.round_metrics()

    def taken(self) -> list[tuple[str, int]]:
        """The ``(host, base round)`` of the round's deltas that reported data and were taken whole."""
        return self._rounds.deltas.taken()

    def use_data(self, data: RunData) -> None:
        """The run's data ledger is the site's (:class:`~lightning_nodeox.relay.data.SiteData`)."""
        self._state.data = data

    # -- work and records --------------------------------------------------------------------------------------
    async def in_worker(self, fn: Callable[..., T], *args) -> T:
        return await self._state.in_worker(fn, *args)

    async def in_parser(self, fn: Callable[..., T], *args) -> T:
        return await self._state.in_parser(fn, *args)

    def record(self, record: PhaseRecord) -> None:
        self._state.record(record)

    def listen(self, listener: Callable[[PhaseRecord], None]) -> None:
        """``listener`` is given every record of the run too (the site's go upstream)."""
        self._state.listeners.append(listener)

    async def notify(self) -> None:
        await self._state.notify()

    # -- θ -----------------------------------------------------------------------------------------------------
    async def let_downloads_start(self) -> None:
        """The round's close waits upstream and θ stays as it is meanwhile."""
        await self._rounds.let_downloads_start()

    async def hold_theta(self) -> None:
        """θ is about to change (the upstream's sync or model): no download starts, those in flight keep theirs."""
        await self._rounds.hold_theta()

    async def release_theta(self) -> None:
        await self._rounds.release_theta()

    def pass_down(self, round_: int, sync: Message, complete: bool) -> PassedSync:
        """``sync`` (the upstream's) is round ``round_``'s, sent to the site's hosts as it is applied here."""
        making = SyncInMaking(round_, sync, complete)
        self._rounds.pass_down(making)
        return PassedSync(making)

    # -- the model and the round -------------------------------------------------------------------------------
    async def build_model(self, specs: tuple[TensorSpec, ...], tensors: list[torch.Tensor]) -> RoundMean:
        """A model of the run's kind over ``tensors`` (the upstream's), not yet the run's (:meth:`use_model`)."""
        return await self._state.build_model(specs, tensors)

    async def use_model(self, model: RoundMean, source: str) -> None:
        """``model`` (from :meth:`build_model`) is the run's from now on; ``source`` says where it came from."""
        await self._recovery.model_arrived(model, source)

    def start_at(self, round_: int) -> None:
        """The run's round is the upstream's ``round_`` (joined upstream, before its model is here)."""
        self._state.round, self._state.published_round = round_, round_ - 1

    async def adopt(self, round_: int, model_hash: str) -> None:
        """θ is now the upstream's model of round ``round_`` (fetched or moved on): no sync of it to pass on, so the
        site's hosts fetch θ from here."""
        self._state.require_model().adopt(model_hash)
        self.start_at(round_)
        await self._state.notify()

    def forget_sync(self, model_hash: str) -> None:
        """The round closing has no sync to pass on (θ was fetched upstream): its hash is ``model_hash``."""
        self._state.require_model().adopt(model_hash)
