"""A host's delta on its way to the coordinator, and the rules for each outcome of its upload (never HTTP):
- ``TAKEN``: it is part of the round;
- ``LATE``: it arrived after its round closed and is dropped; the round's sync is applied as usual;
- ``STALE_BASE``: it was computed against another model, so this host missed a sync: it fetches the model and
  takes part in the current round with an empty delta;
- ``LEASE_VOID``: it reported data (its ``covered``) under a data lease the coordinator voided: its training is
  not taken, and the host takes part in the round with an empty delta (as after ``STALE_BASE``). Every outcome but ``TAKEN`` voids the host's data lease (:attr:`Uploads.lease_void` says so
  until the round's result takes it: the host drops its spans and leases again);
- a coordinator that holds no delta of this host for the round it waits on (``NO_DELTA``: it restarted) gets
  the round's delta again (still in its buffer), or an empty one if there is none to resend (:meth:`Uploads.resend`).
"""

from __future__ import annotations

import threading
import time
from collections import deque

from ..core import phases as P
from ..core.phases import PhaseRecord
from ..core.protocol import Upload
from ..core.streaming import MessageReader
from ..core.ledger_terms import Covered
from ..core.wire import Message, MessageMeta, covered_room, fit_metrics
from .joining import Joining
from .standing import Into, Standing


class Uploads:
    """Encodes and uploads ``standing``'s deltas, keeping the last one sent (resent if the coordinator lost it)."""

    def __init__(self, standing: Standing, joining: Joining, *, rounding: str) -> None:
        self.standing = standing
        self.joining = joining
        self.rounding = rounding
        self.final = False  # this host has sent (or is sending) its final delta
        self._sent: Message | None = None  # the last delta uploaded
        self._seed = int.from_bytes(standing.host.encode()[:8].ljust(8, b"\0"), "little")
        self._trained: deque[int] = deque()  # the samples of the last rounds, one per fragment
        self.lease_void = False  # a delta of this round was not taken: the coordinator voided the data lease

    def weight(self, samples: int) -> int:
        """A delta's samples from the ``samples`` trained in the round closing now: with fragments, what the round's
        fragment trained since its own last sync (the samples of the last rounds, one per fragment)."""
        self._trained.append(samples)
        while len(self._trained) > self.standing.tensors.fragment_count:
            self._trained.popleft()
        return sum(self._trained)

    def encode(self, source, samples: int, final: bool, metrics: dict[str, list] | None = None,
               covered: Covered | None = None) -> MessageReader:
        """Start encoding this round's delta, piece by piece (:meth:`HostTensors.encode`); its upload sends each
        piece as it is sealed. ``covered``: the data it trained (a host leasing its data), in its metadata."""
        s = self.standing
        if covered is not None and metrics:  # they share the header's room
            metrics, dropped = fit_metrics(metrics, covered_room(covered))
            if dropped:
                s.log.warning("host %s: no room beside the delta's covered data for metrics %s", s.host, dropped)
        tensors = s.tensors
        error = tensors.estimate_error(source) if samples > 0 else None
        seed = None if self.rounding == "nearest" else hash((self._seed, s.round)) & (2**62 - 1)
        start = time.time()
        reader = tensors.encode(source, MessageMeta("delta", s.round, s.host, s.model_hash, samples=samples,
                                                    final=final, metrics=metrics or {}, covered=covered), seed)
        reader.record = PhaseRecord(s.round, s.phases.host, P.ENCODE, start, start, len(reader),
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
                self.standing.phases.emit(record)
                reader.record = None
        return reader.message

    def upload(self, reader: MessageReader, *, into: Into = Into.LIVE) -> Upload:
        """Send the delta (each piece as it is encoded). ``TAKEN``; ``LATE``: the round closed without it (or
        without part of it), but its sync can be applied; or ``STALE_BASE``, after which this host has fetched the
        model (``into``) and taken part in the current round anew (with an empty delta); ``LEASE_VOID``: refused
        for its data (see the module's rules), the host took part with an empty delta. Unless taken, this round's
        local work is dropped."""
        s = self.standing
        message = reader.message
        self._sent = message
        try:
            with s.phases.timed(s.round, P.UPLOAD) as rec:
                rec.bytes = len(message)
                outcome = self.joining.call(s.client.post_delta, s.round, reader, into=into,
                                            training=s.training(into))
                if outcome is not Upload.TAKEN:
                    rec.extra["rejected"] = outcome.value
                    self.lease_void = True
        finally:
            self._encoded(reader)
        if outcome is Upload.STALE_BASE:
            self.joining.fetch_model(into)
        if outcome in (Upload.STALE_BASE, Upload.LEASE_VOID):
            self.send_empty(message.meta.final, into=into)
        return outcome

    def send_empty(self, final: bool, *, into: Into) -> None:
        """Take part in the current round without a contribution (no samples: it adds nothing), with the round's
        fragment: the tensors the others send."""
        s = self.standing
        s.tensors.take_part(s.round)
        with s.phases.timed(s.round, P.UPLOAD, empty=True) as rec:
            reader = s.tensors.encode(s.tensors.base, MessageMeta("delta", s.round, s.host, s.model_hash,
                                                                  samples=0, final=final), None)
            rec.bytes = len(reader)
            self._sent = reader.message
            try:
                self.joining.call(s.client.post_delta, s.round, reader, into=into, training=s.training(into))
            finally:
                reader.join()

    def resend(self, into: Into) -> None:
        """The coordinator lost this host's delta of the current round (it restarted): send it again."""
        s = self.standing
        sent = self._sent
        if sent is None or sent.meta.round != s.round or sent.meta.base_hash != s.model_hash:
            self.send_empty(self.final, into=into)
            return
        with s.phases.timed(s.round, P.UPLOAD, resent=True) as rec:
            rec.bytes = len(sent)
            outcome = self.joining.call(s.client.post_delta, s.round, sent.view(), into=into,
                                        training=s.training(into))
        self.lease_void = self.lease_void or outcome is not Upload.TAKEN
        if outcome is Upload.STALE_BASE:
            self.joining.fetch_model(into)
        if outcome in (Upload.STALE_BASE, Upload.LEASE_VOID):
            self.send_empty(self.final, into=into)


class Uploading:
    """An upload of a delta on a thread of its own (:meth:`Uploads.upload`), while the host waits for the round's
    sync."""

    def __init__(self, uploads: Uploads, reader: MessageReader, into: Into) -> None:
        self._result: Upload | None = None
        self._error: BaseException | None = None

        def run() -> None:
            try:
                self._result = uploads.upload(reader, into=into)
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
