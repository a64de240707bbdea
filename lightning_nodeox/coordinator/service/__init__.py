"""The coordinator's one face to everything outside coordinator/: the operations a transport calls
(:class:`CoordinatorService`, over a :class:`Body` it receives and a :class:`Sink` it sends into), a run served
over a listener or in this process (:func:`run`, :func:`embed`), and what a run that closes its rounds upstream (a
site relay) may do to its run (:class:`SiteControl`; what it plugs in: :class:`~..link.SiteLink`). Nothing outside coordinator/ imports
another module of it (config aside); nothing outside writes the coordinator's state."""

from ..link import SiteLink
from .calls import Body, CoordinatorService, Sink
from .running import Embedded, embed, run
from .site import Published, RoundMean, SiteControl, PassedSync

__all__ = ["Body", "CoordinatorService", "Embedded", "Published", "RoundMean", "Sink", "SiteControl", "SiteLink",
           "PassedSync", "embed", "run"]
