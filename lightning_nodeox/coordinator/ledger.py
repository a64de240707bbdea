"""The data ledger: who holds which part of the epoch, on the coordinator.

An epoch reads the dataset in one order (:class:`~lightning_nodeox.core.ledger_order.DataOrder`); its positions
``[u * unit_size, min((u + 1) * unit_size, samples))`` form unit ``u``. Each unit has a *cursor* (the end of its
committed prefix: hosts read a unit in order) and a *holder* (the host it is leased to, or none), in numpy arrays:
memory grows with the units, not the samples.

- :meth:`DataLedger.lease` hands a host up to ``k`` units, each as one span from its cursor to its end: units
  given back first, then fresh ones (O(k)). None free: :class:`Wait` while units are held by others, until they
  are committed or given back. A fast host so takes more units; it never runs into the next epoch.
- :meth:`DataLedger.covered` notes what a delta carries (:class:`Covered`), before the delta is taken into a
  round: each span must be of a unit leased to this host, start where the host's reading of it stands (its
  cursor, or where this host's previous report ended: a unit may straddle rounds), and not be committed. Bad
  input raises ``ValueError`` naming the fix; a report under a void lease raises :class:`LeaseVoid` (the delta
  must then be refused, so that the published model never counts a sample twice).
- :meth:`DataLedger.publish` commits the reports of the deltas a published round took, in the order each host
  sent them. When every unit is committed the epoch ends (then, for every host: each one's next lease of that
  epoch answers :class:`EpochEnd`) and the next begins, in its own order.
- :meth:`DataLedger.refused` (a delta of the host refused or cut from its round) and :meth:`DataLedger.gone`
  (the host left, or was cut off) void the host's lease: every unit it holds goes back, with what it reported
  but was not published, and its later reports raise :class:`LeaseVoid` until it leases again.
- :meth:`DataLedger.to_dict` / :meth:`DataLedger.from_dict`: saved with the round's state, restored with every
  lease void (:mod:`~lightning_nodeox.coordinator.ledger_saved`): after a restart every host leases again.
  :meth:`DataLedger.after`: the saved state as it will be after a publish, written before that round's sync goes
  out.

A relay uses the same class for its site (:meth:`DataLedger.below`)."""

from __future__ import annotations

import copy
import json
from collections import deque
from collections.abc import Iterable

import numpy as np

from ..core.ledger_order import DataOrder
from ..core.ledger_terms import Covered, EpochEnd, Lease, LeaseReply, LeaseVoid, Span, Wait
from . import ledger_saved
from .ledger_hosts import FREE, HostCounts, HostEntry, Published

# the default unit: small enough that an epoch's tail (hosts waiting on the last units) and what a host that dies
# takes with it stay short (8 steps of 32 samples), large enough that a host leases every few steps at most
DEFAULT_UNIT_SIZE = 256


class DataLedger:
    """The epoch's units, leased to hosts and committed as rounds are published.

    Args:
        order: the run's data order (the dataset's length, seed, shuffle), the same the hosts read with.
        unit_size: samples per unit (default 256): smaller shortens an epoch's tail and what a lost host takes
            with it, larger makes leases rarer.
    """

    def __init__(self, order: DataOrder, *, unit_size: int = DEFAULT_UNIT_SIZE) -> None:
        if unit_size < 1:
            raise ValueError(f"the ledger's unit_size must be at least 1 sample, got {unit_size}")
        self.order, self.unit_size = order, unit_size
        self.units = -(-order.samples // unit_size)
        self._starts = np.arange(self.units, dtype=np.int64) * unit_size
        self._ends = np.minimum(self._starts + unit_size, order.samples)
        self._hosts: dict[str, HostEntry] = {}
        self._names: list[str] = []
        self._own = True  # the ledger's own epoch: every unit is its own (a relay's ledger: only those given)
        self._begin(0)

    @classmethod
    def below(cls, order: DataOrder, *, unit_size: int = DEFAULT_UNIT_SIZE) -> DataLedger:
        """A relay's ledger for its site: no unit of its own; the relay gives it (:meth:`give`) the leases it takes
        upstream (as one host) when its hosts find nothing free; its hosts lease and report as from the root's, what
        its round's deltas report (:meth:`carried`, what :meth:`publish` commits) goes upstream as its
        :class:`Covered`, upstream's :class:`EpochEnd` moves it on (:meth:`advance`), its delta refused upstream
        gives every unit back (:meth:`take_back`). (Wired in :mod:`lightning_nodeox.relay.data`.)"""
        ledger = cls(order, unit_size=unit_size)
        ledger._own = False
        ledger._begin_below(0)
        return ledger

    def give(self, lease: Lease) -> None:
        """Units leased upstream, to be leased below (a relay's ledger only)."""
        if self._own:
            raise ValueError("only a relay's ledger (DataLedger.below) is given units; the root leases its own")
        if lease.epoch > self.epoch:
            self.advance(lease.epoch)
        for s in lease.spans:
            self._cursor[s.unit] = self._reported[s.unit] = s.start
            self._returned.append(s.unit)

    def advance(self, epoch: int) -> list[tuple[str, int]]:
        """Upstream is at ``epoch``: begin it (a relay's ledger only; its hosts' older epochs end, every lease of
        them void). Returns the ``(host, delta)`` of the reports voided (none may be published)."""
        if self._own or epoch <= self.epoch:
            return []
        void = self.void_all()
        self._begin_below(epoch)
        return void

    def take_back(self) -> list[tuple[str, int]]:
        """Upstream voided the relay's lease: no unit given is the site's any more, every lease below void (as
        :meth:`advance`)."""
        if self._own:
            raise ValueError("only a relay's ledger (DataLedger.below) gives its units back upstream")
        void, committed = self.void_all(), self._committed
        self._begin_below(self.epoch)
        self._committed = committed
        return void

    def void_all(self) -> list[tuple[str, int]]:
        """Void every host's lease (:meth:`refused` for each); returns the ``(host, delta)`` of the reports voided."""
        return [(name, d) for name, h in self._hosts.items() for d in self._void(h)]

    def _begin_below(self, epoch: int) -> None:
        self._begin(epoch)
        self._fresh = self.units  # nothing fresh: a unit not given reads as another site's (committed here)
        self._cursor[:] = self._reported[:] = self._ends

    def _begin(self, epoch: int) -> None:
        self.epoch = epoch
        self._cursor = self._starts.copy()  # the end of each unit's committed prefix (a position)
        self._reported = self._starts.copy()  # the end of what its holder reported (>= the cursor)
        self._holder = np.full(self.units, FREE, dtype=np.int32)
        self._returned: deque[int] = deque()  # units given back, leased again first
        self._fresh = 0  # units from here on were never leased this epoch
        self._done = 0
        self._committed = 0  # samples committed this epoch

    def check_length(self, samples: int) -> None:
        """Refuse a host whose dataset is not the run's (at its join)."""
        if samples != self.order.samples:
            raise ValueError(f"this host's dataset has {samples} samples but the run's has {self.order.samples}: "
                             "every host must load the same dataset (same split, same filtering)")

    def _host(self, host: str) -> HostEntry:
        h = self._hosts.get(host)
        if h is None:
            h = self._hosts[host] = HostEntry(len(self._names))
            self._names.append(host)
        h.present = True
        return h

    def _known(self, host: str) -> HostEntry:
        h = self._hosts.get(host)
        if h is None:
            raise ValueError(f"host {host} never leased from the data ledger: lease before reporting")
        return h

    def lease(self, host: str, k: int = 1, *, epoch: int | None = None) -> LeaseReply:
        """Up to ``k`` units for ``host``, which is in ledger epoch ``epoch`` (None: a host that has none yet,
        as at its join, takes the current one)."""
        if k < 1:
            raise ValueError(f"a lease takes at least one unit, got k={k}")
        h = self._host(host)
        if epoch is not None and epoch < self.epoch:
            return EpochEnd(epoch, self.epoch)
        if epoch is not None and epoch > self.epoch:
            raise ValueError(f"host {host} asks for epoch {epoch} but the ledger is at epoch {self.epoch}: a host "
                             "moves to the next epoch on the ledger's EpochEnd only (a new host asks with None)")
        spans = []
        while len(spans) < k and (u := self._take_free()) is not None:
            self._holder[u] = h.slot
            span = Span(u, int(self._cursor[u]), int(self._ends[u]))
            h.counts.leased += len(span)
            spans.append(span)
        if not spans:
            return Wait(self.epoch)
        h.held += len(spans)
        return Lease(self.epoch, h.generation, tuple(spans))

    def _take_free(self) -> int | None:
        if self._returned:
            return self._returned.popleft()
        if self._fresh < self.units:
            self._fresh += 1
            return self._fresh - 1
        return None

    def covered(self, host: str, report: Covered, *, delta: int) -> None:
        """Note that ``host``'s delta ``delta`` (its round, say) trained ``report``; nothing changes on error."""
        h = self._known(host) if report.spans or host in self._hosts else self._host(host)  # nothing read yet
        if any(d == delta for d, _ in h.pending):
            raise ValueError(f"host {host} already reported delta {delta}: a delta's coverage is noted once")
        if report.spans and (report.epoch != self.epoch or report.generation != h.generation):
            raise LeaseVoid(f"host {host}'s lease (epoch {report.epoch}, generation {report.generation}) is void: "
                            f"the ledger is at epoch {self.epoch}, generation {h.generation}; lease again")
        reading: dict[int, int] = {}
        for s in report.spans:
            reading[s.unit] = self._check(host, h, s, reading)
        for s in report.spans:
            self._reported[s.unit] = s.end
        h.pending.append((delta, report.spans))

    def _check(self, host: str, h: HostEntry, s: Span, reading: dict[int, int]) -> int:
        u = s.unit
        if not 0 <= u < self.units:
            raise ValueError(f"host {host} reports unit {u}, not a unit of this epoch (0 to {self.units - 1})")
        cursor, end = int(self._cursor[u]), int(self._ends[u])
        if s.start < cursor or (self._holder[u] == FREE and cursor == end):
            raise ValueError(f"host {host} reports positions [{s.start}, {s.end}) of unit {u}, already committed "
                             f"up to {cursor}: report only what the last published round did not carry")
        if self._holder[u] != h.slot:
            raise ValueError(f"host {host} reports unit {u}, which is not leased to it: report only leased spans")
        at = reading.get(u, int(self._reported[u]))
        if s.start != at or not s.start < s.end <= end:
            raise ValueError(f"host {host} reports [{s.start}, {s.end}) of unit {u}, whose reading stands at {at} "
                             f"(unit end {end}): report each unit in order, from where the last report ended")
        return s.end

    def publish(self, deltas: Iterable[tuple[str, int]]) -> Published:
        """Commit the reports of the deltas ``(host, delta)`` a published round took (each host's in the order it
        sent them: its oldest undecided first)."""
        taken: dict[str, list[int]] = {}
        for host, delta in deltas:
            taken.setdefault(host, []).append(delta)
        for host, order in taken.items():
            pending = [d for d, _ in self._known(host).pending]
            if pending[: len(order)] != order:
                raise ValueError(f"publishing host {host}'s deltas {order}, but its undecided reports are {pending}: "
                                 "publish a host's deltas in the order it sent them")
        moved: dict[int, list[int]] = {}  # unit -> [start, end] of what this publish committed of it
        samples = 0
        for host, order in taken.items():
            h = self._hosts[host]
            for _ in order:
                samples += self._commit(h, h.pending.popleft()[1], moved)
        self._committed += samples
        spans = tuple(Span(u, *moved[u]) for u in sorted(moved))
        ended = None
        if self._own and self._done == self.units:
            ended = self.epoch
            self._begin(self.epoch + 1)
        return Published(samples, spans, ended)

    def after(self, deltas: Iterable[tuple[str, int]]) -> dict:
        """The saved state (:meth:`to_dict`) this ledger will have once :meth:`publish` commits ``deltas``; the
        ledger itself is unchanged (written before the round's sync goes out: a restart that takes that round's
        model back takes this ledger with it)."""
        ahead = copy.deepcopy(self)
        ahead.publish(deltas)
        return ahead.to_dict()

    def carried(self, deltas: Iterable[tuple[str, int]]) -> tuple[Span, ...]:
        """What :meth:`publish` of ``deltas`` would commit, one span per unit in unit order (a relay's delta reports
        it upstream as its own); nothing changes."""
        moved: dict[int, list[int]] = {}
        for host, delta in deltas:
            for d, spans in self._known(host).pending:
                for s in spans if d == delta else ():
                    moved.setdefault(s.unit, [s.start, s.end])[1] = s.end
        return tuple(Span(u, *moved[u]) for u in sorted(moved))

    def _commit(self, h: HostEntry, spans: tuple[Span, ...], moved: dict[int, list[int]]) -> int:
        samples = 0
        for s in spans:
            moved.setdefault(s.unit, [s.start, s.end])[1] = s.end
            self._cursor[s.unit] = s.end
            samples += len(s)
            if s.end == self._ends[s.unit]:
                self._holder[s.unit] = FREE
                h.held -= 1
                self._done += 1
        h.counts.committed += samples
        return samples

    def withdraw(self, host: str, delta: int) -> bool:
        """Forget ``host``'s report of ``delta`` if it is its latest undecided one (the delta is as if never sent:
        the host may send it again, reporting the same); False if it is not."""
        h = self._hosts.get(host)
        if h is None or not h.pending or h.pending[-1][0] != delta:
            return False
        for s in reversed(h.pending.pop()[1]):
            self._reported[s.unit] = s.start
        return True

    def refused(self, host: str) -> list[int]:
        """A delta of ``host`` was refused or cut: void its lease. Returns the host's undecided deltas, all void
        now (the refused one among them): none of them may be taken into a round."""
        h = self._hosts.get(host)
        return self._void(h) if h is not None else []

    def gone(self, host: str) -> list[int]:
        """``host`` left or was cut off: void its lease (as :meth:`refused`) and count it absent."""
        h = self._hosts.get(host)
        if h is None:
            return []
        h.present = False
        return self._void(h)

    def _void(self, h: HostEntry) -> list[int]:
        if h.held:
            for u in np.flatnonzero(self._holder == h.slot).tolist():
                h.counts.returned += int(self._ends[u] - self._cursor[u])
                self._reported[u] = self._cursor[u]
                self._holder[u] = FREE
                self._returned.append(u)
        h.held = 0
        void = [d for d, _ in h.pending]
        h.pending.clear()
        h.generation += 1
        return void

    def counts(self, host: str) -> HostCounts:
        return self._known(host).counts

    @property
    def units_free(self) -> int:
        return len(self._returned) + self.units - self._fresh

    def status(self) -> dict:
        """For the status page and the report: the epoch's progress and each host's counts."""
        return {**self.summary(), "samples": self.order.samples, "unit_size": self.unit_size, "units": self.units,
                "units_free": self.units_free, "hosts": {name: h.status() for name, h in self._hosts.items()}}

    def summary(self) -> dict:
        """A flat record for events.jsonl (one per published round)."""
        return {"epoch": self.epoch, "epoch_committed_samples": self._committed,
                "epoch_committed_fraction": self._committed / self.order.samples,
                "units_committed": self._done, "units_held": int(np.count_nonzero(self._holder != FREE))}

    def host_counts(self) -> dict[str, dict]:
        """Each host's samples over the run, for the record of each published round: leased, committed, returned
        (given back uncommitted: the host left, or a delta of its was refused or cut)."""
        return {name: {"leased": h.counts.leased, "committed": h.counts.committed, "returned": h.counts.returned}
                for name, h in self._hosts.items()}

    def to_dict(self) -> dict:
        """The ledger for the round's saved state: O(units held or given back), not O(units)
        (:mod:`~lightning_nodeox.coordinator.ledger_saved`)."""
        return ledger_saved.to_dict(self)

    @classmethod
    def from_dict(cls, d: dict) -> DataLedger:
        """A ledger saved by :meth:`to_dict`, every lease of it void (see the module's doc)."""
        make = cls if d.get("own", True) else cls.below
        ledger = make(DataOrder(**d["order"]), unit_size=d["unit_size"])
        ledger_saved.restore(ledger, d)
        return ledger

    def to_bytes(self) -> bytes:
        return json.dumps(self.to_dict(), separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> DataLedger:
        return cls.from_dict(json.loads(data))
