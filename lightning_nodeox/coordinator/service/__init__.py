"""The coordinator's one face to everything outside coordinator/: the operations a transport calls
(:class:`CoordinatorService`, over a :class:`Body` it receives and a :class:`Sink` it sends into), a run served
over a listener or in this process (:func:`run`, :func:`embed`), and what a run that closes its rounds upstream (a
site relay) may do to its run (:class:`SiteControl`; what it plugs in: :class:`~..link.SiteLink`; its data ledger,
a :class:`RunData` of a :meth:`DataLedger.below`). Nothing outside coordinator/ imports
another module of it (config aside); nothing outside writes the coordinator's state."""

from ..data import RunData, check_same_data
from ..ledger import DataLedger
from ..link import SiteLink
from .calls import Body, CoordinatorService, Sink
from .running import Embedded, embed, run
from .site import Published, RoundMean, SiteControl, PassedSync

__all__ = ["Body", "CoordinatorService", "DataLedger", "Embedded", "Published", "RoundMean", "RunData", "Sink",
           "SiteControl", "SiteLink", "PassedSync", "check_same_data", "embed", "run"]
