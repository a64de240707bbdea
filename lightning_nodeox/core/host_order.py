"""The order a run lists its hosts in, the same on every coordinator and relay: numeric ids by number, then the
others by name (so every host of every site reduces exchanged values in the same order)."""

from __future__ import annotations


def host_order(host: str) -> tuple:
    """The sort key of host id ``host``."""
    return (0, int(host), "") if host.isdigit() else (1, 0, host)
