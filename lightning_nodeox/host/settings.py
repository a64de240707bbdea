"""A host's settings: how it trains and exchanges (validated when NodeoxStrategy is built), and where it
connects (resolved when training starts, from the arguments given or the environment ``nodeox launch`` sets)."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from ..core.settings import ENV_HOST_ID, ENV_TELEMETRY_URL, ENV_TOKEN, ENV_URL, check_rounding, check_url


@dataclass(frozen=True)
class HostSettings:
    """How one host trains and exchanges; NodeoxStrategy documents each argument."""

    local_steps: int = 20
    rounding: str = "nearest"
    error_feedback: bool = True
    codec_threads: int | None = None
    request_timeout: float = 120.0
    retry_for: float = 60.0

    def __post_init__(self) -> None:
        if self.local_steps < 1:
            raise ValueError(f"local_steps must be at least 1, got {self.local_steps}")
        check_rounding(self.rounding)
        if self.codec_threads is not None and self.codec_threads < 1:
            raise ValueError(f"codec_threads must be at least 1 (or None for the CPU quota), got {self.codec_threads}")
        if self.request_timeout <= 0 or self.retry_for < 0:
            raise ValueError("request_timeout must be positive and retry_for non-negative seconds")


@dataclass(frozen=True)
class Connection:
    """Where a host connects and as whom."""

    coordinator_url: str
    host_id: str
    token: str | None = None
    telemetry_url: str | None = None

    def __post_init__(self) -> None:
        check_url(self.coordinator_url, f"coordinator URL (NodeoxStrategy(coordinator_url=...) or {ENV_URL})")
        if self.telemetry_url is not None:
            check_url(self.telemetry_url, f"telemetry URL ({ENV_TELEMETRY_URL})")
        if not 1 <= len(self.host_id) <= 64:
            raise ValueError(f"host_id must be 1 to 64 characters, got {self.host_id!r}; set {ENV_HOST_ID}")

    @staticmethod
    def host_id_from_env(host_id: str | None = None) -> str:
        """The host id given, else ``NODEOX_HOST_ID``, else the machine's name."""
        return host_id or os.environ.get(ENV_HOST_ID) or socket.gethostname()

    @classmethod
    def resolve(cls, *, coordinator_url: str | None = None, host_id: str | None = None, token: str | None = None,
                telemetry_url: str | None = None) -> Connection:
        """The arguments given, then the environment, then defaults."""
        url = coordinator_url or os.environ.get(ENV_URL)
        if not url:
            raise ValueError(
                "NodeoxStrategy needs the coordinator's URL: pass NodeoxStrategy(coordinator_url='http://HOST:8470') "
                f"or set {ENV_URL} (`nodeox launch` sets it for the hosts it starts)")
        return cls(coordinator_url=url, host_id=cls.host_id_from_env(host_id),
                   token=token or os.environ.get(ENV_TOKEN) or None,
                   telemetry_url=telemetry_url or os.environ.get(ENV_TELEMETRY_URL) or None)
