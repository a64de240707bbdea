"""What lets a run survive a coordinator restart: its state written after every change of round, and a saved run
taken up again.

Saving: once the model arrives and after every published round the run's state (the round, the host registry
with its credentials, the last sync; the model every ``--snapshot-every`` rounds) is written on a thread of its
own. The outer optimizer's state (Nesterov's momentum) is written earlier, once the round's close has made it and
before its sync's trailer goes out, with the data ledger as it will be after the publish: a host never holds a
model whose momentum and ledger are not on disk, so a kill -9 at any moment after a publish resumes with that
round's momentum and ledger (it costs the close one write of the state, 1x the fp32
model, where the host waits for the trailer). The rest is written after the publish
(:mod:`~lightning_nodeox.coordinator.state` writes each file atomically), not awaited: the next round's close
waits for it before it changes θ again. A credential issued at a join rewrites
``run.json`` at once. At shutdown the state is written once more, with a snapshot of the model, whatever happened
before.

A save that fails never loses the run: it is reported once (then every ``Trouble.REPORT_EVERY`` seconds) and
tried again every ``RETRY_S`` seconds (a snapshot it owed included); the state on disk stays the last one written
whole until then. Meanwhile the open round takes its deltas but does not close (:attr:`Recovery.durable`): no
round is published beyond the one after the state on disk, so a coordinator killed during the outage resumes with
a host giving that round's model back (below), never behind what was published.

Resuming: a saved, unfinished run is taken up at its round, with its hosts (each with a fresh lease) and saved
tensors. A restart never goes behind what was published. Its model comes back:
- from the snapshot at once when the state was written at shutdown (nothing was published after it);
- else from the first host that rejoins: holding the saved model, from the snapshot when that is the saved model
  (else that host gives it back); holding the next round's model (the coordinator stopped between publishing a
  round and saving it), that host gives it back. When a save cut short left that round's sync on disk, only its
  model is taken. A model given back must have the saved tensor layout and the hash its host said it holds;
- when no host gave it back within ``provider_timeout`` (5 minutes), or every host of the run joined again
  and none holds it, from the snapshot (the rounds since are lost; hosts fetch it).
When the model is back, the saved outer-optimizer state, data ledger (or those a cut-short save wrote for the
next round's model: both are written before a round's sync goes out, so a model a host holds never lacks its
ledger on disk) and last sync go with it. Until then the data ledger leases nothing (``NO_MODEL``: the host joins
again and may give the model back), so no unit is leased from a ledger that model is ahead of.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from ..core.logs import Named
from ..core.phases import COORDINATOR, PERSIST, PhaseRecord
from ..core.protocol import Reason, Refusal
from ..core.specs import PayloadError, TensorSpec, check_same_model
from ..core.wire import Message
from .hosts import HostState
from .model import CoordinatorModel
from .runlog import Trouble
from .runstate import RunState
from .state import RunStore, SavedRun

log = logging.getLogger(__name__)


@dataclass
class Resumed:
    """A run read back from its saved state, until its model is back (from a snapshot or a host)."""

    saved: SavedRun
    sync: Message | None
    outer: dict[str, torch.Tensor]
    since: float  # time.time() when resumed
    published: Message | None = None  # the sync of the saved round, left by a save cut short: it was published
    unable: set[str] = field(default_factory=set)  # hosts that joined again holding no model they can give back


class Recovery:
    """The run's state on disk (``store``; None: nothing is saved) and the resumed run until its model is back."""

    RETRY_S = 2.0  # a failed save is tried again this long after (the rounds wait for it)

    def __init__(self, state: RunState, store: RunStore | None = None) -> None:
        self.state = state
        self.log = Named(log, state.config.name)
        self.store = store
        self.resumed: Resumed | None = None
        self.wanted: tuple[int, str] | None = None  # resumed run: (round, hash) of the model being given back
        self.trouble = (None if store is None else
                        Trouble(f"the run's state in {store.dir}", state.config.name, counts=False,
                                meanwhile="no further round closes until it is saved (free space there); writing "
                                          f"is tried again every {self.RETRY_S:g} s"))
        self._persist = ThreadPoolExecutor(1, thread_name_prefix="nodeox-persist")
        self._persisting: asyncio.Future | None = None
        self._retry_at: float | None = None  # time.monotonic() when a failed save is tried again
        self._restoring = asyncio.Lock()

    # -- the model arrives ----------------------------------------------------------------------------------
    async def model_arrived(self, model: CoordinatorModel, source: str) -> None:
        """The run has its model (from ``source``): a resumed run's saved state goes with it; the round opens and
        the run's state is saved."""
        state = self.state
        if self.resumed is not None:
            await self._adopt(model)
        state.model = model
        self.log.info("model from %s: %d tensors (%.1f MB), hash %s, round %d", source,
                      len(model.specs), model.nbytes / 1e6, model.hash, state.round)
        state.round_opened = time.time()
        self.save_round()
        state.sample_memory()
        await state.notify()

    # -- resuming a saved run -------------------------------------------------------------------------------
    def resume(self, saved: SavedRun) -> None:
        """Take up a saved, unfinished run: its round, hosts and saved tensors. The model follows (see the
        module's rules)."""
        assert self.store is not None
        state = self.state
        state.round, state.published_round = saved.round, saved.round - 1
        state.hosts.restore(saved.hosts)
        state.data.restore(saved.data)  # every data lease void: hosts lease again
        outer = self.store.read_tensors(saved, "outer")
        self.resumed = Resumed(saved, self.store.read_sync(saved),
                               {} if outer is None else {s.name: t for s, t in zip(*outer)}, time.time(),
                               None if saved.stopped else self.store.interrupted_sync(saved))
        self.store.last = saved

    def source(self) -> str:
        """Where a resumed run's model comes from, as far as is known at start."""
        if self.resumed is None:
            return "from its snapshot"
        saved, published = self.resumed.saved, self.resumed.published
        if published is not None:
            return (f"round {saved.round} was published: given back by a host that holds its model "
                    f"{published.meta.model_hash}")
        if saved.snapshot_hash == saved.model_hash:
            return "from its snapshot, unless the first host that rejoins holds the next round's model"
        return "given back by the first host that rejoins"

    def waits_for(self) -> str:
        """What a resumed run whose model is not back waits for, in one line."""
        config, saved, published = self.state.config, self.resumed.saved, self.resumed.published
        fallback = (f" (falls back to the snapshot of round {saved.snapshot_round} after {config.provider_timeout:.0f} s)"
                    if saved.snapshot_hash else "; no snapshot was saved to fall back to")
        if published is not None:
            return (f"resumed run: round {saved.round} was published; waits for a host holding its model "
                    f"{published.meta.model_hash} to join again and give it back{fallback}")
        if saved.snapshot_hash == saved.model_hash:
            return (f"resumed run at round {saved.round} waits for a host to join again: holding the model "
                    f"{saved.model_hash}, the snapshot is loaded; holding the next round's, it gives that back"
                    f"{fallback}")
        return (f"resumed run at round {saved.round} waits for a host holding its model {saved.model_hash} to join "
                f"again and give it back{fallback}")

    async def promise(self, host: str, specs: tuple[TensorSpec, ...], model_hash: str | None,
                      round_: int | None) -> tuple[int, str] | None:
        """The (round, hash) a resumed run takes from ``host`` rejoining with ``model_hash`` at ``round_``; None if
        that host cannot give the run's model back (or the run was not resumed, or its model is back: from the
        snapshot when this host holds the saved model). A host whose tensors are not the saved layout is
        refused."""
        resumed = self.resumed
        if resumed is None:
            return None
        saved, published = resumed.saved, resumed.published
        layout = saved.tensor_specs()
        if layout is not None:
            try:
                check_same_model(layout, specs, f"host {host}'s model")
            except PayloadError as e:
                raise Refusal(Reason.INVALID, f"{e}: it is not the model of the run saved in {self.store.dir}. "
                                              "Start this host with the run's model, or the coordinator with "
                                              "--fresh to begin a new run") from None
        if published is not None:  # that round was published: only its model comes back
            wanted = published.meta.model_hash
            promise = (saved.round + 1, wanted) if model_hash == wanted else None
        elif model_hash is not None and model_hash == saved.model_hash == saved.snapshot_hash:
            await self.restore(held=True)  # no later round was published, as far as this host knows
            return None
        else:
            promise = saved.promise(model_hash, round_)
        if promise is None:
            resumed.unable.add(host)
            if resumed.unable >= {h for h, e in saved.hosts.items() if e["state"] != HostState.LEFT.value}:
                await self.restore(fallback=True, why="every host of the run joined again and none holds it")
        return promise

    @property
    def saved_sync(self) -> Message | None:
        """A resumed run's last sync, served while its model is not back yet."""
        return None if self.resumed is None else self.resumed.sync

    async def restore(self, *, held: bool = False, fallback: bool = False, why: str = "") -> bool:
        """Load the saved snapshot as the model: at once when the state was saved at shutdown; when it is the
        saved model and a host that rejoins holds it (``held``); or (``fallback``) when no host can give the
        model back (``why``). Returns whether a model was loaded."""
        async with self._restoring:  # hosts rejoining at once: one loads it, the others find it loaded
            resumed = self.resumed
            if resumed is None or self.state.model is not None:
                return False
            saved = resumed.saved
            latest = saved.snapshot_hash == saved.model_hash and resumed.published is None
            if saved.snapshot_hash is None or not (fallback or (latest and (held or saved.stopped))):
                return False
            model = await self.state.build_model(*self.store.read_tensors(saved, "model"))
            if model.hash != saved.snapshot_hash:
                raise ValueError(f"the snapshot {saved.files['model']} hashes to {model.hash}, not "
                                 f"{saved.snapshot_hash}; start with --fresh")
            if not latest:
                self.log.warning("the model of round %d is not back (%s); going on from the snapshot "
                                 "of round %d (the rounds since are lost; hosts fetch it)",
                                 saved.round + (resumed.published is not None), why, saved.snapshot_round)
            self.wanted = (saved.round, model.hash)
            await self.model_arrived(model, f"the snapshot of round {saved.snapshot_round}")
            return True

    async def fall_back_to_snapshot(self, provider_since: float) -> None:
        """A resumed run whose model no host gave back within ``provider_timeout`` (counted from the resume, or
        from when the last provider was chosen: ``provider_since``) goes on from its snapshot."""
        resumed = self.resumed
        if resumed is None or self.state.model is not None:
            return
        timeout = self.state.config.provider_timeout
        if time.time() - max(resumed.since, provider_since) > timeout:
            await self.restore(fallback=True, why=f"no host gave it back within {timeout:.0f} s")

    async def _adopt(self, model: CoordinatorModel) -> None:
        """A resumed run's model is back: its outer state and last sync go with it (those a save cut short
        wrote for it, when it is the next round's)."""
        resumed, (round_, _) = self.resumed, self.wanted
        saved = resumed.saved
        outer, behind = resumed.outer, False
        if round_ == saved.round + 1:
            newer = await self.state.in_worker(self.store.outer_of, round_, model.hash)
            outer, behind = (newer, False) if newer is not None else (outer, bool(outer))
        if outer:
            await self.state.in_worker(model.restore_outer, outer)
        data_behind = False
        if round_ == saved.round + 1:
            data = await self.state.in_worker(self.store.data_of, round_, model.hash)
            if data is not None:
                self.state.data.restore(data)  # that round's units are in this model: committed, never leased again
            else:
                data_behind = self.state.data.ledger is not None
        published = resumed.published
        if model.hash == saved.model_hash and resumed.sync is not None:
            model.adopt_sync(resumed.sync)
        elif published is not None and published.meta.model_hash == model.hash:
            model.adopt_sync(published)
        if round_ != saved.round:
            self.log.warning("the saved state was of round %d, hosts were at round %d: going on from "
                             "theirs%s%s", saved.round, round_,
                             " (the outer-optimizer state is one round behind)" if behind else "",
                             " (the data ledger is one round behind: that round's units are trained again)"
                             if data_behind else "")
        self.state.round, self.state.published_round = round_, round_ - 1
        self.resumed = self.wanted = None

    # -- the run's state on disk ----------------------------------------------------------------------------
    def save_round(self, *, snapshot: bool = False, stopped: bool = False) -> None:
        """Start writing the run's state (the model too when ``snapshot`` or when a snapshot is due: every
        ``snapshot_every`` rounds, or owed by a save that failed); not awaited (:meth:`saved` waits for it).
        ``stopped``: the shutdown's save, after which nothing is published."""
        state, store = self.state, self.store
        model, config = state.model, state.config
        if store is None or model is None:
            return
        saved = SavedRun(round=state.round, model_hash=model.hash, complete=state.complete,
                         hosts=state.hosts.saved(),
                         codec=config.codec, outer=config.outer, specs=[s.as_json() for s in model.specs], stopped=stopped,
                         data=state.data.saved())
        last = store.last
        snapshot_round = None if last is None else last.snapshot_round
        due = snapshot or snapshot_round is None or snapshot_round < state.round - state.round % config.snapshot_every
        snapshot = due and (last is None or last.snapshot_hash != model.hash)
        sync = model.latest_sync if model.latest_sync is not None and model.latest_sync.meta.round == state.round - 1 \
            else None
        chunks = model.model_chunks(state.round) if snapshot else None
        start, after_round = time.time(), max(state.published_round, 0)
        outer = dict(model.outer.state)

        def write() -> int:
            return store.save(saved, sync=sync, outer=outer, model_chunks=chunks)

        def done(written: int) -> None:
            state.record(PhaseRecord(after_round, COORDINATOR, PERSIST, start, time.time(), written,
                                     extra={"snapshot": snapshot}))

        self._persisting = asyncio.ensure_future(self._write(write, done))

    async def save_ahead(self, round_: int, model_hash: str, data: dict | None) -> None:
        """Write what belongs to round ``round_``'s model ``model_hash`` now, before that model's sync is
        published: the outer state (:meth:`RunStore.save_outer`; nothing for an outer step without state) and the
        data ledger as it will be after the publish (``data``, :meth:`RunData.ahead`; None: no ledger). A failure
        is reported and the round goes on (its save after the publish writes both)."""
        model, store = self.state.model, self.store
        if store is None or model is None:
            return
        outer = dict(model.outer.state)

        def write() -> int:
            written = store.save_outer(outer, round_, model_hash) if outer else 0
            return written + (store.save_data(data, round_, model_hash) if data is not None else 0)

        if outer or data is not None:
            await self._write(write, lambda written: None)

    def save_hosts(self) -> asyncio.Future | None:
        """Write the host registry now (a credential was just issued), after any save in flight; the write's
        future (None: nothing is saved)."""
        if self.store is None:
            return None
        hosts, store = self.state.hosts.saved(), self.store
        return asyncio.ensure_future(self._write(lambda: store.save_hosts(hosts)))

    @property
    def durable(self) -> bool:
        """Whether what the run holds is on disk (no write of its state is failing): only then does a round
        close, or a join get a credential."""
        return self.trouble is None or self.trouble.failing_since is None

    async def _write(self, write, done=None) -> bool:
        """Run ``write`` on the saving thread; a failure is reported (not raised) and tried again later."""
        try:
            written = await asyncio.get_running_loop().run_in_executor(self._persist, write)
        except Exception as e:  # noqa: BLE001 - a failed save never stops the run: reported, tried again
            self._retry_at = time.monotonic() + self.RETRY_S
            self.trouble.failed(e)
            return False
        if done is not None:
            self._retry_at = None
            self.trouble.ok()
            done(written)
        return True

    def retry(self) -> None:
        """Try a failed save again once ``RETRY_S`` has passed (call while no round is closing)."""
        if self._retry_at is None or time.monotonic() < self._retry_at:
            return
        if self._persisting is not None and not self._persisting.done():
            return
        self._retry_at = None
        if self.state.model is not None:
            self.save_round()
        else:
            self.save_hosts()

    async def saved(self) -> bool:
        """Wait until the state last started writing is on disk or failed (reported); returns whether written."""
        return True if self._persisting is None else await self._persisting

    async def save_with_snapshot(self) -> None:
        """Write the run's state with a snapshot of the model, after the write in flight (at shutdown), whatever
        happened to the saves before."""
        await self.saved()
        if self.store is not None and self.state.model is not None:
            self.save_round(snapshot=True, stopped=True)
            if await self.saved():
                self.log.info("the run's state is saved in %s (round %d)", self.store.dir,
                              self.state.round)
            else:
                last = self.store.last
                self.log.error("the run's state could not be saved at shutdown; %s holds %s",
                               self.store.dir, "nothing" if last is None else f"that of round {last.round}")

    def close(self) -> None:
        self._persist.shutdown(wait=True)
