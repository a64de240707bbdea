"""What every part of the coordinator shares: the run's model, its round numbers, its hosts, whether it is
complete, the condition its waiters wait on, and the threads its tensor work runs on.

Changed only on the event loop. Tensor work goes to threads so the loop keeps answering while a round is
aggregated: one parses and checks uploads, one builds the model, accumulates and prepares syncs, in order
(:meth:`RunState.in_worker`); the run's state is written on a third, owned by
:mod:`~lightning_nodeox.coordinator.recovery`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

from ..core.phases import COORDINATOR, RSS, PhaseRecord
from ..core.pool import WorkerPool
from ..core.protocol import Reason, Refusal
from ..core.specs import TensorSpec
from .config import CoordinatorConfig
from .data import RunData
from .hosts import Hosts
from .model import CoordinatorModel
from .runlog import RunLog, peak_rss_bytes, rss_bytes

T = TypeVar("T")


class RunState:
    """The run as every part sees it; each part owns the fields it writes (see the field comments)."""

    def __init__(self, config: CoordinatorConfig, runlog: RunLog, pool: WorkerPool) -> None:
        self.config = config
        self.runlog = runlog
        self.pool = pool
        self.model: CoordinatorModel | None = None  # set once it arrives (recovery.model_arrived)
        self.round = 0  # the open round (rounds; recovery on resume)
        self.published_round = -1  # the last round whose sync is published
        self.round_opened = time.time()  # when the open round started (or the model arrived)
        self.complete = False  # the round of a final delta is published: the run's end (rounds)
        self.hosts = Hosts(config.lease, config.name)  # who takes part (membership; rounds note uploads and syncs)
        self.data = RunData(config.data_unit, config.name)  # the data ledger, once a host declares its data
        self.changed = asyncio.Condition()  # notified whenever any of the above changes
        self.final_members: set[str] = set()  # the hosts whose delta was in the final round (rounds)
        self.final_served: set[str] = set()  # the hosts sent the final sync or model whole (service)
        self.completed_at: float | None = None  # time.monotonic() when the run completed
        self.finished = asyncio.Event()  # complete, and every host gone: the coordinator may stop
        self.alone_since: float | None = None  # time.monotonic() since when no host is live (membership)
        self.given_up = asyncio.Event()  # no host live for --no-hosts-timeout: stop, resumable (membership)
        self.peak_rss = 0
        self.listeners: list[Callable[[PhaseRecord], None]] = []  # given every record too (a relay's forwarding)
        self._parse = ThreadPoolExecutor(1, thread_name_prefix="nodeox-parse")
        self._work = ThreadPoolExecutor(1, thread_name_prefix="nodeox-work")

    # -- threads ----------------------------------------------------------------------------------------------
    async def in_worker(self, fn: Callable[..., T], *args) -> T:
        """Run tensor work on the coordinator's work thread (in order with aggregation and syncs)."""
        return await asyncio.get_running_loop().run_in_executor(self._work, fn, *args)

    async def in_parser(self, fn: Callable[..., T], *args) -> T:
        """Parse and check an upload on the parse thread (beside the work thread, never blocking it)."""
        return await asyncio.get_running_loop().run_in_executor(self._parse, fn, *args)

    async def build_model(self, specs: tuple[TensorSpec, ...], tensors: list[torch.Tensor]) -> CoordinatorModel:
        """The run's model over ``tensors``, with the run's codec and outer optimizer (built on the work thread):
        the one place the coordinator builds one."""
        config = self.config
        return await self.in_worker(CoordinatorModel, specs, tensors, config.codec, self.pool, config.outer)

    def close(self) -> None:
        self._parse.shutdown(wait=True)
        self._work.shutdown(wait=True)

    # -- waiting --------------------------------------------------------------------------------------------
    async def notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    async def wait(self, predicate: Callable[[], bool], timeout: float) -> bool:
        """Wait until ``predicate()`` holds (checked at each change), at most ``timeout`` seconds; returns it."""
        async with self.changed:
            try:
                await asyncio.wait_for(self.changed.wait_for(predicate), timeout)
                return True
            except asyncio.TimeoutError:
                return predicate()

    # -- the model ------------------------------------------------------------------------------------------
    def require_model(self) -> CoordinatorModel:
        if self.model is None:
            raise Refusal(Reason.NO_MODEL, "the run has no model yet: join (again); a host that holds it provides it")
        return self.model

    # -- records --------------------------------------------------------------------------------------------
    def record(self, *records: PhaseRecord) -> None:
        self.runlog.write(records)
        for listener in self.listeners:
            for r in records:
                listener(r)

    def sample_memory(self) -> int:
        now, rss = time.time(), rss_bytes()
        self.peak_rss = max(self.peak_rss, rss, peak_rss_bytes())
        self.record(PhaseRecord(self.round, COORDINATOR, RSS, now, now,
                                extra={"rss_bytes": rss, "peak_rss_bytes": self.peak_rss,
                                       "cpu_s": time.process_time()}))
        return rss
