"""lightning-nodeox: local-step training across hosts, exchanging 4-bit deltas through an HTTP coordinator.

``import lightning_nodeox`` registers ``Trainer(strategy="nodeox")`` and ``Fabric(strategy="nodeox")``. The
``nodeox`` command itself (coordinator, launch, report) does not import Lightning, which keeps the coordinator's
memory and start-up small.

Rooms: ``host/`` (the Lightning side), ``coordinator/`` (the HTTP coordinator), ``core/`` (what both share),
``tools/`` (the ``nodeox`` command); ``host/`` and ``coordinator/`` never import each other.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from .core import logs
from .core.codecs.settings import (BF16Settings, CodecSettings, FP8Settings, FP32Settings, Int8Settings, Q2Settings,
                                   Q4Settings, SparseSettings)

__version__ = "0.1.0"
__all__ = ["NodeoxFabricStrategy", "NodeoxStrategy", "PhaseMonitor", "LedgerShards", "CodecSettings", "Q4Settings", "Q2Settings",
           "Int8Settings", "FP8Settings", "SparseSettings", "BF16Settings", "FP32Settings"]


def _running_the_nodeox_command() -> bool:
    argv0 = sys.argv[0] if sys.argv else ""
    return argv0 == "-m" or Path(argv0).name == "nodeox"


def __getattr__(name: str):
    if name == "NodeoxStrategy":
        from .host.strategy import NodeoxStrategy

        return NodeoxStrategy
    if name == "NodeoxFabricStrategy":
        from .host.fabric import NodeoxFabricStrategy

        return NodeoxFabricStrategy
    if name == "PhaseMonitor":
        from .host.callbacks import PhaseMonitor

        return PhaseMonitor
    if name == "LedgerShards":
        from .host.ledger_shards import LedgerShards

        return LedgerShards
    raise AttributeError(f"module 'lightning_nodeox' has no attribute {name!r}")


def _show_host_logs() -> None:
    """A host's own lines (joining, one per round, warnings) show like Lightning's: at INFO, on stderr, unless
    the application configured logging itself."""
    logger = logging.getLogger(__name__)
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
    if not logging.getLogger().hasHandlers() and not logger.handlers:
        logger.addHandler(logs.handler())
        logger.propagate = False


if not _running_the_nodeox_command():  # importing the strategies registers them as "nodeox" (Trainer and Fabric)
    _show_host_logs()
    from .host.callbacks import PhaseMonitor
    from .host.fabric import NodeoxFabricStrategy
    from .host.ledger_shards import LedgerShards
    from .host.strategy import NodeoxStrategy
