"""The round state machine: who takes part, when a round closes, what is published, what is saved.

Runs on the event loop; tensor work goes to threads (one parses and checks uploads, one accumulates and
prepares syncs, in order, one writes the run's state), so the loop keeps answering while a round is
aggregated. A rejected upload changes nothing: it is checked completely before its first byte reaches the
accumulator.

When a round closes (the rule, also in docs/clusters.md):
- round 0 waits until ``--hosts`` hosts have joined (or for ``--round-timeout``);
- a round closes once every *live* host has sent its delta: a host is live while it is training and has been
  heard from within ``--lease`` seconds (hosts send heartbeats); a host whose lease expires is dropped (no
  longer waited for) until it is heard from again;
- with ``--round-timeout S``, a round also closes after S seconds without the live hosts still missing;
- never with fewer than ``--min-hosts`` deltas (default 1), lowered to the number of hosts still in the run
  (neither finished nor left), so finishing hosts never block the end. While it cannot close, the
  coordinator says every ``status_interval`` seconds whom it waits for, and why.

Stopping together: a host's final delta (its training ended: max_steps, max_epochs, early stopping) makes
its round the run's last one. That round's sync completes the run, so every host ends on the same model
after the same round, and a host that is still training stops at its next round boundary.

Identity: a join admits a host id (at most ``--hosts`` distinct ids unless ``--elastic``) and returns a
credential that every later call of that host must present (:meth:`Rounds.authenticate`). An id already held
by a live host is refused (``ID_IN_USE``); it can be taken again once its holder has left or was dropped (its
lease expired), or by a join presenting the holder's credential. Taking it issues a new credential, so the
previous holder, should it still run, is refused from then on. Credentials are part of the saved run state,
so hosts keep acting (and rejoin) with theirs across a coordinator restart.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from ..core.modelfile import arrange, model_header, read_model, read_named_model
from ..core.phases import AGGREGATE, COORDINATOR, PERSIST, RECEIVE, RSS, SYNC_PREPARE, PhaseRecord
from ..core.pool import WorkerPool
from ..core.protocol import JoinReply, Reason, Refusal
from ..core.specs import PayloadError, TensorSpec, check_same_model
from ..core.wire import Q4Message, fit_metrics
from .config import CoordinatorConfig
from .hosts import Host, Hosts, HostState
from .intake import MAX_SAMPLES, model_bytes
from .metrics import reduce_metrics
from .model import CoordinatorModel, ModelStream
from .runlog import RunLog, peak_rss_bytes, rss_bytes
from .state import RunStore, SavedRun
from .waiting import waiting_for

log = logging.getLogger(__name__)



@dataclass
class Resumed:
    """A run read back from its saved state, until its model is back (from a snapshot or a host)."""

    saved: SavedRun
    sync: Q4Message | None
    outer: dict[str, torch.Tensor]
    since: float  # time.time() when resumed


class Rounds:
    """Everything the coordinator knows about the run, changed only on the event loop."""

    def __init__(self, config: CoordinatorConfig, runlog: RunLog, pool: WorkerPool,
                 store: RunStore | None = None) -> None:
        self.config = config
        self.runlog = runlog
        self.pool = pool
        self.store = store
        self.model: CoordinatorModel | None = None
        self.round = 0
        self.published_round = -1
        self.hosts = Hosts(config.lease)
        self.received: dict[str, int] = {}
        self.metrics: dict[str, dict[str, list]] = {}  # the round's deltas' sync_dist values, by host
        self.stopping = False  # a final delta came in this round: it is the run's last
        self.closing = False
        self.shutting_down = False  # no round starts closing
        self.complete = False
        self.round_opened = time.time()
        self.provider: str | None = None
        self.provider_since = 0.0
        self.resumed: Resumed | None = None
        self.wanted: tuple[int, str] | None = None  # resumed run: (round, hash) of the model being given back
        self.downloads: set[ModelStream] = set()
        self.provider_specs: tuple[TensorSpec, ...] = ()
        self.initial: dict[str, torch.Tensor] | None = None  # --initial-model's tensors by name, until a join
        self._taking_initial = asyncio.Lock()
        self.changed = asyncio.Condition()
        self.finished = asyncio.Event()
        self._parse = ThreadPoolExecutor(1, thread_name_prefix="nodeox-parse")
        self._work = ThreadPoolExecutor(1, thread_name_prefix="nodeox-work")
        self._persist = ThreadPoolExecutor(1, thread_name_prefix="nodeox-persist")
        self._persisting: asyncio.Future | None = None
        self._saved: SavedRun | None = None
        self._accumulating: list[asyncio.Future] = []
        self._last_status = 0.0
        self.peak_rss = 0
        self.before_publish: Callable[[Rounds, int, Q4Message], Awaitable[None]] | None = None

    # -- helpers --------------------------------------------------------------------------------------------
    async def in_worker(self, fn, *args):
        """Run tensor work on the coordinator's work thread (in order with aggregation and syncs)."""
        return await self._in(self._work, fn, *args)

    async def _in(self, executor: ThreadPoolExecutor, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(executor, fn, *args)

    async def _notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    async def _wait(self, predicate, timeout: float) -> bool:
        async with self.changed:
            try:
                await asyncio.wait_for(self.changed.wait_for(predicate), timeout)
                return True
            except asyncio.TimeoutError:
                return predicate()

    def record(self, *records: PhaseRecord) -> None:
        self.runlog.write(records)

    def sample_memory(self) -> int:
        now, rss = time.time(), rss_bytes()
        self.peak_rss = max(self.peak_rss, rss, peak_rss_bytes())
        self.record(PhaseRecord(self.round, COORDINATOR, RSS, now, now,
                                extra={"rss_bytes": rss, "peak_rss_bytes": self.peak_rss,
                                       "cpu_s": time.process_time()}))
        return rss

    def _reply(self, **fields) -> JoinReply:
        q4 = self.config.q4
        return JoinReply(round=self.round, block_size=q4.block_size, scale_dtype=q4.scale_dtype, codec=q4.codec,
                         **fields)

    def require_model(self) -> CoordinatorModel:
        if self.model is None:
            raise Refusal(Reason.NO_MODEL, "the run has no model yet: join (again); a host that holds it provides it")
        return self.model

    # -- model ----------------------------------------------------------------------------------------------
    async def load_initial_model(self, data: torch.Tensor) -> None:
        """Read ``--initial-model`` (any safetensors file); its tensors become the model at the first join,
        matched by name to that host's specs (the file's order is not the model's)."""
        self.initial, skipped = read_named_model(data, "--initial-model")
        if skipped:
            log.warning("nodeox coordinator: --initial-model: tensors that are not floating point are not exchanged; "
                        "skipped %s", ", ".join(skipped))

    async def _take_initial_model(self, host: str, specs: tuple[TensorSpec, ...]) -> None:
        async with self._taking_initial:  # hosts joining at once: one makes the model, the others find it made
            if self.model is not None:
                return
            try:
                tensors = arrange(self.initial, specs, f"--initial-model, for host {host}'s model,")
            except PayloadError as e:
                raise Refusal(Reason.INVALID, str(e)) from None
            model = await self._in(self._work, CoordinatorModel.for_run, self.config, self.pool, specs,
                                   tensors)
            self.initial = None
            await self._set_model(model, "--initial-model")

    def check_model_upload(self, host: str, size: int) -> None:
        """Refuse a model upload before its body is read (or allocated for): only the chosen provider, only when
        the run has none, and only of the size its join's tensor specs give."""
        if self.model is not None:
            raise Refusal(Reason.HAS_MODEL, "the run already has a model; fetch it with GET /v1/model",
                          model_hash=self.model.hash)
        if host != self.provider:
            raise Refusal(Reason.NOT_PROVIDER, f"host {self.provider} provides the model, not host {host}; join again")
        data = model_bytes(self.provider_specs)
        header = len(model_header(self.provider_specs, self.round, "f" * 128))  # at most: metadata varies a little
        if not data < size <= data + header:
            raise Refusal(Reason.INVALID, f"model upload of {size} bytes does not fit the {len(self.provider_specs)} "
                                          f"tensors host {host} declared at join ({data} bytes and a header of at "
                                          f"most {header})")

    async def put_model(self, host: str, data: torch.Tensor) -> dict:
        """The providing host's model: the run's initial model, or a resumed run's model given back."""
        self.check_model_upload(host, data.numel())
        try:
            _, _, specs, tensors = await self._in(self._parse, read_model, data)
        except PayloadError as e:
            raise Refusal(Reason.INVALID, f"model rejected: {e}") from None
        try:
            check_same_model(self.provider_specs, specs, "the model")
        except PayloadError as e:
            raise Refusal(Reason.INVALID, f"{e} (as declared at join)") from None
        model = await self._in(self._work, CoordinatorModel.for_run, self.config, self.pool, specs, tensors)
        self.check_model_upload(host, data.numel())  # another upload may have won while this one was read
        if self.wanted is not None and model.hash != self.wanted[1]:
            self.provider = None
            raise Refusal(Reason.INVALID, f"host {host}'s model hashes to {model.hash}, not the {self.wanted[1]} it "
                                          "said it holds")
        await self._set_model(model, f"host {host}")
        return {"model_hash": model.hash, "round": self.round}

    async def _set_model(self, model: CoordinatorModel, source: str) -> None:
        if self.resumed is not None:
            await self._adopt(model)
        self.model = model
        log.info("nodeox coordinator: model from %s: %d tensors (%.1f MB), hash %s, round %d", source,
                 len(model.specs), model.nbytes / 1e6, model.hash, self.round)
        self.round_opened = time.time()
        self._persist_round()
        self.sample_memory()
        await self._notify()

    # -- resuming a saved run ---------------------------------------------------------------------------------------
    def resume(self, saved: SavedRun) -> None:
        """Take up a saved, unfinished run: its round, hosts and saved tensors. The model follows: from its
        snapshot (:meth:`restore`) or from the first host that gives it back (:meth:`join`, :meth:`put_model`)."""
        assert self.store is not None
        self.round, self.published_round = saved.round, saved.round - 1
        self.hosts.restore(saved.hosts)
        outer = self.store.read_tensors(saved, "outer")
        self.resumed = Resumed(saved, self.store.read_sync(saved),
                               {} if outer is None else {s.name: t for s, t in zip(*outer)}, time.time())
        self._saved = saved

    async def restore(self, *, fallback: bool = False) -> bool:
        """Load the saved snapshot as the model: when it is the model the run stopped at, or (``fallback``) when
        no host gave that model back in time; returns whether a model was loaded."""
        saved = self.resumed.saved
        if saved.snapshot_hash is None or (saved.snapshot_hash != saved.model_hash and not fallback):
            return False
        specs, tensors = self.store.read_tensors(saved, "model")
        model = await self._in(self._work, CoordinatorModel.for_run, self.config, self.pool, specs, tensors)
        if model.hash != saved.snapshot_hash:
            raise ValueError(f"the snapshot {saved.files['model']} hashes to {model.hash}, not {saved.snapshot_hash}; "
                             "start with --fresh")
        if saved.snapshot_hash != saved.model_hash:
            log.warning("nodeox coordinator: no host gave back the model of round %d within %.0f s; going on from "
                        "the snapshot of round %d (the rounds since are lost; hosts fetch it)", saved.round,
                        self.config.provider_timeout, saved.snapshot_round)
        self.wanted = (saved.round, model.hash)
        await self._set_model(model, f"the snapshot of round {saved.snapshot_round}")
        return True

    async def fall_back_to_snapshot(self) -> None:
        """A resumed run whose model no host gave back within ``provider_timeout`` goes on from its snapshot."""
        resumed = self.resumed
        if resumed is None or self.model is not None:
            return
        if time.time() - max(resumed.since, self.provider_since) > self.config.provider_timeout:
            await self.restore(fallback=True)

    async def _adopt(self, model: CoordinatorModel) -> None:
        """A resumed run's model is back: its outer state and last sync go with it."""
        resumed, (round_, _) = self.resumed, self.wanted
        if resumed.outer:
            await self._in(self._work, model.restore_outer, resumed.outer)
        if model.hash == resumed.saved.model_hash and resumed.sync is not None:
            model.adopt_sync(resumed.sync)
        if round_ != resumed.saved.round:
            log.warning("nodeox coordinator: the saved state was of round %d, hosts were at round %d: going on from "
                        "theirs (the outer-optimizer state is one round behind)", resumed.saved.round, round_)
        self.round, self.published_round = round_, round_ - 1
        self.resumed = self.wanted = None

    # -- hosts ------------------------------------------------------------------------------------------------
    async def join(self, host: str, specs: tuple[TensorSpec, ...], credential: str = "",
                   model_hash: str | None = None, round_: int | None = None) -> JoinReply:
        """Admit a host (see the module's rules on ids); tell it the round, the model hash and its credential, or
        that it must provide the model. A host that rejoins a resumed run says which model and round it holds
        (``model_hash``, ``round_``), so that it can give the model back. A host whose model does not fit the run
        is refused and not registered."""
        self._check_admission(host, credential)
        if self.model is None and self.initial is not None:
            await self._take_initial_model(host, specs)
        if self.model is None:
            now = time.time()
            free = self.provider in (None, host) or now - self.provider_since > self.config.provider_timeout
            promise = None if self.resumed is None else self.resumed.saved.promise(model_hash, round_)
            if free and (self.resumed is None or promise is not None):
                self.provider, self.provider_since, self.provider_specs, self.wanted = host, now, specs, promise
                return self._reply(model_hash=None, provide_model=True, credential=self._register(host, credential))
            await self._wait(lambda: self.model is not None, self.config.long_poll)
            if self.model is None:
                return self._reply(model_hash=None, retry=True)
        try:
            check_same_model(self.model.specs, specs, f"host {host}'s model")
        except PayloadError as e:
            raise Refusal(Reason.INVALID, str(e)) from None
        issued = self._register(host, credential)
        await self._notify()
        return self._reply(model_hash=self.model.hash, complete=self.complete, credential=issued)

    async def heartbeat(self, host: str) -> dict:
        self.hosts.seen(self.hosts.known(host))
        return {"lease": self.config.lease, "round": self.round}

    def _check_admission(self, host: str, credential: str) -> None:
        entry = self.hosts.get(host)
        if entry is None:
            if len(self.hosts) >= self.config.hosts and not self.config.elastic:
                raise Refusal(Reason.FULL, f"host {host} cannot join: the run already has its {self.config.hosts} "
                                           "hosts (--hosts). A restarted host must keep its NODEOX_HOST_ID to take its "
                                           "place; start the coordinator with --elastic to admit more hosts")
        elif entry.state not in (HostState.LEFT, HostState.DROPPED) and not _same(credential, entry.credential):
            raise Refusal(Reason.ID_IN_USE, f"host id {host} is in use by another live process (joined "
                                            f"{time.time() - entry.joined:.0f} s ago, {entry.state.value}). Give this "
                                            "process its own NODEOX_HOST_ID, or stop the other one first (a stopped "
                                            "host leaves; one that died is free again once its --lease expires)")

    def _register(self, host: str, credential: str) -> str:
        """Admit ``host`` (checked again: no await since) and return its new credential."""
        self._check_admission(host, credential)
        entry = self.hosts.register(host, secrets.token_urlsafe(24))
        log.info("nodeox coordinator: host %s joined", host)
        return entry.credential

    def authenticate(self, host: str, credential: str) -> Host:
        """The host ``host``, if ``credential`` is its credential (from its join)."""
        entry = self.hosts.get(host)
        if entry is None:
            raise Refusal(Reason.NOT_JOINED, f"host {host} has not joined; POST /v1/join first")
        if not _same(credential, entry.credential):
            raise Refusal(Reason.FORBIDDEN, f"missing or wrong credential for host {host}: only the process that "
                                            f"joined as {host} may act for it (if that process restarted, it joins "
                                            "again)")
        return entry

    async def leave(self, host: str) -> None:
        """A host stops taking part (training ended or failed); rounds no longer wait for it."""
        entry = self.hosts.get(host)
        if entry is not None:
            entry.state = HostState.LEFT
        await self.maybe_close()
        self._check_finished()
        await self._notify()

    async def check_leases(self) -> None:
        """Drop training hosts not heard from within the lease (rounds stop waiting for them); the run may have
        finished (every host gone)."""
        if self.hosts.expire():
            await self.maybe_close()
            await self._notify()
        self._check_finished()

    def _check_finished(self) -> None:
        """The run is complete once no host is still training (dropped hosts do not hold the end of the run);
        the coordinator may stop once every host has left or is not heard from any more."""
        everyone = len(self.hosts) >= self.config.hosts
        if everyone and not self.received and not self.hosts.still_training():
            self.complete = True
        if self.complete and self.hosts.all_gone():
            self.finished.set()

    # -- deltas ------------------------------------------------------------------------------------------------
    def check_upload(self, host: str, round_: int, size: int | None) -> CoordinatorModel:
        """Refuse an upload before its body is read, where its headers already show it is wrong."""
        model = self.require_model()
        entry = self.hosts.known(host)
        if self.complete:
            raise Refusal(Reason.LATE, f"the run completed at round {self.published_round}; apply its last sync",
                          round=self.round)
        if round_ == self.round and host in self.received:
            raise Refusal(Reason.DUPLICATE, f"host {host} already sent its delta for round {round_}")
        if round_ != self.round or self.closing:
            closing = self.closing and round_ == self.round
            late = closing or round_ == self.published_round
            raise Refusal(Reason.LATE if late else Reason.STALE_BASE,
                          f"round {round_} is {'closing' if closing else 'not open'}; the coordinator is at round "
                          f"{self.round}{'' if late else ': fetch the model'}", round=self.round)
        if size is not None and size != model.layout.total:
            raise Refusal(Reason.INVALID, f"delta is {size} bytes but this model's q4 delta is {model.layout.total} bytes "
                                  f"(block size {self.config.q4.block_size}, {self.config.q4.scale_dtype} scales)")
        self.hosts.seen(entry)
        return model

    async def accept_delta(self, host: str, round_: int, buffer: torch.Tensor, received_at: float) -> dict:
        """Check a received delta completely, then hand it to the accumulator (not waiting for it)."""
        model = self.check_upload(host, round_, buffer.numel())
        try:
            message = await self._in(self._parse, Q4Message.parse, buffer)
        except PayloadError as e:
            raise Refusal(Reason.INVALID, f"delta rejected: {e}") from None
        meta = message.meta
        self.check_upload(host, round_, None)  # the round may have moved while the payload was checked
        try:
            if meta.kind != "delta" or meta.round != round_ or meta.host != host:
                raise PayloadError(f"payload says kind={meta.kind} round={meta.round} host={meta.host}, "
                                   f"but was sent as round {round_}'s delta of host {host}")
            q4 = self.config.q4
            if (meta.codec, meta.block_size, meta.scale_dtype) != (q4.codec, q4.block_size, q4.scale_dtype):
                raise PayloadError(f"payload uses {meta.codec}, block size {meta.block_size} with {meta.scale_dtype} "
                                   f"scales; this run uses {q4.codec}, {q4.block_size} with {q4.scale_dtype}")
            check_same_model(model.specs, meta.tensors, "delta")
        except PayloadError as e:
            raise Refusal(Reason.INVALID, f"delta rejected: {e}") from None
        if meta.samples > MAX_SAMPLES:
            raise Refusal(Reason.INVALID, f"delta rejected: {meta.samples} samples in one round; at most {MAX_SAMPLES} "
                                          "(2^24) are taken from one host")
        if not message.weighted_scales_finite(meta.samples):
            raise Refusal(Reason.INVALID, f"delta rejected: {meta.samples} samples with scales up to "
                                  f"{message.max_scale:.3g} would overflow the accumulator; the host's training "
                                  "diverged or its sample count is wrong")
        if meta.base_hash != model.hash:
            raise Refusal(Reason.STALE_BASE, f"delta of host {host} was computed against model {meta.base_hash}, but round "
                                  f"{round_} started from {model.hash}; fetch the model and rejoin",
                          model_hash=model.hash)
        self.received[host] = meta.samples
        self.metrics[host] = meta.metrics
        self.stopping = self.stopping or meta.final
        entry = self.hosts[host]
        entry.state = HostState.FINISHED if meta.final else HostState.TRAINING
        future = asyncio.ensure_future(self._in(self._work, model.accumulate, message, meta.samples))
        self._accumulating.append(future)
        future.add_done_callback(lambda f: self._after_accumulate(f, host, round_, received_at, len(buffer)))
        return {"accepted": True, "round": round_}

    def _after_accumulate(self, future: asyncio.Future, host: str, round_: int, start: float, size: int) -> None:
        if future.cancelled():
            return
        if future.exception() is not None:
            log.error("nodeox coordinator: accumulating host %s's delta failed: %r", host, future.exception())
            return
        self.record(PhaseRecord(round_, COORDINATOR, RECEIVE, start, time.time(), size, extra={"from_host": host}))
        asyncio.ensure_future(self.maybe_close())

    # -- closing a round ------------------------------------------------------------------------------------
    def needed(self) -> int:
        """The fewest deltas this round closes with: --min-hosts, lowered to the hosts still in the run."""
        return max(1, min(self.config.quorum, self.hosts.in_run(self.received)))

    def _ready_to_close(self) -> bool:
        if self.model is None or self.closing or self.shutting_down or not self.received:
            return False
        if any(not f.done() for f in self._accumulating) or len(self.received) < self.needed():
            return False
        everyone = len(self.hosts) >= self.config.hosts and all(h.id in self.received for h in self.hosts.expected(self.received))
        timeout = self.config.round_timeout
        return everyone or (timeout is not None and time.time() - self.round_opened >= timeout)

    async def maybe_close(self) -> None:
        if not self._ready_to_close():
            return
        self.closing = True
        try:
            await self._close()
        except Exception:  # noqa: BLE001 - the model and its hash still agree (close_round); tried again later
            log.exception("nodeox coordinator: closing round %d failed; it is tried again", self.round)
        finally:
            self.closing = False
        await self._notify()

    async def _close(self) -> None:
        model = self.require_model()
        round_ = self.round
        late = sorted(h.id for h in self.hosts.expected(self.received) if h.id not in self.received)
        if late:  # alive but slow: still in the run, so the next round waits for them again
            log.warning("nodeox coordinator: round %d closes on its --round-timeout without host(s) %s", round_,
                        ", ".join(late))
        start = time.time()
        await asyncio.gather(*self._accumulating)
        self._accumulating = []
        aggregated = time.time()
        self.record(PhaseRecord(round_, COORDINATOR, AGGREGATE, start, aggregated,
                                extra={"hosts": sorted(self.received), "samples": sum(self.received.values())}))
        if self._persisting is not None:  # the last round's state is on disk before θ changes again
            await self._persisting
        await self._keep_downloads(model)
        closed = await self._in(self._work, model.close_round, round_, self._round_metrics())
        message = closed.sync
        refused = {}
        if closed.not_finite:
            refused = {"refused": f"not finite: {', '.join(closed.not_finite[:5])}"}
            log.error("nodeox coordinator: round %d refused: its result would make %s NaN or Inf; the model stays "
                      "%s and hosts get a sync that changes nothing. A host's training diverged, or a delta is too "
                      "large for the model's dtype (lower the learning rate, clip gradients)", round_,
                      ", ".join(closed.not_finite[:5]), message.meta.model_hash)
        self.record(PhaseRecord(round_, COORDINATOR, SYNC_PREPARE, aggregated, time.time(), len(message),
                                extra={"model_hash": message.meta.model_hash, **refused}))
        if self.before_publish is not None:  # a comparison hook: benchmarks/exchange.py saves the model here
            try:
                await self.before_publish(self, round_, message)
            except Exception:  # noqa: BLE001 - the round is applied: publish it regardless
                log.exception("nodeox coordinator: before_publish of round %d failed", round_)
        # the round's state changes together, on the loop, after the last await
        model.publish(message)
        self.received, self.metrics = {}, {}
        self.complete = self.complete or self.stopping
        self.published_round = round_
        self.round = round_ + 1
        self.round_opened = time.time()
        self._check_finished()
        if self.complete:
            log.info("nodeox coordinator: the run completed after round %d; final model %s", round_, model.hash)
        self._persist_round()
        self.sample_memory()

    def _round_metrics(self) -> dict[str, list]:
        reduced = reduce_metrics([(self.received[h], m) for h, m in self.metrics.items() if m])
        kept, dropped = fit_metrics(reduced)
        if dropped:
            log.warning("nodeox coordinator: round %d's sync has no room for metrics %s", self.round, dropped)
        return kept

    async def wait_stable(self) -> None:
        """Return once no round's close is changing θ (a full-model download starts only then)."""
        while self.closing:
            await self._wait(lambda: not self.closing, self.config.long_poll)

    async def _keep_downloads(self, model: CoordinatorModel) -> None:
        """Copy-on-publish: full-model downloads in flight keep the θ they started with."""
        streams = list(self.downloads)
        if streams:
            copies = await self._in(self._work, lambda: [s.unsent() for s in streams])
            for stream, kept in zip(streams, copies):
                stream.keep(kept)

    # -- the run's state on disk ------------------------------------------------------------------------------
    def _persist_round(self, *, snapshot: bool = False) -> None:
        """Start writing the run's state (the round, hosts, last sync, outer state; the model every
        ``snapshot_every`` rounds); not awaited: the next round's close waits for it before changing θ."""
        model = self.model
        if self.store is None or model is None:
            return
        saved = SavedRun(round=self.round, model_hash=model.hash, complete=self.complete,
                         hosts=self.hosts.saved(),
                         q4={"codec": self.config.q4.codec, "block_size": self.config.q4.block_size,
                             "scale_dtype": self.config.q4.scale_dtype},
                         outer=self.config.outer)
        if self._saved is not None:
            saved.files = dict(self._saved.files)
            saved.snapshot_round, saved.snapshot_hash = self._saved.snapshot_round, self._saved.snapshot_hash
        self._saved = saved
        snapshot = (snapshot or self.round % self.config.snapshot_every == 0) and saved.snapshot_hash != model.hash
        sync = model.latest_sync if model.latest_sync is not None and model.latest_sync.meta.round == self.round - 1 \
            else None
        chunks = model.model_chunks(self.round) if snapshot else None
        start, after_round = time.time(), max(self.published_round, 0)
        future = asyncio.ensure_future(self._in(self._persist, lambda: self.store.save(
            saved, sync=sync, outer=dict(model.outer.state), model_chunks=chunks)))

        def done(f: asyncio.Future) -> None:
            if f.cancelled() or f.exception() is not None:
                log.error("nodeox coordinator: could not save the run's state in %s: %r", self.store.dir,
                          None if f.cancelled() else f.exception())
                return
            self.record(PhaseRecord(after_round, COORDINATOR, PERSIST, start, time.time(), f.result(),
                                    extra={"snapshot": snapshot}))

        future.add_done_callback(done)
        self._persisting = future

    async def save_at_shutdown(self) -> None:
        """Let a round that is closing publish (no other starts closing), wait for its state, then write the state
        with a snapshot."""
        self.shutting_down = True
        await self.wait_stable()
        if self._persisting is not None:
            await self._persisting
        if self.model is not None:
            self._persist_round(snapshot=True)
            await self._persisting

    # -- syncs ------------------------------------------------------------------------------------------------
    async def wait_sync(self, round_: int, wait: float, host: str | None = None) -> Q4Message | None:
        """Round ``round_``'s sync once published; None if not within ``wait`` seconds or if the run completed
        before that round closed (``self.complete`` tells which)."""
        entry = self.hosts.get(host or "")
        if entry is not None and entry.state is HostState.LEFT:
            self.hosts.known(host)
        if round_ < self.published_round:
            raise Refusal(Reason.GONE, f"the sync of round {round_} is gone; the model is at round {self.round}: "
                                  "fetch GET /v1/model", round=self.round)
        if round_ > self.round:
            self.require_model()  # a resumed run whose saved state is behind this host: it gives its model back
            raise Refusal(Reason.NOT_OPEN, f"round {round_} has not started; the coordinator is at round {self.round}",
                          round=self.round)
        if (round_ == self.round and not self.closing and not self.complete and entry is not None
                and host not in self.received and entry.state in (HostState.TRAINING, HostState.DROPPED)):
            raise Refusal(Reason.NO_DELTA, f"the coordinator holds no delta of host {host} for round {round_} (it "
                                           "restarted, or the delta was never sent): send it again")
        if entry is not None:
            entry.seen = time.monotonic()

        def left() -> bool:
            return entry is not None and entry.state is HostState.LEFT

        if not await self._wait(lambda: self.published_round >= round_ or self.complete or left(), wait):
            return None
        if left():
            self.hosts.known(host)
        if self.published_round < round_:
            return None  # complete: no more rounds
        sync = self.model.latest_sync if self.model is not None else self.resumed.sync if self.resumed else None
        if self.published_round != round_ or sync is None or sync.meta.round != round_:
            raise Refusal(Reason.GONE, f"the sync of round {round_} is gone; fetch GET /v1/model", round=self.round)
        if entry is not None:
            self.hosts.seen(entry)  # a dropped host that fetches a sync is back: the next round waits for it again
        return sync

    async def accumulated(self) -> None:
        """Wait until every delta accepted so far has been accumulated."""
        if self._accumulating:
            await asyncio.gather(*list(self._accumulating), return_exceptions=True)

    def log_waiting(self) -> None:
        """Every ``status_interval`` seconds of a round that has not closed, say whom it waits for."""
        now = time.time()
        if now - max(self.round_opened, self._last_status) < self.config.status_interval:
            return
        said = waiting_for(self)
        if said is not None:
            self._last_status = now
            log.log(said[0], "nodeox coordinator: %s", said[1])

    def status(self) -> dict:
        return {
            "round": self.round, "published_round": self.published_round, "complete": self.complete,
            "model_hash": None if self.model is None else self.model.hash,
            "hosts": {h.id: h.state.value for h in self.hosts.values()},
            "received": sorted(self.received), "peak_rss_bytes": self.peak_rss, "lease": self.config.lease,
            "downloads": len(self.downloads), "codec": self.config.q4.codec,
            "block_size": self.config.q4.block_size, "scale_dtype": self.config.q4.scale_dtype,
        }

    def close(self) -> None:
        self._parse.shutdown(wait=True)
        self._work.shutdown(wait=True)
        self._persist.shutdown(wait=True)


def _same(given: str, expected: str) -> bool:
    return hmac.compare_digest(given.encode("utf-8", "surrogateescape"), expected.encode())
