"""The run's data ledger (:class:`~lightning_nodeox.coordinator.ledger.DataLedger`) as the rest of the coordinator
uses it, in protocol terms: the rules of docs/ledger.md ("the wiring's contract") written once here.

- A host that declares its data at join (:class:`~lightning_nodeox.core.protocol.DataSpec`) makes the run have a
  ledger (the first such join, with the coordinator's ``--data-unit``); a later join declaring another dataset
  (length, seed or shuffle) is refused naming both. Hosts that declare nothing never touch it.
- :meth:`RunData.lease`: a host's lease call (a retry of one answered already: the same answer); :meth:`RunData.covered`: a delta's ``covered`` noted before the
  delta is taken into its round (bad input: ``INVALID``; a void lease: ``LEASE_VOID``).
- :meth:`RunData.refused` for every delta the round will not take (refused, cut, late), :meth:`RunData.gone` for
  a host that left or whose lease expired: its uncommitted units go back. :meth:`RunData.withdraw` for a delta
  that is as if never sent (broken off before any piece was taken): its host may send it again.
- :meth:`RunData.publish` with the ``(host, round)`` of the deltas a published round took.
- :meth:`RunData.saved` / :meth:`RunData.restore`: the ledger in the round's saved state (``run.json``'s
  ``data``), restored with every lease void. :meth:`RunData.ahead`: the ledger as it will be after a round's
  publish, written before its sync goes out (:meth:`~lightning_nodeox.coordinator.recovery.Recovery.save_ahead`).

A ledger error at publish never stops a round: it is logged, and the ledger is left as it was.
"""

from __future__ import annotations

import logging

from ..core.ledger_order import DataOrder
from ..core.ledger_terms import Covered, LeaseReply, LeaseVoid
from ..core.logs import Named
from ..core.protocol import DataSpec, Reason, Refusal
from .ledger import DataLedger

log = logging.getLogger(__name__)


class RunData:
    """The run's data ledger, if a host declared its data (None until then)."""

    def __init__(self, unit_size: int, name: str) -> None:
        self.unit_size = unit_size
        self.ledger: DataLedger | None = None
        self._answered: dict[str, tuple[int, LeaseReply]] = {}  # host -> its last lease call's (seq, reply)
        self._departing: set[str] = set()  # gone while the open round holds a delta of theirs: void at its publish
        self.log = Named(log, name)

    def declare(self, host: str, spec: DataSpec) -> None:
        """A joining host's data: the run's ledger is made for it (the first), or it must be the run's."""
        ledger = self.ledger
        if ledger is None:
            self.ledger = DataLedger(DataOrder(spec.samples, spec.seed, spec.shuffle), unit_size=self.unit_size)
            self.log.info("data ledger: %d samples in units of %d (seed %d, %s), declared by host %s", spec.samples,
                          self.unit_size, spec.seed, "shuffled" if spec.shuffle else "in order", host)
            return
        check_same_data(host, spec, ledger.order)

    def _ledger(self, host: str) -> DataLedger:
        if self.ledger is None:
            raise Refusal(Reason.INVALID, f"host {host} asks for data but no host declared its data at join: join "
                                          'with "data": {"samples": N, "seed": S, "shuffle": true|false}')
        return self.ledger

    def lease(self, host: str, epoch: int | None, units: int = 1, seq: int | None = None) -> LeaseReply:
        """A host's lease call; ``seq`` (the call's number, the same on a retry): a call answered already gets
        the same answer again (a retried call whose reply was lost leases nothing more)."""
        ledger = self._ledger(host)
        last = self._answered.get(host)
        if seq is not None and last is not None and last[0] == seq:
            return last[1]
        try:
            reply = ledger.lease(host, units, epoch=epoch)
        except ValueError as e:
            raise Refusal(Reason.INVALID, str(e)) from None
        if seq is not None:
            self._answered[host] = (seq, reply)
        return reply

    async def lease_call(self, host: str, epoch: int | None, units: int = 1, seq: int | None = None) -> LeaseReply:
        """A host's lease call as the service makes it (:meth:`lease`; a site relay's may ask upstream first)."""
        return self.lease(host, epoch, units, seq)

    def covered(self, host: str, round_: int, report: Covered) -> None:
        """Note what ``host``'s delta of round ``round_`` trained, before the delta is taken."""
        try:
            self._ledger(host).covered(host, report, delta=round_)
        except LeaseVoid as e:
            raise Refusal(Reason.LEASE_VOID, f"delta rejected: {e} (drop the spans held; their training is not "
                                             "taken)") from None
        except ValueError as e:
            raise Refusal(Reason.INVALID, f"delta rejected: {e}") from None

    def refused(self, host: str) -> None:
        """A delta of ``host`` will not be taken (refused, cut or late): its lease is void, its units go back."""
        self._answered.pop(host, None)
        if self.ledger is not None:
            self.ledger.refused(host)

    def withdraw(self, host: str, round_: int) -> None:
        """``host``'s delta of round ``round_`` is as if never sent (it broke off before any of it was taken): its
        report is forgotten, so the host may send it again."""
        if self.ledger is not None:
            self.ledger.withdraw(host, round_)

    def gone(self, host: str, *, in_round: bool = False) -> None:
        """``host`` left or its lease expired: its units go back. ``in_round``: the open round holds a delta of
        ``host`` it may still take: its report stays until that round's publish commits it (else the model would
        hold the delta's training while its units went back to be trained again), then its units go back."""
        self._answered.pop(host, None)
        if in_round:
            self._departing.add(host)
        elif self.ledger is not None:
            self.ledger.gone(host)

    def publish(self, taken: list[tuple[str, int]], deltas: dict[str, int] | None = None) -> dict | None:
        """Commit the reports of the deltas ``(host, round)`` a published round took; the round's ``data`` record
        (None: no ledger): the ledger's summary, ``published_samples``, ``epoch_ended``, ``hosts`` (each host's
        samples leased, committed and returned over the run, :meth:`DataLedger.host_counts`), the positions
        committed (``spans``: ``[unit, start, end]`` each, of epoch ``epoch_ended`` when it ended, else ``epoch``),
        the hosts whose reports they are (``reported``) and the samples of every delta the round took whole
        (``deltas``, host -> samples): what a published model trained, to check against the hosts' own logs."""
        ledger = self.ledger
        if ledger is None:
            return None
        try:
            published = ledger.publish(taken)
        except ValueError:  # a bug: the round is published regardless; the units stay uncommitted
            self.log.exception("the data ledger could not commit the round's reports %s", taken)
            return {**ledger.summary(), "published_samples": 0, "epoch_ended": None, "hosts": ledger.host_counts()}
        finally:
            for host in self._departing:
                ledger.gone(host)
            self._departing.clear()
        if published.epoch_ended is not None:
            self.log.info("data ledger: epoch %d ended (every sample committed once)", published.epoch_ended)
        return {**ledger.summary(), "published_samples": published.samples,
                "epoch_ended": published.epoch_ended, "hosts": ledger.host_counts(),
                "spans": [[s.unit, s.start, s.end] for s in published.spans],
                "reported": sorted({h for h, _ in taken}), "deltas": dict(deltas or {})}

    def status(self) -> dict | None:
        return None if self.ledger is None else self.ledger.status()

    def saved(self) -> dict | None:
        return None if self.ledger is None else self.ledger.to_dict()

    def ahead(self, taken: list[tuple[str, int]]) -> dict | None:
        """The saved ledger as it will be once :meth:`publish` commits ``taken`` (None: no ledger, or one that
        cannot commit them: the publish then logs it and the round's state, saved after it, holds the ledger)."""
        if self.ledger is None:
            return None
        try:
            return self.ledger.after(taken)
        except ValueError:
            return None

    def restore(self, saved: dict | None) -> None:
        """A resumed run's ledger (every lease void: its hosts lease again; no answer of the ledger before is
        given again)."""
        self.ledger = None if saved is None else DataLedger.from_dict(saved)
        self._answered.clear()


def check_same_data(host: str, spec: DataSpec, order: DataOrder) -> None:
    """Refuse a joining host whose data is not the run's (``order``), naming both."""
    if spec.samples != order.samples:
        raise Refusal(Reason.INVALID, f"host {host} cannot join: this host's dataset has {spec.samples} samples but "
                                      f"the run's has {order.samples}: every host must load the same dataset (same "
                                      "split, same filtering)")
    if (spec.seed, spec.shuffle) != (order.seed, order.shuffle):
        raise Refusal(Reason.INVALID, f"host {host} cannot join: its data order is seed {spec.seed}, shuffle "
                                      f"{spec.shuffle} but the run's is seed {order.seed}, shuffle "
                                      f"{order.shuffle}: start every host with the same seed and shuffle")
