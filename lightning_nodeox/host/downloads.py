"""A round's sync, applied as it arrives and verified, and the rules that recover when it cannot be (never HTTP):
- a sync that is gone (``SyncGone``), that cannot be parsed, or that does not fit this host's model makes the
  host fetch the full model; so does a model hash that differs after applying a sync;
- a download that breaks off is asked for again (``DOWNLOAD_TRIES``), skipping the pieces already applied; one
  that fails after pieces were applied leaves the model half-changed (``Standing.base_changed``): the host fetches
  the model, and never gives such a base back to a restarted coordinator;
- a coordinator that lost this host's delta (``NO_DELTA``: it restarted) gets it again (:meth:`Uploads.resend`);
- a run that completed with no later sync leaves this host on its base, the run's final model;
- a host whose delta was merged into a later round than its own (``--merge async``: it was late) applies, in order,
  every sync before that round's (each reply says which round holds its delta: ``SyncReady.held``) and trains on
  from there without waiting for that round to close: its next delta goes into a later round again.
"""

from __future__ import annotations

import time

from ..core import phases as P
from ..core import safetensors
from ..core.phases import PhaseRecord
from ..core.protocol import Reason, Refusal, RunComplete, SyncGone, SyncReady, TransferBroken, read_fully
from ..core.specs import PayloadError
from ..core.wire import Message
from .applying import Applying
from .joining import DOWNLOAD_TRIES, Joining
from .standing import Into, RoundResult, Standing
from .uploads import Uploading, Uploads

UPLOAD_POLL = 1.0  # seconds a sync poll lasts while the host's own upload goes on


class Downloads:
    """Takes ``standing``'s round's sync: waits for it, applies it piece by piece, verifies the model hash."""

    def __init__(self, standing: Standing, joining: Joining, uploads: Uploads) -> None:
        self.standing = standing
        self.joining = joining
        self.uploads = uploads
        self._applying: Applying | None = None  # the sync being applied, across retries of its download
        self.held: int | None = None  # the round whose sync carries this host's delta, as the last reply said

    def behind(self) -> bool:
        """Whether syncs before the one carrying this host's delta are still to apply (its delta was late, merged
        into a later round)."""
        return self.held is not None and self.standing.round < self.held

    def synchronize(self, *, follow_to_end: bool = False, into: Into = Into.LIVE) -> RoundResult:
        """Wait for the round's sync, apply it ``into`` the live model or base as it arrives and verify the model
        hash (fetching the model if needed). With ``follow_to_end`` keep applying later rounds' syncs until the
        run completes."""
        while True:
            result = self.next_sync(into)
            if result.complete or not follow_to_end:
                return self.catch_up(result, into)

    def next_sync(self, into: Into) -> RoundResult:
        """The open round's sync applied (:meth:`download`), or where this host stands when there is none."""
        s = self.standing
        round_ = s.round
        return self.download(into) or RoundResult(round_, s.model_hash, s.complete, False)

    def catch_up(self, result: RoundResult, into: Into) -> RoundResult:
        """After ``result``: while this host's late delta is held in a later round, apply the syncs before that
        round's, and that round's too if its close has begun (:meth:`held_sync`), never waiting for it."""
        while self.behind() and not result.complete:
            result = self.next_sync(into)
        if not result.complete and self.held is not None and self.held == self.standing.round:
            result = self.held_sync(into) or result
        return result

    def download(self, into: Into = Into.LIVE) -> RoundResult | None:
        """Round ``round``'s sync, applied piece by piece as it arrives and verified; None when there is none
        to apply (the run completed, or the host fetched the model ``into`` the live model or base instead).
        Training waits for it (``WAIT``) unless it goes into base (``POLL``: training overlaps)."""
        s = self.standing
        round_ = s.round
        self.held = None
        if self._applying is not None and self._applying.sync.meta.round != round_:
            self._applying = None  # (one of this round, half applied while uploading, is resumed)
        for attempt in range(1, DOWNLOAD_TRIES + 1):
            try:
                with s.phases.timed(round_, P.WAIT if into is Into.LIVE else P.POLL):
                    reply = self.joining.call(s.client.wait_sync, round_, into=into,
                                              training=lambda: s.training(into))
            except Refusal as e:
                if e.reason is Reason.NOT_OPEN:  # the coordinator is at an earlier round (restarted from older state)
                    s.log.warning("host %s: %s; fetching its model", s.host, e)
                    break
                if e.reason is not Reason.NO_DELTA or attempt == DOWNLOAD_TRIES:
                    raise
                if s.base_changed:  # the restarted coordinator's sync may differ: the half-applied one is lost
                    s.log.warning("host %s: %s, and its sync was half applied here; fetching the model", s.host, e)
                    break
                s.log.warning("host %s: %s", s.host, e)
                self.uploads.resend(into)
                if s.round != round_:  # the host fetched a model of another round meanwhile
                    return None
                continue
            if isinstance(reply, RunComplete):  # no later sync: this host's base is the run's final model
                s.complete = True
                if into is Into.LIVE:  # (overlapped, the training side does it between two steps)
                    s.tensors.restore_live()
                return None
            if isinstance(reply, SyncGone):
                break
            s.complete, self.held = reply.complete, reply.held
            try:
                sync = self._receive(reply.body, round_, into)
            except TransferBroken as e:
                s.base_changed = bool(self._applying is not None and self._applying.applied)
                if attempt < DOWNLOAD_TRIES:
                    s.log.warning("host %s: sync download of round %d failed (%s); retrying", s.host, round_, e)
                    continue
                if self._applying is not None and self._applying.applied:
                    break  # half applied: the model is fetched
                raise
            except PayloadError as e:
                s.log.warning("host %s: sync of round %d unusable (%s); fetching the model", s.host, round_, e)
                break
            if sync is None:
                break
            return self.verified(sync, into)
        self._applying = None
        self.joining.fetch_model(into)
        return None

    def held_sync(self, into: Into) -> RoundResult | None:
        """The sync of the round holding this host's late delta, if that round's close has begun already (its last
        round, say, whose sync tells it the run is complete); None when it has not: the host trains on without it."""
        s = self.standing
        round_ = s.round
        try:
            reply = s.client.poll_sync(round_, 0.0, training=s.training(into))
            if not isinstance(reply, SyncReady):
                return None
            s.complete, self.held = reply.complete, reply.held
            sync = self._receive(reply.body, round_, into)
        except (Refusal, TransferBroken, PayloadError):  # the normal course takes it up later
            return None
        return self.verified(sync, into) if sync is not None else None

    def while_uploading(self, uploading: Uploading, into: Into) -> RoundResult | None:
        """While this host's delta is still on its way, wait for the round's sync and apply it as it comes (the
        link carries the delta's last pieces one way and the sync's first the other); None when it is not
        ready before the upload ends, or anything is not plain (the round's normal course then takes over:
        :meth:`synchronize`, which resumes a sync half applied here)."""
        s = self.standing
        round_, start = s.round, time.time()
        while uploading.running():
            try:
                reply = s.client.poll_sync(round_, UPLOAD_POLL, training=s.training(into), sending=True)
            except Exception:  # noqa: BLE001 - the normal course says what is wrong
                return None
            if reply is None:
                continue
            if not isinstance(reply, SyncReady):
                return None
            s.phases.emit(PhaseRecord(round_, s.phases.host, P.WAIT if into is Into.LIVE else P.POLL, start,
                                      time.time(), extra={"uploading": True}))
            s.complete, self.held = reply.complete, reply.held
            try:
                sync = self._receive(reply.body, round_, into)
            except (TransferBroken, PayloadError):
                return None
            if sync is None:
                return None
            return self.verified(sync, into)
        return None

    def _receive(self, body, round_: int, into: Into) -> Message | None:
        """Read round ``round_``'s sync from ``body``, applying each piece as soon as it is in and checked; the
        sync once whole, or None when it is not this host's to apply (another base or round)."""
        s = self.standing
        applied: list[tuple[float, float]] = []  # (start, end) of each piece's apply
        with s.phases.timed(round_, P.DOWNLOAD) as rec:
            try:
                buffer = s.tensors.sync_buffer(body.size)
                view = memoryview(buffer.numpy())
                sync, head_end = self._read_head(body, view, buffer)
                if sync.meta.base_hash != s.model_hash or sync.meta.round != round_:
                    return None
                if self._applying is None:
                    self._applying = s.tensors.apply_begin(sync, into is Into.LIVE)
                self._applying.sync = sync  # asked again: the same sync, read again
                self._read_pieces(body, view, head_end, sync, applied)
            finally:
                body.close()
                rec.bytes = body.size
        if applied:
            s.phases.emit(PhaseRecord(round_, s.phases.host, P.APPLY, applied[0][0], applied[-1][1],
                                      extra={"seconds": round(sum(e - b for b, e in applied), 6)}))
        return sync

    def _read_head(self, body, view: memoryview, buffer) -> tuple[Message, int]:
        """A sync's header, read from ``body``, and where it ends; a PayloadError when its tensors are not this
        model's."""
        prefix = safetensors.PREFIX_BYTES
        read_fully(body, view[:prefix])
        head_end = prefix + safetensors.header_length(bytes(view[:prefix]), body.size, "sync")
        read_fully(body, view[prefix:head_end])
        sync = Message.read_head(bytes(view[:head_end]), buffer, total=body.size)
        self.standing.tensors.sync_part(sync)  # its tensors are this model's
        return sync, head_end

    def _read_pieces(self, body, view: memoryview, at: int, sync: Message,
                     applied: list[tuple[float, float]]) -> None:
        """The rest of ``sync`` from ``body`` (from ``at`` on): each piece applied once in and checked (those
        applied before a retry skipped), then its trailer."""
        applying = self._applying
        for k in range(len(sync.layout.pieces)):
            end = sync.wire_end(k)
            read_fully(body, view[at:end])
            at = end
            if k < applying.applied:
                continue
            sync.check_piece(k)
            start = time.time()
            self.standing.tensors.apply_piece(applying, k)
            applied.append((start, time.time()))
        read_fully(body, view[at:])
        sync.read_trailer()

    def verified(self, sync: Message, into: Into) -> RoundResult:
        """The applied sync's model hash, checked against the coordinator's (a mismatch: the model is fetched)."""
        s = self.standing
        round_ = sync.meta.round
        with s.phases.timed(round_, P.VERIFY):
            got = s.tensors.digest(s.tensors.apply_end(self._applying))
        self._applying = None
        s.round, s.base_changed = round_ + 1, False
        if got != sync.meta.model_hash:
            s.log.warning("host %s: model hash %s after round %d differs from the coordinator's %s; "
                          "fetching the model", s.host, got, round_, sync.meta.model_hash)
            self.joining.fetch_model(into)
            return RoundResult(round_, s.model_hash, s.complete, False)
        s.model_hash = got
        return RoundResult(round_, got, s.complete, True, sync.meta.metrics)
