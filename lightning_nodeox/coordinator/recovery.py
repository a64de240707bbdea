"""What lets a run survive a coordinator restart: its state written after every change of round, and a saved run
taken up again.

Saving: once the model arrives and after every published round the run's state (the round, the host registry
with its credentials, the last sync, the outer optimizer's state; the model every ``--snapshot-every`` rounds) is
written on a thread of its own (:mod:`~lightning_nodeox.coordinator.state` writes each file atomically). It is not
awaited: the next round's close waits for it before it changes θ again. At shutdown the state is written once more,
with a snapshot of the model.

Resuming: a saved, unfinished run is taken up at its round, with its hosts (each with a fresh lease) and saved
tensors. Its model comes back from the snapshot when that is the model the run stopped at; else from the first
host that rejoins holding that model, or the next one (the coordinator stopped between publishing a round and
saving it), which then gives it back (the hash must match what it said it holds); and when no host gave it back
within ``--provider-timeout``, from an older snapshot (the rounds since are lost; hosts fetch it). When the model
is back, the saved outer-optimizer state and last sync go with it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from ..core.phases import COORDINATOR, PERSIST, PhaseRecord
from ..core.wire import Q4Message
from .model import CoordinatorModel
from .runstate import RunState
from .state import RunStore, SavedRun

log = logging.getLogger(__name__)


@dataclass
class Resumed:
    """A run read back from its saved state, until its model is back (from a snapshot or a host)."""

    saved: SavedRun
    sync: Q4Message | None
    outer: dict[str, torch.Tensor]
    since: float  # time.time() when resumed


class Recovery:
    """The run's state on disk (``store``; None: nothing is saved) and the resumed run until its model is back."""

    def __init__(self, state: RunState, store: RunStore | None = None) -> None:
        self.state = state
        self.store = store
        self.resumed: Resumed | None = None
        self.wanted: tuple[int, str] | None = None  # resumed run: (round, hash) of the model being given back
        self._persist = ThreadPoolExecutor(1, thread_name_prefix="nodeox-persist")
        self._persisting: asyncio.Future | None = None
        self._saved: SavedRun | None = None

    # -- the model arrives ----------------------------------------------------------------------------------
    async def model_arrived(self, model: CoordinatorModel, source: str) -> None:
        """The run has its model (from ``source``): a resumed run's saved state goes with it; the round opens and
        the run's state is saved."""
        state = self.state
        if self.resumed is not None:
            await self._adopt(model)
        state.model = model
        log.info("nodeox coordinator: model from %s: %d tensors (%.1f MB), hash %s, round %d", source,
                 len(model.specs), model.nbytes / 1e6, model.hash, state.round)
        state.round_opened = time.time()
        self.save_round()
        state.sample_memory()
        await state.notify()

    # -- resuming a saved run -------------------------------------------------------------------------------
    def resume(self, saved: SavedRun) -> None:
        """Take up a saved, unfinished run: its round, hosts and saved tensors. The model follows: from its
        snapshot (:meth:`restore`) or from the first host that gives it back (see the module's rules)."""
        assert self.store is not None
        state = self.state
        state.round, state.published_round = saved.round, saved.round - 1
        state.hosts.restore(saved.hosts)
        outer = self.store.read_tensors(saved, "outer")
        self.resumed = Resumed(saved, self.store.read_sync(saved),
                               {} if outer is None else {s.name: t for s, t in zip(*outer)}, time.time())
        self._saved = saved

    def promise(self, model_hash: str | None, round_: int | None) -> tuple[int, str] | None:
        """The (round, hash) a resumed run takes from a host rejoining with ``model_hash`` at ``round_``; None if
        that host cannot give the run's model back (or the run was not resumed)."""
        return None if self.resumed is None else self.resumed.saved.promise(model_hash, round_)

    @property
    def saved_sync(self) -> Q4Message | None:
        """A resumed run's last sync, served while its model is not back yet."""
        return None if self.resumed is None else self.resumed.sync

    async def restore(self, *, fallback: bool = False) -> bool:
        """Load the saved snapshot as the model: when it is the model the run stopped at, or (``fallback``) when
        no host gave that model back in time; returns whether a model was loaded."""
        saved = self.resumed.saved
        if saved.snapshot_hash is None or (saved.snapshot_hash != saved.model_hash and not fallback):
            return False
        model = await self.state.build_model(*self.store.read_tensors(saved, "model"))
        if model.hash != saved.snapshot_hash:
            raise ValueError(f"the snapshot {saved.files['model']} hashes to {model.hash}, not {saved.snapshot_hash}; "
                             "start with --fresh")
        if saved.snapshot_hash != saved.model_hash:
            log.warning("nodeox coordinator: no host gave back the model of round %d within %.0f s; going on from "
                        "the snapshot of round %d (the rounds since are lost; hosts fetch it)", saved.round,
                        self.state.config.provider_timeout, saved.snapshot_round)
        self.wanted = (saved.round, model.hash)
        await self.model_arrived(model, f"the snapshot of round {saved.snapshot_round}")
        return True

    async def fall_back_to_snapshot(self, provider_since: float) -> None:
        """A resumed run whose model no host gave back within ``provider_timeout`` (counted from the resume, or
        from when the last provider was chosen: ``provider_since``) goes on from its snapshot."""
        resumed = self.resumed
        if resumed is None or self.state.model is not None:
            return
        if time.time() - max(resumed.since, provider_since) > self.state.config.provider_timeout:
            await self.restore(fallback=True)

    async def _adopt(self, model: CoordinatorModel) -> None:
        """A resumed run's model is back: its outer state and last sync go with it."""
        resumed, (round_, _) = self.resumed, self.wanted
        if resumed.outer:
            await self.state.in_worker(model.restore_outer, resumed.outer)
        if model.hash == resumed.saved.model_hash and resumed.sync is not None:
            model.adopt_sync(resumed.sync)
        if round_ != resumed.saved.round:
            log.warning("nodeox coordinator: the saved state was of round %d, hosts were at round %d: going on from "
                        "theirs (the outer-optimizer state is one round behind)", resumed.saved.round, round_)
        self.state.round, self.state.published_round = round_, round_ - 1
        self.resumed = self.wanted = None

    # -- the run's state on disk ----------------------------------------------------------------------------
    def save_round(self, *, snapshot: bool = False) -> None:
        """Start writing the run's state (the model too when ``snapshot`` or every ``snapshot_every`` rounds);
        not awaited (:meth:`saved` waits for it)."""
        state = self.state
        model, config = state.model, state.config
        if self.store is None or model is None:
            return
        saved = SavedRun(round=state.round, model_hash=model.hash, complete=state.complete,
                         hosts=state.hosts.saved(),
                         q4={"codec": config.q4.codec, "block_size": config.q4.block_size,
                             "scale_dtype": config.q4.scale_dtype},
                         outer={"name": config.outer.name, "lr": config.outer.lr, "momentum": config.outer.momentum})
        if self._saved is not None:
            saved.files = dict(self._saved.files)
            saved.snapshot_round, saved.snapshot_hash = self._saved.snapshot_round, self._saved.snapshot_hash
        self._saved = saved
        snapshot = (snapshot or state.round % config.snapshot_every == 0) and saved.snapshot_hash != model.hash
        sync = model.latest_sync if model.latest_sync is not None and model.latest_sync.meta.round == state.round - 1 \
            else None
        chunks = model.model_chunks(state.round) if snapshot else None
        start, after_round = time.time(), max(state.published_round, 0)
        store = self.store
        future = asyncio.ensure_future(asyncio.get_running_loop().run_in_executor(self._persist, lambda: store.save(
            saved, sync=sync, outer=dict(model.outer.state), model_chunks=chunks)))

        def done(f: asyncio.Future) -> None:
            if f.cancelled() or f.exception() is not None:
                log.error("nodeox coordinator: could not save the run's state in %s: %r", store.dir,
                          None if f.cancelled() else f.exception())
                return
            state.record(PhaseRecord(after_round, COORDINATOR, PERSIST, start, time.time(), f.result(),
                                     extra={"snapshot": snapshot}))

        future.add_done_callback(done)
        self._persisting = future

    async def saved(self) -> None:
        """Wait until the state last started writing is on disk (a failed write raises here too)."""
        if self._persisting is not None:
            await self._persisting

    async def save_with_snapshot(self) -> None:
        """Write the run's state with a snapshot of the model, after the write in flight (at shutdown)."""
        await self.saved()
        if self.state.model is not None:
            self.save_round(snapshot=True)
            await self.saved()

    def close(self) -> None:
        self._persist.shutdown(wait=True)
