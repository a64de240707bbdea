"""The host columns of ``nodeox report``'s tables and summary, by name: every host phase in its order, then
``sync`` (a host's download, apply and verify summed), then the fallback fetch (what a host does instead of a
sync), wherever that stands among the phases."""

from __future__ import annotations

from ..core import phases as P

SYNC = "sync"


def host_columns(phases: tuple[str, ...] = P.HOST_PHASES) -> tuple[str, ...]:
    return (*(p for p in phases if p != P.FALLBACK_FETCH), SYNC, P.FALLBACK_FETCH)


HOST_COLUMNS = host_columns()
