"""The round state machine: who takes part, when a round closes, what is published.

Stopping together: a host's final delta (its training ended: max_steps, max_epochs, early stopping) makes
its round the run's last one. That round's sync completes the run, so every host ends on the same model
after the same round, and a host that is still training stops at its next round boundary.

Runs on the event loop; tensor work goes to two threads (one parses and checks uploads, one accumulates
and prepares syncs, in order), so the loop keeps answering while a round is aggregated. A rejected
upload changes nothing: it is checked completely before its first byte reaches the accumulator.

Identity: a join admits a host id (at most ``--hosts`` distinct ids unless ``--elastic``) and returns a
credential that every later call of that host must present (:meth:`Rounds.authenticate`). An id already held
by a live host is refused (``ID_IN_USE``); it can be taken again once its holder has left or was dropped by a
round timeout, or by a join presenting the holder's credential. Taking it issues a new credential, so the
previous holder, should it still run, is refused from then on.
"""

from __future__ import annotations

import asyncio
import enum
import hmac
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from ..core.modelfile import model_header, read_model
from ..core.phases import AGGREGATE, COORDINATOR, RECEIVE, RSS, SYNC_PREPARE, PhaseRecord
from ..core.pool import WorkerPool
from ..core.protocol import JoinReply, Reason, Refusal
from ..core.specs import PayloadError, TensorSpec, check_same_model
from ..core.wire import Q4Message, fit_metrics
from .config import CoordinatorConfig
from .intake import MAX_SAMPLES, model_bytes
from .metrics import reduce_metrics
from .model import CoordinatorModel
from .runlog import RunLog, peak_rss_bytes, rss_bytes

log = logging.getLogger(__name__)



class HostState(enum.Enum):
    TRAINING = "training"  # expected in every round
    DROPPED = "dropped"  # missed a round's deadline; expected again once it fetches a sync
    FINISHED = "finished"  # sent its final delta
    LEFT = "left"  # said goodbye (or failed): takes no further part


@dataclass
class Host:
    id: str
    credential: str
    state: HostState = HostState.TRAINING
    joined: float = 0.0


class Rounds:
    """Everything the coordinator knows about the run, changed only on the event loop."""

    def __init__(self, config: CoordinatorConfig, runlog: RunLog, pool: WorkerPool) -> None:
        self.config = config
        self.runlog = runlog
        self.pool = pool
        self.model: CoordinatorModel | None = None
        self.round = 0
        self.published_round = -1
        self.hosts: dict[str, Host] = {}
        self.received: dict[str, int] = {}
        self.metrics: dict[str, dict[str, list]] = {}  # the round's deltas' sync_dist values, by host
        self.stopping = False  # a final delta came in this round: it is the run's last
        self.closing = False
        self.complete = False
        self.round_opened = time.time()
        self.provider: str | None = None
        self.provider_since = 0.0
        self.provider_specs: tuple[TensorSpec, ...] = ()
        self.changed = asyncio.Condition()
        self.finished = asyncio.Event()
        self.model_lock = asyncio.Lock()  # full-model downloads versus the round's apply
        self._parse = ThreadPoolExecutor(1, thread_name_prefix="nodeox-parse")
        self._work = ThreadPoolExecutor(1, thread_name_prefix="nodeox-work")
        self._accumulating: list[asyncio.Future] = []
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
                                extra={"rss_bytes": rss, "peak_rss_bytes": self.peak_rss}))
        return rss

    def _reply(self, **fields) -> JoinReply:
        q4 = self.config.q4
        return JoinReply(round=self.round, block_size=q4.block_size, scale_dtype=q4.scale_dtype, codec=q4.codec,
                         **fields)

    def require_model(self) -> CoordinatorModel:
        if self.model is None:
            raise Refusal(Reason.NO_MODEL, "the run has no model yet: join first (the first host provides it)")
        return self.model

    # -- model ----------------------------------------------------------------------------------------------
    async def load_initial_model(self, data: torch.Tensor) -> None:
        _, _, specs, tensors = read_model(data)
        self.model = await self._in(self._work, CoordinatorModel, specs, tensors, self.config.q4, self.pool,
                                 self.config.outer)
        log.info("nodeox coordinator: model of %d tensors (%.1f MB), hash %s", len(specs),
                 self.model.nbytes / 1e6, self.model.hash)

    def check_model_upload(self, host: str, size: int) -> None:
        """Refuse an initial-model upload before its body is read (or allocated for): only the chosen provider,
        only once, and only of the size its join's tensor specs give."""
        if self.model is not None:
            raise Refusal(Reason.HAS_MODEL, "the run already has a model; fetch it with GET /v1/model",
                             model_hash=self.model.hash)
        if host != self.provider:
            raise Refusal(Reason.NOT_PROVIDER, f"host {self.provider} provides the initial model, not host {host}; join again")
        data = model_bytes(self.provider_specs)
        header = len(model_header(self.provider_specs, self.round, "f" * 128))  # at most: metadata varies a little
        if not data < size <= data + header:
            raise Refusal(Reason.INVALID, f"model upload of {size} bytes does not fit the {len(self.provider_specs)} "
                                          f"tensors host {host} declared at join ({data} bytes and a header of at "
                                          f"most {header})")

    async def put_model(self, host: str, data: torch.Tensor) -> dict:
        """The providing host's initial model."""
        if self.model is not None:
            raise Refusal(Reason.HAS_MODEL, "the run already has a model; fetch it with GET /v1/model",
                             model_hash=self.model.hash)
        try:
            _, _, specs, tensors = await self._in(self._parse, read_model, data)
        except PayloadError as e:
            raise Refusal(Reason.INVALID, f"initial model rejected: {e}") from None
        try:
            check_same_model(self.provider_specs, specs, "the initial model")
        except PayloadError as e:
            raise Refusal(Reason.INVALID, f"{e} (as declared at join)") from None
        model = await self._in(self._work, CoordinatorModel, specs, tensors, self.config.q4, self.pool,
                                 self.config.outer)
        if self.model is not None:  # another upload won the race while this one was read
            raise Refusal(Reason.HAS_MODEL, "the run already has a model; fetch it with GET /v1/model", model_hash=self.model.hash)
        self.model = model
        log.info("nodeox coordinator: initial model from host %s: %d tensors (%.1f MB), hash %s", host,
                 len(specs), model.nbytes / 1e6, model.hash)
        self.round_opened = time.time()
        self.sample_memory()
        await self._notify()
        return {"model_hash": model.hash, "round": self.round}

    # -- hosts ------------------------------------------------------------------------------------------------
    async def join(self, host: str, specs: tuple[TensorSpec, ...], credential: str = "") -> JoinReply:
        """Admit a host (see the module's rules on ids); tell it the round, the model hash and its credential, or
        that it must provide the model. A host whose model does not fit the run is refused and not registered."""
        self._check_admission(host, credential)
        if self.model is None:
            now = time.time()
            if self.provider in (None, host) or now - self.provider_since > self.config.provider_timeout:
                self.provider, self.provider_since, self.provider_specs = host, now, specs
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
                                            "host leaves; one that died is free again once a round times it out)")

    def _register(self, host: str, credential: str) -> str:
        """Admit ``host`` (checked again: no await since) and return its new credential."""
        self._check_admission(host, credential)
        entry = self.hosts[host] = Host(host, secrets.token_urlsafe(24), joined=time.time())
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

    def _check_finished(self) -> None:
        """The run is complete once every host has finished, or finished hosts are all that is left (hosts
        dropped by a round timeout that never came back do not hold the end of the run)."""
        everyone = len(self.hosts) >= self.config.hosts
        if everyone and not self.received and all(h.state is not HostState.TRAINING for h in self.hosts.values()):
            self.complete = True
        if self.complete and all(h.state is HostState.LEFT for h in self.hosts.values()):
            self.finished.set()

    # -- deltas ------------------------------------------------------------------------------------------------
    def check_upload(self, host: str, round_: int, size: int | None) -> CoordinatorModel:
        """Refuse an upload before its body is read, where its headers already show it is wrong."""
        model = self.require_model()
        if host not in self.hosts:
            raise Refusal(Reason.NOT_JOINED, f"host {host} has not joined; POST /v1/join first")
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
    def _expected(self) -> list[Host]:
        return [h for h in self.hosts.values()
                if h.state is HostState.TRAINING or (h.state is HostState.FINISHED and h.id in self.received)]

    def _ready_to_close(self) -> bool:
        if self.model is None or self.closing or not self.received:
            return False
        if any(not f.done() for f in self._accumulating):
            return False
        everyone = len(self.hosts) >= self.config.hosts and all(h.id in self.received for h in self._expected())
        timeout = self.config.round_timeout
        timed_out = (timeout is not None and time.time() - self.round_opened >= timeout
                     and len(self.received) >= self.config.quorum)
        return everyone or timed_out

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
        for h in self.hosts.values():
            if h.state is HostState.TRAINING and h.id not in self.received:
                log.warning("nodeox coordinator: round %d closes without host %s (timed out)", round_, h.id)
                h.state = HostState.DROPPED
        start = time.time()
        await asyncio.gather(*self._accumulating)
        self._accumulating = []
        aggregated = time.time()
        self.record(PhaseRecord(round_, COORDINATOR, AGGREGATE, start, aggregated,
                                extra={"hosts": sorted(self.received), "samples": sum(self.received.values())}))
        async with self.model_lock:
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
            log.info("nodeox coordinator: the run completed after round %d (a host's training ended); final model %s",
                     round_, model.hash)
        self.sample_memory()

    def _round_metrics(self) -> dict[str, list]:
        reduced = reduce_metrics([(self.received[h], m) for h, m in self.metrics.items() if m])
        kept, dropped = fit_metrics(reduced)
        if dropped:
            log.warning("nodeox coordinator: round %d's sync has no room for metrics %s", self.round, dropped)
        return kept

    # -- syncs ------------------------------------------------------------------------------------------------
    async def wait_sync(self, round_: int, wait: float, host: str | None = None) -> Q4Message | None:
        """Round ``round_``'s sync once published; None if not within ``wait`` seconds or if the run completed
        before that round closed (``self.complete`` tells which)."""
        model = self.require_model()
        if round_ < self.published_round:
            raise Refusal(Reason.GONE, f"the sync of round {round_} is gone; the model is at round {self.round}: "
                                  "fetch GET /v1/model", round=self.round)
        if round_ > self.round:
            raise Refusal(Reason.NOT_OPEN, f"round {round_} has not started; the coordinator is at round {self.round}",
                             round=self.round)
        if not await self._wait(lambda: self.published_round >= round_ or self.complete, wait):
            return None
        if self.published_round < round_:
            return None  # complete: no more rounds
        if self.published_round != round_:
            raise Refusal(Reason.GONE, f"the sync of round {round_} is gone; fetch GET /v1/model", round=self.round)
        entry = self.hosts.get(host or "")
        if entry is not None and entry.state is HostState.DROPPED:
            entry.state = HostState.TRAINING  # back: the next round waits for it again
        return model.latest_sync

    async def accumulated(self) -> None:
        """Wait until every delta accepted so far has been accumulated."""
        if self._accumulating:
            await asyncio.gather(*list(self._accumulating), return_exceptions=True)

    def status(self) -> dict:
        return {
            "round": self.round, "published_round": self.published_round, "complete": self.complete,
            "model_hash": None if self.model is None else self.model.hash,
            "hosts": {h.id: h.state.value for h in self.hosts.values()},
            "received": sorted(self.received), "peak_rss_bytes": self.peak_rss,
            "codec": self.config.q4.codec, "block_size": self.config.q4.block_size,
            "scale_dtype": self.config.q4.scale_dtype,
        }

    def close(self) -> None:
        self._parse.shutdown(wait=True)
        self._work.shutdown(wait=True)


def _same(given: str, expected: str) -> bool:
    return hmac.compare_digest(given.encode("utf-8", "surrogateescape"), expected.encode())
