"""What a run whose rounds close upstream (a site relay) plugs into its coordinator's run: the hooks the run calls.
The site acts on the run only through the :class:`~lightning_nodeox.coordinator.service.site.SiteControl` it is
given at the start."""

from __future__ import annotations

from typing import Any, Protocol

from ..core.protocol import ValuesReply
from ..core.specs import TensorSpec
from .close import Published


class SiteLink(Protocol):
    """What a run whose rounds close upstream plugs into its coordinator's run. Each hook runs on the run's loop."""

    def attach(self, control: Any) -> None:
        """The run is built: ``control`` (its :class:`~lightning_nodeox.coordinator.service.site.SiteControl`) is
        how the site acts on it from now on."""

    async def start(self, resumed: bool) -> None:
        """The run started (``resumed``: from its saved state)."""

    async def tick(self) -> None:
        """The run's periodic work, once."""

    async def before_join(self, specs: tuple[TensorSpec, ...]) -> None:
        """A host joins a run that has no model and is not resumed: take the upstream's model (or learn that the
        site's first host provides it)."""

    async def close_round(self, round_: int, since: float) -> Published:
        """The round's deltas, accumulated, go upstream; what comes back is published."""

    async def exchange_values(self, key: str, posted: dict[str, object]) -> ValuesReply:
        """The site's values under ``key``, answered with the upstream's."""

    def stopping(self) -> None:
        """The run stops: calls upstream in flight give up."""

    def status(self) -> dict:
        """What the run's status adds (its id upstream, the upstream's URL)."""

    def close(self) -> None: ...
