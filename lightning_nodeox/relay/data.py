"""A site relay's data ledger: its hosts lease from the run's one ledger through it (docs/ledger.md, "relays").

- The site's data (:class:`~lightning_nodeox.core.protocol.DataSpec`) is its first declaring host's; every later
  host's must be the same (refused naming both, as at the root), and the relay declares it upstream at its join
  (the root refuses a relay whose data is not the run's, naming both, and the relay passes that on).
- The site's ledger is a :meth:`DataLedger.below` of the root's unit size (asked of the upstream's status once):
  its hosts lease from the block it holds; when nothing of it is free the relay leases a block upstream, as one
  host of the root (the units asked times the site's hosts), and gives it to the site's ledger. Upstream's
  :class:`EpochEnd` moves the site on; a lease of another generation (the root voided the relay's lease: it was
  cut off, or the root restarted) gives back the block held before.
- Its hosts' reports are checked and noted in the site's ledger as at the root; the relay's delta upstream
  reports what the round's taken deltas carried (:meth:`SiteData.carried`); the site's ledger commits at the
  relay's publish, which comes once the root published the round.
- A relay's delta the root did not take (refused, cut, late) voids the relay's lease upstream: the site gives its
  block back (:meth:`SiteData.upstream_void`), every lease below is void, and the round's reports are not
  committed; its hosts learn it from their next report (``LEASE_VOID``) and lease again. A round whose deltas were
  not sent upstream (:meth:`SiteData.not_sent`) voids the leases below and keeps the block.
- A host that leaves the site or is refused gives its units back to the block (the site's ledger); one that
  leaves while the round is upstream (:meth:`SiteData.sending`) once it is published (the root may take what it
  reported, and the site commits what the root took). A relay that dies is cut off at the root past its lease,
  which gives back every unit the site had not committed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from ..coordinator.service import DataLedger, RunData, check_same_data
from ..core.ledger_order import DataOrder
from ..core.ledger_terms import Covered, EpochEnd, Lease, LeaseReply, Wait
from ..core.protocol import DataSpec, Reason, Refusal
from .upstream import Upstream


class SiteData(RunData):
    """The data ledger of a relay's site (see the module), in the run's place (:attr:`RunState.data`)."""

    def __init__(self, upstream: Upstream, name: str, patience: float = 30.0) -> None:
        """``patience``: seconds a lease waits for the relay's model to be the upstream's (the run's model may
        still be on its way up from the site: the root leases nothing before it has it), then answers ``Wait``."""
        super().__init__(0, name)  # the unit size is the root's
        self.upstream = upstream
        self.patience = patience
        self.spec: DataSpec | None = None  # the site's data, declared upstream with every join of the relay
        self.generation: int | None = None  # the relay's lease upstream (the root's generation of it)
        self._voided: set[tuple[str, int]] = set()  # (host, round) of reports taken but void since
        self._asking = asyncio.Lock()  # one refill upstream at a time
        self._closing = False  # the round's reports are upstream: what the root takes of them the site commits
        self._left: set[str] = set()  # hosts gone meanwhile: their units go back once the round is published

    # -- joining ------------------------------------------------------------------------------------------------
    def declare(self, host: str, spec: DataSpec) -> None:
        client = self.upstream.client
        if self.spec is not None:
            check_same_data(host, spec, DataOrder(self.spec.samples, self.spec.seed, self.spec.shuffle))
            return
        if client.joined:
            raise Refusal(Reason.INVALID, f"host {host} declares its data, but this relay joined {self.upstream.url} "
                                          "without any (its first hosts declared none): start every host of a site "
                                          "alike, then restart the relay")
        self.spec = client.data = spec

    def join_refused(self) -> None:
        """The upstream refused the relay's join: the data declared is not the site's yet (the next host's is)."""
        if not self.upstream.client.joined:
            self.spec = self.upstream.client.data = None

    # -- leasing ------------------------------------------------------------------------------------------------
    async def lease_call(self, host: str, epoch: int | None, units: int = 1, seq: int | None = None) -> LeaseReply:
        """A host's lease: from the site's block; nothing of it free, from a block leased upstream first."""
        last = self._answered.get(host)
        if seq is not None and last is not None and last[0] == seq:
            return last[1]
        async with self._asking:
            if self.ledger is None:
                await self._make_ledger(host)
            asked = 0
            while epoch is not None and epoch > self.ledger.epoch and asked < 3 and await self._refill(units):
                asked += 1  # the host is ahead of the site (a relay restarted from an older state): catch up
            if epoch is not None and epoch > self.ledger.epoch:
                reply = Wait(self.ledger.epoch)  # not yet: the host asks again after an idle round
            else:
                reply, asked = self.lease(host, epoch, units), 0
            while isinstance(reply, Wait) and asked < 3 and await self._refill(units):  # (3: an epoch moved on)
                reply, asked = self.lease(host, epoch, units), asked + 1
        if seq is not None:
            self._answered[host] = (seq, reply)
        return reply

    async def _make_ledger(self, host: str) -> None:
        if self.spec is None:
            self._ledger(host)  # refused: no host declared its data
        status = await self.upstream.call_data(self.upstream.client.status)
        unit_size = (status.get("data") or {}).get("unit_size")
        if not isinstance(unit_size, int):
            raise Refusal(Reason.INVALID, f"{self.upstream.url} has no data ledger: the relay declares the site's "
                                          "data at its join upstream, before its hosts lease")
        spec = self.spec
        self.ledger = DataLedger.below(DataOrder(spec.samples, spec.seed, spec.shuffle), unit_size=unit_size)
        self.log.info("data ledger: the site leases from %s, in units of %d", self.upstream.url, unit_size)

    async def _refill(self, units: int) -> bool:
        """Lease a block upstream for the site (its hosts' units each), as one host of the root; False: upstream
        has nothing free (its other hosts hold the epoch's last units), or no model yet (its hosts wait)."""
        ledger, upstream = self.ledger, self.upstream
        try:
            await asyncio.wait_for(upstream.ready.wait(), self.patience)
        except asyncio.TimeoutError:
            return False
        block = units * max(1, sum(h["present"] for h in _hosts(ledger)))  # a unit for each host leasing here
        try:
            reply = await upstream.call_data(upstream.client.lease, ledger.epoch, block)
        except Refusal as e:
            if e.reason not in (Reason.NO_MODEL, Reason.NOT_JOINED):
                raise
            self.log.info("data ledger: %s leases nothing now (%s); the site's hosts wait", upstream.url, e)
            return False  # the upstream restarted: the relay joins it again with its next round
        if isinstance(reply, EpochEnd):
            if any(h["undecided_deltas"] for h in _hosts(ledger)):  # the root published the site's last reports;
                return False  # the site has not yet: its hosts wait for it
            self._voided.update(ledger.advance(reply.now))
        elif isinstance(reply, Lease):
            if self.generation is not None and reply.generation != self.generation:
                self.log.info("data ledger: %s voided the site's lease; the units it held go back", self.upstream.url)
                self._voided.update(ledger.take_back())
            self.generation = reply.generation
            self._voided.update(ledger.advance(reply.epoch))
            ledger.give(reply)
        return not isinstance(reply, Wait)

    # -- rounds -------------------------------------------------------------------------------------------------
    def carried(self, taken: Iterable[tuple[str, int]]) -> Covered | None:
        """What the relay's delta reports upstream: what the round's taken deltas ``(host, round)`` carried (None:
        the relay never leased upstream)."""
        if self.ledger is None or self.generation is None:
            return None
        return Covered(self.ledger.epoch, self.generation, self.ledger.carried(taken))

    def sending(self) -> None:
        """The round's reports go upstream (:meth:`carried`): until it is published here, a host that leaves keeps
        them (the root may commit them; so must the site)."""
        self._closing = True

    def gone(self, host: str, *, in_round: bool = False) -> None:
        if self._closing:
            self._left.add(host)
        else:
            super().gone(host, in_round=in_round)

    def upstream_void(self) -> None:
        """The relay's delta was not taken upstream: the root took its lease back (see the module)."""
        self._answered.clear()
        self.generation = None  # the next lease upstream is of a new one
        if self.ledger is not None:
            self._voided.update(self.ledger.take_back())

    def not_sent(self) -> None:
        """The round's deltas were not sent upstream: every lease below is void, the block stays the site's."""
        self._answered.clear()
        if self.ledger is not None:
            self._voided.update(self.ledger.void_all())

    def publish(self, taken: list[tuple[str, int]], deltas: dict[str, int] | None = None) -> dict | None:
        """Commit the round's reports (the root published the relay's delta), but for those void since."""
        taken = [t for t in taken if t not in self._voided]
        self._voided.clear()
        published = super().publish(taken, deltas)
        self._closing = False
        for host in sorted(self._left):
            super().gone(host)
        self._left.clear()
        return published

    def ahead(self, taken: list[tuple[str, int]]) -> dict | None:
        return super().ahead([t for t in taken if t not in self._voided])

    def status(self) -> dict | None:
        status = super().status()
        return status if status is None else {**status, "upstream": self.upstream.url,
                                              "upstream_generation": self.generation}

    def saved(self) -> dict | None:
        saved = super().saved()
        return saved if saved is None else {**saved, "upstream_generation": self.generation}

    def restore(self, saved: dict | None) -> None:
        """A resumed relay's site ledger (every lease void); its data is declared upstream again at its join."""
        super().restore(saved)
        self.generation = None if saved is None else saved.get("upstream_generation")
        if self.ledger is not None:
            order = self.ledger.order
            self.spec = self.upstream.client.data = DataSpec(order.samples, order.seed, order.shuffle)


def _hosts(ledger: DataLedger) -> list[dict]:
    """Each host's figures in ``ledger`` (:meth:`DataLedger.status`)."""
    return list(ledger.status()["hosts"].values())
