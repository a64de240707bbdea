"""A host's side of a round, outside Lightning: encode, upload, wait, download, apply, verify, and the rules
that recover from what can go wrong on the way.

The rules, each in terms of the protocol's outcomes (never HTTP):
- a delta that arrives after its round closed (``LATE``) is dropped; the round's sync is applied as usual;
- a delta computed against another model (``STALE_BASE``) means this host missed a sync: it fetches the
  model and takes part in the current round with an empty delta;
- a sync that is gone (``SyncGone``), that cannot be parsed, or that does not fit this host's model makes the
  host fetch the full model; so does a model hash that differs after applying a sync;
- a download that breaks off is asked for again (``DOWNLOAD_TRIES``);
- a host whose last round was late still sends an empty final delta, so the coordinator knows it finished;
- a host that learns the run completed before its round closed (another host's training ended while its
  delta was on the way) drops the local work no round took: it ends on the run's final model, like every host;
- a coordinator that no longer knows this host or has no model (``NOT_JOINED``, ``NO_MODEL``: it restarted)
  is joined again, telling it which model this host holds: it may ask for that model back (the round's
  base θ_r, which every host holds bit-identical), or the host fetches the coordinator's if it differs;
- a coordinator that holds no delta of this host for the round it waits on (``NO_DELTA``: it restarted) gets
  the round's delta again (still in its buffer), or an empty one if there is none to resend;
- values exchanged outside a round that a restarted coordinator refuses (``NOT_JOINED``) are posted again once
  this host joined again (:meth:`HostRound.exchange_values`), so no host falls back to its own values.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from ..core import phases as P
from ..core import safetensors
from ..core.logs import Named
from ..core.phases import PhaseLog, PhaseRecord
from ..core.protocol import (Reason, Refusal, RunComplete, SyncGone, SyncReady, TransferBroken, Upload,
                             ValuesReply, read_fully)
from ..core.codecs import codec_for
from ..core.specs import ModelMismatchError, PayloadError
from ..core.streaming import MessageReader
from ..core.transport import HostClient
from ..core.wire import Message, MessageMeta
from .ending import run_completed
from .tensors import HostTensors

log = logging.getLogger(__name__)

DOWNLOAD_TRIES = 3
REJOIN_TRIES = 3
REJOIN = (Reason.NOT_JOINED, Reason.NO_MODEL)
REJOIN_WAIT = 0.2  # seconds between values posts while the exchange in flight joins again
UPLOAD_POLL = 1.0  # seconds a sync poll lasts while the host's own upload goes on


class Into(enum.Enum):
    """Where a sync or a fetched model goes; the caller says, for each call."""

    LIVE = "live"  # the live model, and θ_r := it: training waits for the exchange
    BASE = "base"  # θ_r (``base``) only: training goes on in the live model, which folds it in (overlap)


@dataclass
class RoundResult:
    round: int  # the round that closed
    model_hash: str
    complete: bool  # the run has completed: no more rounds
    contributed: bool  # this host's delta was part of the round
    metrics: dict[str, list] = field(default_factory=dict)  # the sync's sync_dist values, reduced across hosts


class HostRound:
    """One host's place in the run: its round, its model's hash, and the steps of a round."""

    def __init__(self, tensors: HostTensors, client: HostClient, phases: PhaseLog, *, rounding: str = "nearest",
                 error_feedback: bool = True, codec_threads: int = 1, name: str = "nodeox") -> None:
        self.log = Named(log, name)  # what its lines start with (a site relay's: its own name)
        self.tensors = tensors
        self.client = client
        self.phases = phases
        self.rounding = rounding
        self.error_feedback = error_feedback
        self.codec_threads = codec_threads
        self.round = 0
        self.model_hash = ""
        self.complete = False
        self._sent: Message | None = None  # the last delta uploaded (resent if the coordinator lost it)
        self._final = False  # this host has sent (or is sending) its final delta
        self.trains_on = False  # training goes on while the round overlapped is open (set by the training side)
        self._applying = None  # the sync being applied, across retries of its download
        self._seed = int.from_bytes(client.host.encode()[:8].ljust(8, b"\0"), "little")
        self._trained: deque[int] = deque()  # the samples of the last rounds, one per fragment

    @property
    def host(self) -> str:
        return self.client.host

    # -- joining ------------------------------------------------------------------------------------------------
    def join(self) -> None:
        """Join the run and agree on the starting model (provide it, keep ours if equal, or fetch it)."""
        reply = self._join_reply(None)
        if reply.complete:
            raise run_completed(self.client.url, reply.round - 1, reply.model_hash)
        codec_for(reply.codec).check_rounding(self.rounding)
        self.tensors.allocate(reply.codec, self.codec_threads, error_feedback=self.error_feedback)
        self.round = reply.round
        ours = self.tensors.base_hash()  # base is a copy of the live model here
        if reply.provide_model:
            self.model_hash = ours
            try:
                with self.phases.timed(self.round, P.PROVIDE_MODEL) as rec:
                    body = self.tensors.model_file(self.round, ours)
                    rec.bytes = len(body)
                    theirs = self.client.put_model(body)
            except Refusal as e:
                if e.reason is not Reason.HAS_MODEL:
                    raise
                self.fetch_model(Into.LIVE)  # another host provided it meanwhile
                return
            if theirs != ours:
                raise RuntimeError(f"coordinator hashed the initial model as {theirs}, this host as {ours}; "
                                   "versions differ?")
            self.log.info("host %s provided the initial model %s", self.host, ours)
        elif ours == reply.model_hash:
            self.model_hash = ours
        else:
            self.fetch_model(Into.LIVE)

    def _join_reply(self, model_hash: str | None):
        specs = [s.as_json() for s in self.tensors.specs]
        reply = self.client.join(specs, model_hash=model_hash, round_=self.round)
        while reply.retry:  # another host is providing the model
            reply = self.client.join(specs, model_hash=model_hash, round_=self.round)
        return reply

    def rejoin(self, into: Into = Into.LIVE, *, fetch: bool = True) -> None:
        """Join again, keeping this host's model and round (the coordinator restarted or forgot this host): give
        the round's base model back if asked, fetch the coordinator's (``into``) if it differs (unless ``fetch``
        is False: the next round's upload then finds its base stale and fetches it)."""
        reply = self._join_reply(self.model_hash)
        if reply.complete:
            self.complete = True
            return
        theirs = self._give_back() if reply.provide_model else reply.model_hash
        if theirs != self.model_hash and fetch:
            self.fetch_model(into)
            return
        self.log.info("host %s joined again at round %d%s", self.host, self.round,
                 " and gave the model back" if reply.provide_model else "")

    def _give_back(self) -> str | None:
        """Upload θ_r (the round's base, what every host holds); returns the coordinator's model hash."""
        try:
            return self.client.put_model(self.tensors.model_file(self.round, self.model_hash, self.tensors.base))
        except Refusal as e:
            if e.reason is not Reason.HAS_MODEL:
                raise
            return e.extra.get("model_hash")  # another host gave it back first

    def _call(self, fn, *args, into: Into, **kwargs):
        """A call to the coordinator; if it no longer knows this host or has no model (it restarted), join again
        (a model fetched meanwhile goes ``into``) and call once more."""
        for attempt in range(1, REJOIN_TRIES + 1):
            try:
                return fn(*args, **kwargs)
            except Refusal as e:
                if e.reason not in REJOIN or attempt == REJOIN_TRIES:
                    raise
                self.log.warning("host %s: %s; joining again", self.host, e)
                self.rejoin(into)

    # -- values outside rounds ------------------------------------------------------------------------------------
    def exchange_values(self, key: str, payload: object, *, retry_for: float,
                        joins: Callable[[], bool]) -> ValuesReply:
        """Values under ``key`` with the other hosts (:mod:`lightning_nodeox.coordinator.values`). A coordinator
        that no longer knows this host (it restarted) is joined again and the values posted again, for up to
        ``retry_for`` seconds (then its refusal is raised): by this call when ``joins()`` (no exchange in flight;
        the model is not fetched here, so every rank keeps it), else by the exchange in flight, which it waits
        for."""
        deadline = time.monotonic() + retry_for
        while True:
            try:
                return self.client.exchange_values(key, payload)
            except Refusal as e:
                if e.reason not in REJOIN or time.monotonic() >= deadline:
                    raise
                if joins():
                    self.log.warning("host %s: values %s: %s; joining again", self.host, key, e)
                    self.rejoin(fetch=False)
                else:
                    time.sleep(REJOIN_WAIT)

    # -- a round --------------------------------------------------------------------------------------------------
    def run_round(self, samples: int, final: bool, metrics: dict[str, list] | None = None) -> RoundResult:
        """One whole exchange while training waits: encode, upload, then sync (following later rounds if this
        is the final one). ``metrics``: this host's latest sync_dist values, ``{name: [value, reduction]}``."""
        self.tensors.boundary(self.round, final=final)
        message = self.encode(self.tensors.live, self._weight(samples), final, metrics)
        return self.finish_round(message, final, Into.LIVE)

    def run_overlapped(self, samples: int, delayed: bool, metrics: dict[str, list] | None = None) -> RoundResult:
        """One exchange while training goes on: the delta is the snapshot's, and the sync goes into ``base``
        only; the training side folds it into the live model (:meth:`HostTensors.fold`)."""
        reader = self.encode(self.tensors.snapshot, self._weight(samples), False, metrics)
        if delayed:
            reader.join()  # the snapshot becomes θ_r only once the delta is encoded from it
            self.tensors.snapshot_base()
        return self.finish_round(reader, False, Into.BASE)

    def _weight(self, samples: int) -> int:
        """A delta's samples from the ``samples`` trained in the round closing now: with fragments, what the round's
        fragment trained since its own last sync (the samples of the last rounds, one per fragment)."""
        self._trained.append(samples)
        while len(self._trained) > self.tensors.fragment_count:
            self._trained.popleft()
        return sum(self._trained)

    def finish_round(self, reader: MessageReader, final: bool, into: Into) -> RoundResult:
        """Upload a delta as it is encoded and take the round's sync (see :meth:`run_round`), which starts to
        arrive while the upload still goes on (:meth:`_sync_while_uploading`); sending it again after a failure
        is harmless (a delta taken already is ``TAKEN``)."""
        self._final = final
        uploading = _Uploading(self, reader, into)
        early = self._sync_while_uploading(uploading, into)
        outcome = uploading.outcome()
        if early is not None:
            result = early
            if final and outcome is not Upload.LATE and not result.complete:
                result = self.synchronize(follow_to_end=True, into=into)
        else:
            result = self.synchronize(follow_to_end=final and outcome is not Upload.LATE, into=into)
        if final and outcome is Upload.LATE and not self.complete:
            self._send_empty(final=True, into=into)  # so the coordinator knows this host has finished
            result = self.synchronize(follow_to_end=True, into=into)
        result.contributed = outcome is Upload.TAKEN and result.contributed
        return result

    def _sync_while_uploading(self, uploading: _Uploading, into: Into) -> RoundResult | None:
        """While this host's delta is still on its way, wait for the round's sync and apply it as it comes (the
        link carries the delta's last pieces one way and the sync's first the other); None when it is not
        ready before the upload ends, or anything is not plain (the round's normal course then takes over:
        :meth:`synchronize`, which resumes a sync half applied here)."""
        round_, start = self.round, time.time()
        while uploading.running():
            try:
                reply = self.client.poll_sync(round_, UPLOAD_POLL, training=self._training(into), sending=True)
            except Exception:  # noqa: BLE001 - the normal course says what is wrong
                return None
            if reply is None:
                continue
            if not isinstance(reply, SyncReady):
                return None
            self.phases.emit(PhaseRecord(round_, self.phases.host, P.WAIT if into is Into.LIVE else P.POLL, start,
                                         time.time(), extra={"uploading": True}))
            self.complete = reply.complete
            try:
                sync = self._receive(reply.body, round_, into)
            except (TransferBroken, PayloadError):
                return None
            if sync is None:
                return None
            return self._verified(sync, into)
        return None

    def encode(self, source, samples: int, final: bool, metrics: dict[str, list] | None = None) -> MessageReader:
        """Start encoding this round's delta, piece by piece (:meth:`HostTensors.encode`); its upload sends each
        piece as it is sealed."""
        tensors = self.tensors
        error = tensors.estimate_error(source) if samples > 0 else None
        seed = None if self.rounding == "nearest" else hash((self._seed, self.round)) & (2**62 - 1)
        start = time.time()
        reader = tensors.encode(source, MessageMeta("delta", self.round, self.host, self.model_hash, samples=samples,
                                               final=final, metrics=metrics or {}), seed)
        reader.record = PhaseRecord(self.round, self.phases.host, P.ENCODE, start, start, len(reader),
                                    {"samples": samples, "q4_rel_error": error})
        return reader

    def _encoded(self, reader: MessageReader) -> Message:
        """Wait until ``reader``'s message is made (raising the encoder's error) and record its encode phase."""
        try:
            reader.join()
        finally:
            record = reader.record
            if record is not None:
                record.end = max(record.start, reader.done_at or time.time())
                self.phases.emit(record)
                reader.record = None
        return reader.message

    def upload(self, reader: MessageReader, *, into: Into = Into.LIVE) -> Upload:
        """Send the delta (each piece as it is encoded). ``TAKEN``; ``LATE``: the round closed without it (or
        without part of it), but its sync can be applied; or ``STALE_BASE``, after which this host has fetched the
        model (``into``) and taken part in the current round anew (with an empty delta). Unless taken, this
        round's local work is dropped."""
        message = reader.message
        self._sent = message
        try:
            with self.phases.timed(self.round, P.UPLOAD) as rec:
                rec.bytes = len(message)
                outcome = self._call(self.client.post_delta, self.round, reader, into=into,
                                     training=self._training(into))
                if outcome is not Upload.TAKEN:
                    rec.extra["rejected"] = outcome.value
        finally:
            self._encoded(reader)
        if outcome is Upload.STALE_BASE:
            self.fetch_model(into)
            self._send_empty(message.meta.final, into=into)
        return outcome

    def _send_empty(self, final: bool, *, into: Into) -> None:
        """Take part in the current round without a contribution (no samples: it adds nothing), with the round's
        fragment: the tensors the others send."""
        self.tensors.take_part(self.round)
        with self.phases.timed(self.round, P.UPLOAD, empty=True) as rec:
            reader = self.tensors.encode(self.tensors.base, MessageMeta("delta", self.round, self.host, self.model_hash,
                                                                   samples=0, final=final), None)
            rec.bytes = len(reader)
            self._sent = reader.message
            try:
                self._call(self.client.post_delta, self.round, reader, into=into, training=self._training(into))
            finally:
                reader.join()

    def _resend(self, into: Into) -> None:
        """The coordinator lost this host's delta of the current round (it restarted): send it again."""
        sent = self._sent
        if sent is None or sent.meta.round != self.round or sent.meta.base_hash != self.model_hash:
            self._send_empty(self._final, into=into)
            return
        with self.phases.timed(self.round, P.UPLOAD, resent=True) as rec:
            rec.bytes = len(sent)
            outcome = self._call(self.client.post_delta, self.round, sent.view(), into=into,
                                 training=self._training(into))
        if outcome is Upload.STALE_BASE:
            self.fetch_model(into)
            self._send_empty(self._final, into=into)

    def _training(self, into: Into) -> bool:
        """Whether this host's training goes on while it waits for the round (overlapped, not yet waiting for its
        sync): told to the coordinator with each delta and sync poll, so that values wait for this host."""
        return into is Into.BASE and self.trains_on

    # -- syncs -------------------------------------------------------------------------------------------------------
    def synchronize(self, *, follow_to_end: bool = False, into: Into = Into.LIVE) -> RoundResult:
        """Wait for the round's sync, apply it ``into`` the live model or base as it arrives and verify the model
        hash (fetching the model if needed). With ``follow_to_end`` keep applying later rounds' syncs until the
        run completes."""
        while True:
            round_ = self.round
            result = self.download(into)
            if result is None:
                result = RoundResult(round_, self.model_hash, self.complete, False)
            if result.complete or not follow_to_end:
                return result

    def download(self, into: Into = Into.LIVE) -> RoundResult | None:
        """Round ``self.round``'s sync, applied piece by piece as it arrives and verified; None when there is none
        to apply (the run completed, or the host fetched the model ``into`` the live model or base instead).
        Training waits for it (``WAIT``) unless it goes into base (``POLL``: training overlaps). A download that
        breaks off is asked for again, and the pieces already applied are skipped; a piece that fails its check
        after others were applied leaves the model half-changed: the host fetches the model."""
        round_ = self.round
        attempt = 0
        if self._applying is not None and self._applying.sync.meta.round != round_:
            self._applying = None  # (one of this round, half applied while uploading, is resumed)
        while attempt < DOWNLOAD_TRIES:
            attempt += 1
            try:
                with self.phases.timed(round_, P.WAIT if into is Into.LIVE else P.POLL):
                    reply = self._call(self.client.wait_sync, round_, into=into,
                                       training=lambda: self._training(into))
            except Refusal as e:
                if e.reason is not Reason.NO_DELTA or attempt == DOWNLOAD_TRIES:
                    raise
                self.log.warning("host %s: %s", self.host, e)
                self._resend(into)
                if self.round != round_:  # the host fetched a model of another round meanwhile
                    return None
                continue
            if isinstance(reply, RunComplete):  # no later sync: this host's base is the run's final model
                self.complete = True
                if into is Into.LIVE:  # (overlapped, the training side does it between two steps)
                    self.tensors.restore_live()
                return None
            if isinstance(reply, SyncGone):
                break
            self.complete = reply.complete
            try:
                sync = self._receive(reply.body, round_, into)
            except TransferBroken as e:
                if attempt == DOWNLOAD_TRIES:
                    if self._applying is not None and self._applying.applied:
                        break  # half applied: the model is fetched
                    raise
                self.log.warning("host %s: sync download of round %d failed (%s); retrying", self.host, round_, e)
                continue
            except PayloadError as e:
                self.log.warning("host %s: sync of round %d unusable (%s); fetching the model", self.host,
                                 round_, e)
                break
            if sync is None:
                break
            return self._verified(sync, into)
        self._applying = None
        self.fetch_model(into)
        return None

    def _receive(self, body, round_: int, into: Into) -> Message | None:
        """Read round ``round_``'s sync from ``body``, applying each piece as soon as it is in and checked; the
        sync once whole, or None when it is not this host's to apply (another base or round)."""
        tensors = self.tensors
        applied = []  # (start, end) of each piece's apply
        with self.phases.timed(round_, P.DOWNLOAD) as rec:
            try:
                buffer = tensors.sync_buffer(body.size)
                view = memoryview(buffer.numpy())
                prefix = safetensors.PREFIX_BYTES
                read_fully(body, view[:prefix])
                head_end = prefix + safetensors.header_length(bytes(view[:prefix]), body.size, "sync")
                read_fully(body, view[prefix:head_end])
                sync = Message.read_head(bytes(view[:head_end]), buffer, total=body.size)
                tensors.sync_part(sync)  # its tensors are this model's
                if sync.meta.base_hash != self.model_hash or sync.meta.round != round_:
                    return None
                applying = self._applying
                if applying is None:
                    applying = self._applying = tensors.apply_begin(sync, into is Into.LIVE)
                applying.sync = sync  # asked again: the same sync, read again
                at = head_end
                for k in range(len(sync.layout.pieces)):
                    end = sync.wire_end(k)
                    read_fully(body, view[at:end])
                    at = end
                    if k < applying.applied:
                        continue
                    sync.check_piece(k)
                    start = time.time()
                    tensors.apply_piece(applying, k)
                    applied.append((start, time.time()))
                read_fully(body, view[at:])
                sync.read_trailer()
            finally:
                body.close()
                rec.bytes = body.size
        if applied:
            self.phases.emit(PhaseRecord(round_, self.phases.host, P.APPLY, applied[0][0], applied[-1][1],
                                         extra={"seconds": round(sum(e - s for s, e in applied), 6)}))
        return sync

    def _verified(self, sync: Message, into: Into) -> RoundResult:
        """The applied sync's model hash, checked against the coordinator's (a mismatch: the model is fetched)."""
        round_ = sync.meta.round
        with self.phases.timed(round_, P.VERIFY):
            got = self.tensors.digest(self.tensors.apply_end(self._applying))
        self._applying = None
        self.round = round_ + 1
        if got != sync.meta.model_hash:
            self.log.warning("host %s: model hash %s after round %d differs from the coordinator's %s; "
                             "fetching the model", self.host, got, round_, sync.meta.model_hash)
            self.fetch_model(into)
            return RoundResult(round_, self.model_hash, self.complete, False)
        self.model_hash = got
        return RoundResult(round_, got, self.complete, True, sync.meta.metrics)

    # -- the full model ------------------------------------------------------------------------------------------------
    def fetch_model(self, into: Into = Into.LIVE) -> None:
        """Replace this host's model with the coordinator's (the fallback when a sync cannot be applied),
        streamed straight into the live model (then θ_r := it) or into base only; a download that breaks off is
        asked for again."""
        tensors = self.tensors
        target = tensors.live if into is Into.LIVE else tensors.base
        with self.phases.timed(self.round, P.FALLBACK_FETCH) as rec:
            for attempt in range(1, DOWNLOAD_TRIES + 1):
                body = self._call(self.client.get_model, into=into)
                rec.bytes = body.size
                try:
                    round_, remote_hash = tensors.read_model(body, target)
                    break
                except ModelMismatchError:
                    raise
                except (TransferBroken, PayloadError) as e:
                    if attempt == DOWNLOAD_TRIES:
                        raise
                    self.log.warning("host %s: model download failed (%s); retrying", self.host, e)
            tensors.after_fetch(into is Into.LIVE)
            got = tensors.base_hash()  # base holds the fetched model now, in either case
            if got != remote_hash:
                raise RuntimeError(f"the fetched model hashes to {got}, not the coordinator's {remote_hash}")
            self.round, self.model_hash = round_, got
        self.log.info("host %s fetched the model of round %d (%s)", self.host, round_, got)

    def close(self) -> None:
        self.tensors.close()


class _Uploading:
    """A host's upload of its delta on a thread of its own (:meth:`HostRound.upload`), while the host waits for
    the round's sync."""

    def __init__(self, host: HostRound, reader: MessageReader, into: Into) -> None:
        self._result: Upload | None = None
        self._error: BaseException | None = None

        def run() -> None:
            try:
                self._result = host.upload(reader, into=into)
            except BaseException as e:  # noqa: BLE001 - raised by outcome()
                self._error = e

        self._thread = threading.Thread(target=run, name="nodeox-upload", daemon=True)
        self._thread.start()

    def running(self) -> bool:
        return self._thread.is_alive()

    def outcome(self) -> Upload:
        """The upload's outcome once it has ended (its error raised)."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._result
