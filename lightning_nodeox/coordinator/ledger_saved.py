"""The data ledger's saved state (:meth:`DataLedger.to_dict`, :meth:`DataLedger.from_dict`): O(units held or
given back), not O(units): the units below ``fresh`` are committed but for those listed as ``partial`` (their
committed offset), ``held`` (leased, given back on restore) or ``returned``. A restored ledger voids every lease
(each host's generation moves on by :data:`RESTORE_STEP`, past any the coordinator that saved it may have handed
out since: each refusal after the save moved it on by one), so the leases made after the save, unknown to it, are
never reported: a report under one is refused as void, and the host's next lease, of a generation it never held,
drops what it held."""

from __future__ import annotations

import numpy as np

from .ledger_hosts import FREE, HostCounts

RESTORE_STEP = 1 << 16  # a restored ledger's generations: the saved ones plus this (more than refusals in a round)


def to_dict(ledger) -> dict:
    """A :class:`~lightning_nodeox.coordinator.ledger.DataLedger` as the round's saved state holds it."""
    offsets = ledger._cursor - ledger._starts
    usual = np.where(np.arange(ledger.units) < ledger._fresh, ledger._ends - ledger._starts, 0)
    partial = np.flatnonzero(offsets != usual)
    held = np.flatnonzero(ledger._holder != FREE)
    return {"order": {"samples": ledger.order.samples, "seed": ledger.order.seed, "shuffle": ledger.order.shuffle},
            "unit_size": ledger.unit_size, "epoch": ledger.epoch, "fresh": ledger._fresh,
            "committed": ledger._committed, "returned": list(ledger._returned),
            "partial": [[int(u), int(offsets[u])] for u in partial],
            "held": [[int(u), int(ledger._holder[u])] for u in held],
            "own": ledger._own,
            "hosts": {name: {"slot": h.slot, "generation": h.generation, "present": h.present, "leased": h.counts.leased,
                             "committed": h.counts.committed, "returned": h.counts.returned}
                      for name, h in ledger._hosts.items()}}


def restore(ledger, d: dict) -> None:
    """Take up the state ``d`` into a new ``ledger`` of the same order and unit size: every lease void."""
    ledger._begin(d["epoch"])
    ledger._fresh, ledger._committed = d["fresh"], d["committed"]
    ledger._cursor[: ledger._fresh] = ledger._ends[: ledger._fresh]
    for u, offset in d["partial"]:
        ledger._cursor[u] = ledger._starts[u] + offset
    ledger._reported[:] = ledger._cursor
    ledger._returned.extend(d["returned"])
    for name, saved in sorted(d["hosts"].items(), key=lambda item: item[1]["slot"]):
        h = ledger._host(name)
        h.generation, h.present = saved["generation"] + RESTORE_STEP, saved["present"]
        h.counts = HostCounts(saved["leased"], saved["committed"], saved["returned"])
    for u, slot in d["held"]:
        ledger._hosts[ledger._names[slot]].counts.returned += int(ledger._ends[u] - ledger._cursor[u])
        ledger._returned.append(u)
    given_back = np.zeros(ledger.units, dtype=bool)
    given_back[list(ledger._returned)] = True
    ledger._done = int(np.count_nonzero((ledger._cursor == ledger._ends) & ~given_back))
