"""A host's side of a round, outside Lightning: encode, upload, wait, download, apply, verify, and the rules
that recover from what can go wrong on the way. :class:`HostRound` composes the parts, which share the host's
:class:`~lightning_nodeox.host.standing.Standing` (its round and model hash):
- joining the run and the rules that keep this host's model the run's (:mod:`~lightning_nodeox.host.joining`);
- the delta's upload and the rules for its outcomes (:mod:`~lightning_nodeox.host.uploads`);
- the sync's download, apply and verification, and their rules (:mod:`~lightning_nodeox.host.downloads`).

The rules of a round as a whole:
- a host whose last round was late still sends an empty final delta, so the coordinator knows it finished;
- a host that learns the run completed before its round closed (another host's training ended while its
  delta was on the way) drops the local work no round took: it ends on the run's final model, like every host.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from ..core.ledger_terms import Covered, LeaseReply
from ..core.logs import Named
from ..core.phases import PhaseLog
from ..core.protocol import Upload, ValuesReply
from ..core.streaming import MessageReader
from ..core.transport import HostClient
from .downloads import Downloads
from .joining import Joining
from .standing import Into, RoundResult, Standing
from .tensors import HostTensors
from .uploads import Uploading, Uploads

log = logging.getLogger(__name__)


class HostRound:
    """One host's place in the run: its round, its model's hash, and the steps of a round."""

    def __init__(self, tensors: HostTensors, client: HostClient, phases: PhaseLog, *, rounding: str = "nearest",
                 error_feedback: bool = True, codec_threads: int = 1, name: str = "nodeox") -> None:
        self.standing = Standing(tensors, client, phases, Named(log, name))
        self.joining = Joining(self.standing, rounding=rounding, error_feedback=error_feedback,
                               codec_threads=codec_threads)
        self.uploads = Uploads(self.standing, self.joining, rounding=rounding)
        self.downloads = Downloads(self.standing, self.joining, self.uploads)

    # -- the standing, shared by the parts ---------------------------------------------------------------------
    @property
    def host(self) -> str:
        return self.standing.host

    @property
    def tensors(self) -> HostTensors:
        return self.standing.tensors

    @property
    def client(self) -> HostClient:
        return self.standing.client

    @property
    def phases(self) -> PhaseLog:
        return self.standing.phases

    @property
    def round(self) -> int:
        return self.standing.round

    @round.setter
    def round(self, value: int) -> None:
        self.standing.round = value

    @property
    def model_hash(self) -> str:
        return self.standing.model_hash

    @model_hash.setter
    def model_hash(self, value: str) -> None:
        self.standing.model_hash = value

    @property
    def complete(self) -> bool:
        return self.standing.complete

    @complete.setter
    def complete(self, value: bool) -> None:
        self.standing.complete = value

    @property
    def trains_on(self) -> bool:
        """Training goes on while the round overlapped is open (set by the training side)."""
        return self.standing.trains_on

    @trains_on.setter
    def trains_on(self, value: bool) -> None:
        self.standing.trains_on = value

    # -- joining ------------------------------------------------------------------------------------------------
    def join(self) -> None:
        """Join the run and agree on the starting model (:meth:`Joining.join`)."""
        self.joining.join()

    def rejoin(self, into: Into = Into.LIVE, *, fetch: bool = True) -> None:
        """Join again, keeping this host's model and round (:meth:`Joining.rejoin`)."""
        self.joining.rejoin(into, fetch=fetch)

    def exchange_values(self, key: str, payload: object, *, retry_for: float,
                        joins: Callable[[], bool]) -> ValuesReply:
        """Values under ``key`` with the other hosts (:meth:`Joining.exchange_values`)."""
        return self.joining.exchange_values(key, payload, retry_for=retry_for, joins=joins)

    def fetch_model(self, into: Into = Into.LIVE) -> None:
        """Replace this host's model with the coordinator's (:meth:`Joining.fetch_model`)."""
        self.joining.fetch_model(into)

    def lease(self, epoch: int | None, units: int = 1) -> LeaseReply:
        """Units of the data ledger, joining again if the coordinator restarted (:meth:`Joining.lease`)."""
        return self.joining.lease(epoch, units)

    # -- a round --------------------------------------------------------------------------------------------------
    def run_round(self, samples: int, final: bool, metrics: dict[str, list] | None = None,
                  covered: Covered | None = None) -> RoundResult:
        """One whole exchange while training waits: encode, upload, then sync (following later rounds if this
        is the final one). ``metrics``: this host's latest sync_dist values, ``{name: [value, reduction]}``;
        ``covered``: the data the round trained, for the coordinator's data ledger (the result's ``lease_void``
        says when that lease is void)."""
        self.tensors.boundary(self.round, final=final)
        message = self.encode(self.tensors.live, self.uploads.weight(samples), final, metrics, covered)
        return self.finish_round(message, final, Into.LIVE)

    def run_overlapped(self, samples: int, delayed: bool, metrics: dict[str, list] | None = None,
                       covered: Covered | None = None) -> RoundResult:
        """One exchange while training goes on: the delta is the snapshot's, and the sync goes into ``base``
        only; the training side folds it into the live model (:meth:`HostTensors.fold`)."""
        reader = self.encode(self.tensors.snapshot, self.uploads.weight(samples), False, metrics, covered)
        if delayed:
            reader.join()  # the snapshot becomes θ_r only once the delta is encoded from it
            self.tensors.snapshot_base()
        return self.finish_round(reader, False, Into.BASE)

    def finish_round(self, reader: MessageReader, final: bool, into: Into) -> RoundResult:
        """Upload a delta as it is encoded and take the round's sync (see :meth:`run_round`), which starts to
        arrive while the upload still goes on (:meth:`Downloads.while_uploading`); sending it again after a
        failure is harmless (a delta taken already is ``TAKEN``)."""
        self.uploads.final = final
        self.uploads.lease_void = False
        uploading = Uploading(self.uploads, reader, into)
        early = self.downloads.while_uploading(uploading, into)
        outcome = uploading.outcome()
        if early is not None:
            result = early
            if final and outcome is not Upload.LATE and not result.complete:
                result = self.synchronize(follow_to_end=True, into=into)
            elif not result.complete:  # its delta may have been late: merged into a later round
                result = self.downloads.catch_up(result, into)
        else:
            result = self.synchronize(follow_to_end=final and outcome is not Upload.LATE, into=into)
        if final and outcome is Upload.LATE and not self.complete:
            self.uploads.send_empty(final=True, into=into)  # so the coordinator knows this host has finished
            result = self.synchronize(follow_to_end=True, into=into)
        result.contributed = outcome is Upload.TAKEN and result.contributed
        result.lease_void = self.uploads.lease_void
        return result

    def encode(self, source, samples: int, final: bool, metrics: dict[str, list] | None = None,
               covered: Covered | None = None) -> MessageReader:
        """Start encoding this round's delta (:meth:`Uploads.encode`)."""
        return self.uploads.encode(source, samples, final, metrics, covered)

    def upload(self, reader: MessageReader, *, into: Into = Into.LIVE) -> Upload:
        """Send the delta (each piece as it is encoded) and act on the outcome (:meth:`Uploads.upload`)."""
        return self.uploads.upload(reader, into=into)

    def synchronize(self, *, follow_to_end: bool = False, into: Into = Into.LIVE) -> RoundResult:
        """Wait for the round's sync and apply it (:meth:`Downloads.synchronize`)."""
        return self.downloads.synchronize(follow_to_end=follow_to_end, into=into)

    def download(self, into: Into = Into.LIVE) -> RoundResult | None:
        """Round ``round``'s sync, applied as it arrives and verified (:meth:`Downloads.download`)."""
        return self.downloads.download(into)

    def close(self) -> None:
        self.tensors.close()
