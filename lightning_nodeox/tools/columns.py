"""The host columns of ``nodeox report``'s tables and summary, by name: every host phase in its order, then
``sync`` (a host's download, apply and verify summed), then the fallback fetch (what a host does instead of a
sync), wherever that stands among the phases; how their bytes read; and a table's columns aligned."""

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


def aligned(rows: list[list[str]], *, right: bool = False) -> list[str]:
    """``rows`` as lines of columns two spaces apart, each as wide as its widest cell; ``right``: every column but
    the first flush right (numbers)."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.rjust(w) if right and i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
            for r in rows]
