"""What the coordinator's data ledger and a host's sampler say to each other, whatever carries it.

The epoch's samples are read in one order (:mod:`.ledger_order`), a position of that order standing for a sample
index. The ledger cuts the positions into *units* of a fixed size and leases them to hosts; a lease carries only
spans of positions, never index lists:

- :class:`Span`: positions ``[start, end)`` of unit ``unit`` (a unit's positions are read in order, so a span
  always starts where that unit's reading stands).
- :class:`Lease`: spans to train, of ledger epoch ``epoch`` under the host's lease ``generation``.
- :class:`Wait`: nothing free now, but the epoch is not over (other hosts hold its last units).
- :class:`EpochEnd`: the host's epoch ``epoch`` is over (every position of it is committed); the ledger is at
  ``now``.
- :class:`Covered`: what one delta trained (its epoch, generation, spans), sent with the delta.
- :class:`LeaseVoid`: the host's lease is void (a delta of it was refused, it was cut off, the coordinator
  restarted): the host drops every span it holds and leases again.

Each has ``to_dict``; :func:`reply_from_dict` and :meth:`Covered.from_dict` read them back (JSON-friendly)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Span:
    """Positions ``[start, end)`` of the epoch's order, all in unit ``unit``."""

    unit: int
    start: int
    end: int

    def __len__(self) -> int:
        return self.end - self.start

    def to_list(self) -> list[int]:
        return [self.unit, self.start, self.end]


def spans_from_lists(rows: list[list[int]]) -> tuple[Span, ...]:
    return tuple(Span(int(u), int(s), int(e)) for u, s, e in rows)


@dataclass(frozen=True)
class Lease:
    """Spans a host may train, of ledger epoch ``epoch``, under its lease ``generation``."""

    epoch: int
    generation: int
    spans: tuple[Span, ...]

    def to_dict(self) -> dict:
        return {"kind": "lease", "epoch": self.epoch, "generation": self.generation,
                "spans": [s.to_list() for s in self.spans]}


@dataclass(frozen=True)
class Wait:
    """No unit free now, but epoch ``epoch`` is not over: ask again later (after the next round is published)."""

    epoch: int

    def to_dict(self) -> dict:
        return {"kind": "wait", "epoch": self.epoch}


@dataclass(frozen=True)
class EpochEnd:
    """The asking host's epoch ``epoch`` is over; the ledger is at epoch ``now``."""

    epoch: int
    now: int

    def to_dict(self) -> dict:
        return {"kind": "epoch_end", "epoch": self.epoch, "now": self.now}


LeaseReply = Lease | Wait | EpochEnd


def reply_from_dict(d: dict) -> LeaseReply:
    kind = d.get("kind")
    if kind == "lease":
        return Lease(int(d["epoch"]), int(d["generation"]), spans_from_lists(d["spans"]))
    if kind == "wait":
        return Wait(int(d["epoch"]))
    if kind == "epoch_end":
        return EpochEnd(int(d["epoch"]), int(d["now"]))
    raise ValueError(f"not a ledger reply: kind {kind!r} (expected lease, wait or epoch_end)")


@dataclass(frozen=True)
class Covered:
    """The positions one delta trained: spans of ledger epoch ``epoch`` leased under ``generation``, each
    starting where the unit's reading stood (its committed prefix, or the end of this host's previous report)."""

    epoch: int
    generation: int
    spans: tuple[Span, ...]

    @property
    def samples(self) -> int:
        return sum(len(s) for s in self.spans)

    def to_dict(self) -> dict:
        return {"epoch": self.epoch, "generation": self.generation, "spans": [s.to_list() for s in self.spans]}

    @classmethod
    def from_dict(cls, d: dict) -> Covered:
        return cls(int(d["epoch"]), int(d["generation"]), spans_from_lists(d["spans"]))


class LeaseVoid(Exception):
    """The host's lease is void: drop every span held and lease again (the delta that carried it is refused)."""
