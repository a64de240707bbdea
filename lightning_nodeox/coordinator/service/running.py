"""A coordinator's run served by a transport: over a listener until the run ends (:func:`run`, HTTP's), or in this
process by direct calls (:func:`embed`, the tests' in-process transport)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from .. import lifecycle
from ..config import CoordinatorConfig
from ..lifecycle import CoordinatorRun
from ..rounds import BeforePublish
from ..link import SiteLink
from .calls import CoordinatorService
from .site import SiteControl


class Embedded:
    """A coordinator's run served in this process by direct calls (no listener, no ticker of its own): its
    :attr:`service`, one pass of its periodic work (:meth:`tick`), and its end (:meth:`stop`). ``run``: the run
    itself, for a test to look at."""

    def __init__(self, opened: lifecycle.Opened) -> None:
        self._opened = opened
        self.run = opened.run
        self.service = CoordinatorService(opened.run)

    async def tick(self) -> None:
        await self.run.tick()

    async def stop(self, *, save: bool = True) -> None:
        """End the run: with ``save``, as a stopped coordinator does (a closing round publishes, the state is
        written with a snapshot); without, as kill -9 would (a save in flight finishes)."""
        if save:
            await self.run.save_at_shutdown()
        self._opened.close()


async def embed(config: CoordinatorConfig, *, keep_state: bool = True, site: SiteLink | None = None) -> Embedded:
    """Take up and start the run of ``config`` to be served in this process (see :func:`lifecycle.open_run`);
    ``site``: its rounds close upstream (a site relay)."""
    return Embedded(await lifecycle.open_run(config, keep_state=keep_state, site=site, controls=SiteControl.of))

Listen = Callable[[CoordinatorService], Awaitable[Callable[[], Awaitable[None]]]]


async def run(config: CoordinatorConfig, listen: Listen, *, before_publish: BeforePublish | None = None,
              site: SiteLink | None = None) -> int:
    """Run a coordinator until its run completes (or a signal); returns the exit status. ``listen(service)``
    starts the transport and returns what stops it (see :func:`lifecycle.run`)."""

    async def start(coordinator: CoordinatorRun):
        return await listen(CoordinatorService(coordinator))

    return await lifecycle.run(config, start, before_publish=before_publish, site=site, controls=SiteControl.of)
