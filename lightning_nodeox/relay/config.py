"""A site relay's settings toward its upstream, validated once, with errors that name the fix (its settings
toward its own hosts are a coordinator's: :class:`~lightning_nodeox.coordinator.config.CoordinatorConfig`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..core.settings import check_host_id, check_url


@dataclass(frozen=True)
class RelayConfig:
    """Where a relay sends its site's deltas, and as whom.

    Args:
        upstream: URL of the root coordinator, or of another relay.
        relay_id: the relay's host id upstream (None: its run directory's name), the same across its restarts.
        token: the upstream's bearer token (None: it has none).
        ca_file: the certificate (or CA) to trust the upstream's TLS with (None: the system's store).
        retry_for: seconds a call upstream is retried for (connection errors, 5xx) before the relay gives up on
            it: a relay rides out a restart of its upstream this long.
    """

    upstream: str
    relay_id: str
    token: str | None = None
    ca_file: str | None = None
    retry_for: float = 300.0

    def __post_init__(self) -> None:
        check_url(self.upstream, "--upstream")
        check_host_id(self.relay_id, "--id (the relay's host id upstream)")
        if not self.retry_for > 0:
            raise ValueError(f"the upstream's retry time must be positive seconds, got {self.retry_for}")

    @property
    def name(self) -> str:
        """What the relay's lines start with (its coordinator side's too: ``CoordinatorConfig.name``)."""
        return f"nodeox relay {self.relay_id}"

    @staticmethod
    def default_id(run_dir: Path) -> str:
        """The relay's id when none is given: its run directory's name (stable across restarts)."""
        return Path(run_dir).resolve().name
