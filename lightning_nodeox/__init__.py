"""lightning-nodeox: local-step training across hosts, exchanging 4-bit deltas through an HTTP coordinator.

``import lightning_nodeox`` registers ``Trainer(strategy="nodeox")``.
"""

from .callbacks import PhaseMonitor
from .codec import Q4Settings
from .strategy import NodeoxStrategy

__all__ = ["NodeoxStrategy", "PhaseMonitor", "Q4Settings"]
__version__ = "0.1.0"
