"""What a host's client must offer, whatever carries its calls (HTTP, an in-process coordinator, a relay's
upstream), and what a refusal means for a host: written once here, so every client maps them alike.

A client raises :class:`~lightning_nodeox.core.protocol.Refusal` for a refused call and turns the refusals that
are outcomes into values with :func:`delta_outcome` and :func:`sync_outcome`: a duplicate delta was taken, a late
or stale one is an :class:`~lightning_nodeox.core.protocol.Upload` outcome, a sync that was replaced is
:class:`~lightning_nodeox.core.protocol.SyncGone`; every other refusal stays an error.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol, runtime_checkable

from .ledger_terms import LeaseReply
from .protocol import ByteStream, DataSpec, JoinReply, Reason, Refusal, SyncGone, SyncReply, Upload, ValuesReply

log = logging.getLogger(__name__)

UPLOAD_OUTCOMES = {Reason.DUPLICATE: Upload.TAKEN, Reason.LATE: Upload.LATE, Reason.STALE_BASE: Upload.STALE_BASE,
                   Reason.LEASE_VOID: Upload.LEASE_VOID}


def delta_outcome(send: Callable[[], object], host: str, round_: int) -> Upload:
    """Run ``send`` (one delta upload) and say what became of the delta; refusals other than those in
    :data:`UPLOAD_OUTCOMES` are raised."""
    try:
        send()
    except Refusal as e:
        outcome = UPLOAD_OUTCOMES.get(e.reason)
        if outcome is None:
            raise
        if outcome is not Upload.TAKEN:
            log.warning("nodeox: host %s: delta of round %d not taken: %s", host, round_, str(e))  # text: not its frames
        return outcome
    return Upload.TAKEN


def sync_outcome(ask: Callable[[], SyncReply | None]) -> SyncReply | None:
    """Run ``ask`` (one wait for a sync: a reply, or None when not ready yet); a sync that was replaced
    (``GONE``) is :class:`SyncGone`, other refusals are raised."""
    try:
        return ask()
    except Refusal as e:
        if e.reason is Reason.GONE:
            return SyncGone()
        raise


class Clock(Protocol):
    """The coordinator's clock minus this host's, in seconds (0 when they share one)."""

    @property
    def offset(self) -> float: ...


@runtime_checkable
class HostClient(Protocol):
    """A host's calls to its coordinator. Every call but :meth:`leave`, :meth:`heartbeat` and :meth:`post_events`
    gives up (:class:`~lightning_nodeox.core.protocol.Cancelled`) once :meth:`cancel` was called."""

    url: str  # where the coordinator is, for messages
    host: str  # the host this client acts for
    clock: Clock  # aligns the host's phase records to the coordinator's clock
    credential: str  # this host's, from its last join ("" before one)
    data: DataSpec | None  # declared with every join: the coordinator's data ledger shares out its epochs

    @property
    def joined(self) -> bool:
        """Whether a join has answered (the calls on the host's behalf can be made)."""
        ...

    def join(self, tensors: list, *, model_hash: str | None = None, round_: int | None = None) -> JoinReply:
        """Join the run (again: saying which model and round this host holds)."""
        ...

    def put_model(self, body) -> str:
        """Provide the model (a reader with ``read``); returns the coordinator's hash of it."""
        ...

    def post_delta(self, round_: int, body, *, training: bool = False) -> Upload:
        """Send round ``round_``'s delta (see :func:`delta_outcome`): a whole message (a memoryview), or a reader
        of one being made (:class:`~lightning_nodeox.core.streaming.MessageReader`: ``read``, ``len``,
        ``rewind``)."""
        ...

    def wait_sync(self, round_: int, *, training: Callable[[], bool] | None = None) -> SyncReply:
        """Wait until round ``round_``'s sync is ready, the run completed, or the sync is gone. ``training`` (asked
        at each poll; :meth:`post_delta`'s a bool): whether this host's training goes on meanwhile (its round
        overlaps), so the coordinator waits for its values (:mod:`lightning_nodeox.coordinator.values`)."""
        ...

    def poll_sync(self, round_: int, poll: float = ..., *, training: bool = False,
                  sending: bool = False) -> SyncReply | None:
        """One wait for round ``round_``'s sync (None: not ready yet); ``sending``: this host's delta of the round
        is still on its way, so the coordinator does not refuse the poll for want of it."""
        ...

    def lease(self, epoch: int | None, units: int = 1) -> LeaseReply:
        """Up to ``units`` units of ledger epoch ``epoch`` (None: the ledger's current one) for this host, which
        declared its :attr:`data` at join: a ``Lease``, ``Wait`` or ``EpochEnd`` (:mod:`~.ledger_terms`)."""
        ...

    def get_model(self) -> ByteStream:
        """The coordinator's full model, as a model file."""
        ...

    def exchange_values(self, key: str, payload: object) -> ValuesReply:
        """Post this host's ``payload`` (JSON) under ``key`` and wait until the key is answered
        (:mod:`lightning_nodeox.coordinator.values`); posting again is harmless."""
        ...

    def post_events(self, records: list[dict], *, retry_for: float = 0.0) -> None:
        """Phase records of this host."""
        ...

    def heartbeat(self) -> float:
        """This host is alive (one try); returns the lease in seconds."""
        ...

    def status(self) -> dict:
        """The coordinator's run at a glance (its round, codec, hosts: ``GET /v1/status``)."""
        ...

    def leave(self) -> None:
        """This host takes no further part (whatever the cancel state)."""
        ...

    def cancel(self) -> None:
        """Make the calls in progress give up at their next poll."""
        ...
