"""A coordinator's run from its start to its end, whatever transport carries the protocol (HTTP in
:mod:`~lightning_nodeox.coordinator.server`, in-process in the tests).

Start: with ``--store``, the store is checked and the run's lease taken, and the run's state is taken up from the
store when the run directory holds none (:mod:`~lightning_nodeox.coordinator.claim`). A saved, unfinished run in
the run directory is resumed (its model from its snapshot, or given back by a host that rejoins,
:mod:`~lightning_nodeox.coordinator.recovery`); else ``--initial-model`` is loaded when given;
else the first host to join provides the model.

While it runs, four times a second: the run's lease in the store is renewed when due (every third of its length,
on a thread), hosts whose lease expired are dropped, a round whose ``--round-timeout``
passed closes, a save that failed is tried again (every ``Recovery.RETRY_S``), a resumed run whose model no host gave back in time falls back to its snapshot, whom an open round
waits for is logged every ``status_interval`` seconds, and memory is sampled every ``--rss-interval``.

End: on SIGINT/SIGTERM, once no host was live for ``--no-hosts-timeout`` (the run unfinished), or
(``exit_when_done``) once the run is complete and every host is gone: a host whose delta was in the final round
counts as gone once it left (it has the final model), or ``--final-wait`` seconds after the run completed, so a
host paused past its lease still gets the final model when it resumes. The transport
stops first, then a round that is closing publishes (no other starts), and the run's state is written with a
snapshot of the model; the exit status is 0 for a completed run, 1 for one stopped before, 2 for one that could
not start. A coordinator whose lease in the store is lost stops at once, its transport first, and saves nothing
(status 1): the run may be another coordinator's now.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any
from pathlib import Path

import torch

from ..core.cpu import choose_threads
from ..core.logs import Named
from ..core.modelfile import read_named_model
from ..core.phases import COORDINATOR, RESTART, PhaseRecord
from ..core.pool import WorkerPool
from ..core.stores import open_store
from .claim import Claim, claim_store
from .config import CoordinatorConfig
from .lock import RunDirLock
from .membership import Membership
from .payloads import StorePayloads
from .storedeltas import StoreDeltas
from .recovery import Recovery
from .close import UpstreamClose
from .link import SiteLink
from .rounds import BeforePublish, Rounds
from .runlog import RunLog
from .runstate import RunState
from .state import RunStore, SavedRun, take_up
from .values import ValueExchanges
from .waiting import waiting_for
from .watch import RunWatch

log = logging.getLogger(__name__)

TICK = 0.25  # seconds between the periodic checks

Listen = Callable[["CoordinatorRun"], Awaitable[Callable[[], Awaitable[None]]]]
SiteControls = Callable[["CoordinatorRun"], Any]  # what a site may do to the run (service.site.SiteControl.of)


class CoordinatorRun:
    """One run's parts, sharing one :class:`RunState`: who takes part (``membership``), the round (``rounds``),
    values exchanged outside rounds (``values``) and what survives a restart (``recovery``); a transport calls
    these, and this class starts, ticks and ends them. ``store`` None: nothing is saved (nor resumed). ``site``: the
    run's rounds close upstream (a site relay, :mod:`~lightning_nodeox.coordinator.link`), acting on the run through
    ``controls(run)``. ``claim``: what it holds in the run's object store (its lease is renewed by the ticks)."""

    def __init__(self, config: CoordinatorConfig, runlog: RunLog, pool: WorkerPool, store: RunStore | None = None,
                 before_publish: BeforePublish | None = None, *, site: SiteLink | None = None,
                 controls: SiteControls | None = None, claim: Claim | None = None) -> None:
        self.state = RunState(config, runlog, pool)
        self.claim = claim  # the run's lease and state copy in its object store (--store), None without one
        self.log = Named(log, config.name)
        self.recovery = Recovery(self.state, store)
        self.rounds = Rounds(self.state, self.recovery, before_publish, None if site is None else UpstreamClose(site))
        store = None if config.store is None else claim.copy.store if claim is not None else open_store(config.store)
        self.payloads = None if store is None else StorePayloads(store, self.state, self.rounds,
                                                                 own_credentials=config.store_own_credentials)
        self.store_deltas = StoreDeltas(store, self.state, own_credentials=config.store_own_credentials) \
            if store is not None and config.store_deltas else None
        if claim is not None and self.payloads is not None:
            claim.copy.linker = self.payloads.objects_of  # the state's copy names the syncs hosts read, not again
        self.rounds.payloads = self.payloads
        self.membership = Membership(self.state, self.recovery, self.rounds, site)
        self.values = ValueExchanges(self.state, self.rounds, site)
        self.site = site
        if site is not None:
            site.attach(controls(self))
        self.watch = RunWatch(self.state, self.rounds)  # what the status page and `nodeox status` show
        self._last_status = 0.0
        self._last_said = ""  # the last waiting line said
        self._next_rss = time.time()

    @property
    def config(self) -> CoordinatorConfig:
        return self.state.config

    # -- start ----------------------------------------------------------------------------------------------
    async def start(self, saved: SavedRun | None) -> None:
        """Resume ``saved`` (from its snapshot when that is its model), or load ``--initial-model`` if given."""
        config = self.config
        if saved is not None:
            self.recovery.resume(saved)
            now = time.time()
            self.state.record(PhaseRecord(saved.round, COORDINATOR, RESTART, now, now,
                                          extra={"model_hash": saved.model_hash,
                                                 "snapshot_round": saved.snapshot_round}))
            await self.recovery.restore()
            print(f"{config.name}: resuming the run in {config.run_dir} at round {saved.round} (model "
                  f"{saved.model_hash}, {self.recovery.source()}); start with --fresh to begin a new run instead",
                  flush=True)
        if self.site is not None:
            await self.site.start(saved is not None)
        elif config.initial_model is not None:
            path = Path(config.initial_model)
            await self.load_initial_model(torch.from_file(str(path), shared=False, size=path.stat().st_size,
                                                          dtype=torch.uint8))

    async def load_initial_model(self, data: torch.Tensor) -> None:
        """``data``: any safetensors file, the run's initial model; its tensors become the model at the first join,
        matched by name to that host's specs (the file's order need not be the model's)."""
        initial, skipped = read_named_model(data, "--initial-model")
        if skipped:
            self.log.warning("--initial-model: tensors of a dtype nodeox does not exchange are "
                             "skipped %s", ", ".join(skipped))
        self.membership.initial = initial

    # -- while it runs --------------------------------------------------------------------------------------
    async def tick(self) -> None:
        """The periodic work, once (see the module's docstring)."""
        if self.claim is not None:
            await self.claim.keeper.tick()
        await self.membership.check_leases()
        self.rounds.check_finished()  # a completed run's --final-wait may have passed
        await self.rounds.maybe_close()  # rounds whose timeout has passed
        if not self.rounds.closing:  # a save retried now reads θ and the outer state, which a close changes
            self.recovery.retry()
        await self.recovery.fall_back_to_snapshot(self.membership.provider_since)
        self._log_waiting()
        if time.time() >= self._next_rss:
            self.state.sample_memory()
            self._next_rss = time.time() + self.config.rss_interval
        if self.site is not None:
            await self.site.tick()

    async def tick_forever(self) -> None:
        while True:
            await asyncio.sleep(TICK)
            try:
                await self.tick()
            except Exception:  # noqa: BLE001 - keep ticking; the failure is logged
                self.log.exception("periodic work failed")

    def _log_waiting(self) -> None:
        """Every ``status_interval`` seconds of a round that has not closed, say whom it waits for: a warning each
        time, a plain line once (again when it changes)."""
        now = time.time()
        if now - max(self.state.round_opened, self._last_status) < self.config.status_interval:
            return
        said = waiting_for(self.state, self.rounds, self.recovery, self.membership.provider)
        if said is None:
            return
        self._last_status = now
        if said[0] > logging.INFO or said[1] != self._last_said:
            self._last_said = said[1]
            self.log.log(said[0], "%s", said[1])

    def status(self) -> dict:
        """The run at a glance (what ``GET /v1/status`` shows)."""
        state = self.state
        return {
            "round": state.round, "published_round": state.published_round, "complete": state.complete,
            "model_hash": None if state.model is None else state.model.hash,
            "hosts": {h.id: h.state.value for h in state.hosts.values()},
            "received": sorted(self.rounds.received), "peak_rss_bytes": state.peak_rss, "lease": self.config.lease,
            "downloads": len(self.rounds.downloads), "codec": self.config.codec.to_json(),
            **({} if self.site is None else self.site.status()),
            **({} if state.data.ledger is None else {"data": state.data.status()}),
            **({} if self.rounds.rule.status() is None else {"merge": self.rounds.rule.status()}),
            **({} if self.payloads is None else {"store": {
                **self.payloads.status(), **({} if self.store_deltas is None else
                                             {"deltas_read_bytes": self.store_deltas.read_bytes})}}),
        }

    # -- end ------------------------------------------------------------------------------------------------
    async def save_at_shutdown(self) -> None:
        """Let a round that is closing publish (no other starts closing), wait for its state, then write the state
        with a snapshot. A site's calls upstream in flight give up first (its hosts resend their deltas once it is
        back)."""
        if self.site is not None:
            self.site.stopping()
        await self.rounds.stop_closing()
        await self.recovery.save_with_snapshot()

    def close(self) -> None:
        """Stop the run's threads (after :meth:`save_at_shutdown`)."""
        self.state.close()
        self.recovery.close()
        if self.site is not None:
            self.site.close()


class Opened:
    """A run taken up and started, with what it holds (its run directory's lock, its codec threads, its log);
    :meth:`close` releases them once the run has ended."""

    def __init__(self, run: CoordinatorRun, pool: WorkerPool, runlog: RunLog, lock: RunDirLock | None) -> None:
        self.run, self._pool, self._runlog, self._lock = run, pool, runlog, lock

    def close(self) -> None:
        self.run.close()
        self._pool.close()
        self._runlog.close()
        if self.run.claim is not None:
            self.run.claim.release()
        if self._lock is not None:
            self._lock.release()


async def open_run(config: CoordinatorConfig, *, keep_state: bool = True, before_publish: BeforePublish | None = None,
                   site: SiteLink | None = None, controls: SiteControls | None = None) -> Opened:
    """Take up the run in ``config.run_dir`` (resume a saved one, or start one) and start it; ``keep_state``:
    its state is saved there (and one coordinator holds the directory), else nothing is saved nor resumed; ``site``
    and ``controls``: see :class:`CoordinatorRun`. Raises ValueError (or OSError) saying why it cannot start."""
    run_dir = Path(config.run_dir)
    lock, saved, store, claim = None, None, None, None
    if keep_state:
        lock = RunDirLock(run_dir)  # one coordinator per run directory, held until the run is closed
        try:
            claim = None if config.store is None else claim_store(config)  # one coordinator per run, across machines
            config, saved = take_up(config)
        except BaseException:
            if claim is not None:
                claim.release()
            lock.release()
            raise
        store = RunStore(run_dir, None if claim is None else claim.copy)
    pool = WorkerPool(config.codec, "cpu", choose_threads(config.threads, purpose="coordinator codec"))
    runlog = RunLog(run_dir, config.name)
    coordinator = CoordinatorRun(config, runlog, pool, store, before_publish, site=site, controls=controls,
                                 claim=claim)
    opened = Opened(coordinator, pool, runlog, lock)
    try:
        await coordinator.start(saved)
    except BaseException:
        opened.close()
        raise
    return opened


def _address(run_dir: Path) -> str | None:
    """The URL the transport wrote into ``RUN_DIR/coordinator.json`` (None: none written)."""
    try:
        return str(json.loads((Path(run_dir) / "coordinator.json").read_text())["url"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


async def run(config: CoordinatorConfig, listen: Listen, *, before_publish: BeforePublish | None = None,
              site: SiteLink | None = None, controls: SiteControls | None = None) -> int:
    """Run a coordinator until its run completes (or a signal); returns the exit status. ``listen(run)`` starts the
    transport and returns what stops it; ``before_publish`` (for comparisons only) is awaited with each round's sync
    before it is published; ``site`` and ``controls``: see :class:`CoordinatorRun`."""
    torch.set_num_threads(1)  # codec ops never thread inside ATen here; the codec pool parallelizes
    try:
        opened = await open_run(config, before_publish=before_publish, site=site, controls=controls)
    except (ValueError, OSError) as e:  # taken up wrongly, a bad --initial-model, a saved model unreadable
        print(f"{config.name}: {e}", file=sys.stderr, flush=True)
        return 2
    coordinator = opened.run
    config = coordinator.config  # as taken up: a resumed run's settings
    stop_listening = await listen(coordinator)
    claim = coordinator.claim
    if claim is not None and (url := _address(config.run_dir)) is not None:
        claim.keeper.announce(url)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):
            pass
    tick_task = asyncio.ensure_future(coordinator.tick_forever())
    finished = asyncio.ensure_future(coordinator.state.finished.wait())
    stopped = asyncio.ensure_future(stop.wait())
    given_up = asyncio.ensure_future(coordinator.state.given_up.wait())
    lost = asyncio.ensure_future(claim.keeper.lost.wait() if claim is not None else asyncio.Event().wait())
    await asyncio.wait({stopped, given_up, lost} | ({finished} if config.exit_when_done else set()),
                       return_when=asyncio.FIRST_COMPLETED)
    tick_task.cancel()
    for task in (finished, stopped, given_up, lost):
        task.cancel()
    if claim is not None and claim.keeper.lost.is_set():  # the run may be another's: not a byte more to the store
        claim.copy.stop()
        await stop_listening()
        opened.close()
        print(f"{config.name}: stopped: the run's lease in {config.store} is lost (see above); the run is not saved "
              "here", file=sys.stderr, flush=True)
        return 1
    await stop_listening()
    await coordinator.save_at_shutdown()
    state = coordinator.state
    state.sample_memory()
    opened.close()
    status = (f"complete after round {state.published_round}" if state.complete
              else f"stopped before the run completed, at round {state.round}")
    print(f"{config.name}: run {status}; peak RSS {state.peak_rss / 2**20:.0f} MiB", flush=True)
    return 0 if state.complete else 1
