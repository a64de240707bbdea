"""The host columns of ``nodeox report``'s tables and summary, by name: every host phase in its order, then
``sync`` (a host's download, apply and verify summed), then the fallback fetch (what a host does instead of a
sync), wherever that stands among the phases; and how their bytes read."""

from __future__ import annotations

from ..core import phases as P

SYNC = "sync"


def host_columns(phases: tuple[str, ...] = P.HOST_PHASES) -> tuple[str, ...]:
    return (*(p for p in phases if p != P.FALLBACK_FETCH), SYNC, P.FALLBACK_FETCH)


HOST_COLUMNS = host_columns()


def human_bytes(n: float | None) -> str:
    """``n`` bytes as a person reads them (kB, MB and GB of 1000), "-" when unknown."""
    if n is None:
        return "-"
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"
