"""A host's settings: how it trains and exchanges (validated when NodeoxStrategy is built), and where it
connects (resolved when training starts, from the arguments given or the environment ``nodeox launch`` sets)."""

from __future__ import annotations

import enum
import os
import re
import socket
from dataclasses import dataclass
from pathlib import Path

from ..core.settings import (
    ENV_CA_FILE,
    ENV_HOST_ID,
    ENV_TELEMETRY_URL,
    ENV_TOKEN,
    ENV_URL,
    check_host_id,
    check_rounding,
    check_url,
)


RETRY_FOR = 600.0  # seconds a host retries a coordinator that does not answer (one moved to another machine too)


class Overlap(enum.Enum):
    """What training does while a round's exchange is in flight (``NodeoxStrategy(overlap=...)``)."""

    OFF = "off"  # it waits for the exchange
    EAGER = "eager"  # it goes on from this host's own result; the sync is folded in when it arrives
    DELAYED = "delayed"  # it goes on from the round's shared model instead

    @classmethod
    def of(cls, overlap: bool | str | Overlap | None) -> Overlap:
        """The public argument as a mode: False/None -> OFF, True -> EAGER, or the mode named."""
        if isinstance(overlap, Overlap):
            return overlap
        if overlap is True:
            return cls.EAGER
        if overlap is False or overlap is None:
            return cls.OFF
        if isinstance(overlap, str) and overlap in ("eager", "delayed"):
            return cls(overlap)
        raise ValueError(f"overlap={overlap!r} is not known; use NodeoxStrategy(overlap=False), overlap=True "
                         "(eager) or overlap='delayed'")


@dataclass(frozen=True)
class HostSettings:
    """How one host trains and exchanges; NodeoxStrategy documents each argument."""

    local_steps: int = 20
    rounding: str = "nearest"
    error_feedback: bool = True
    codec_threads: int | None = None
    request_timeout: float = 120.0
    retry_for: float = RETRY_FOR
    overlap: Overlap = Overlap.OFF
    round_seconds: float | None = None
    fragments: int = 1

    def __post_init__(self) -> None:
        if self.local_steps < 1:
            raise ValueError(f"local_steps must be at least 1, got {self.local_steps}")
        if not isinstance(self.fragments, int) or self.fragments < 1:
            raise ValueError(f"fragments must be a whole number of at least 1 (1: the whole model each round), got "
                             f"{self.fragments!r}")
        if self.round_seconds is None and self.local_steps % self.fragments:
            raise ValueError(f"local_steps={self.local_steps} does not split into fragments={self.fragments} rounds "
                             f"of equal steps; choose local_steps a multiple of fragments (e.g. "
                             f"local_steps={self.local_steps - self.local_steps % self.fragments or self.fragments})")
        if not isinstance(self.overlap, Overlap):
            raise TypeError(f"overlap must be an Overlap mode (Overlap.of({self.overlap!r})), got {self.overlap!r}")
        if self.round_seconds is not None and not self.round_seconds > 0:
            raise ValueError(f"round_seconds must be positive seconds (or None for local_steps), got {self.round_seconds}")
        check_rounding(self.rounding)
        if self.codec_threads is not None and self.codec_threads < 1:
            raise ValueError(f"codec_threads must be at least 1 (or None for the CPU quota), got {self.codec_threads}")
        if self.request_timeout <= 0 or self.retry_for < 0:
            raise ValueError("request_timeout must be positive and retry_for non-negative seconds")

    @property
    def round_steps(self) -> int:
        """Steps between two rounds: ``local_steps``, or with fragments one fragment's share of them."""
        return self.local_steps // self.fragments

    @property
    def round_budget(self) -> float | None:
        """Seconds between two rounds with ``round_seconds`` (one fragment's share of them)."""
        return None if self.round_seconds is None else self.round_seconds / self.fragments


def default_host_id() -> str:
    """This process's id when none is given: the machine's name and the local rank (``LOCAL_RANK``, set by
    torchrun and Lightning's launchers), else the process id, so that two processes never share one."""
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", socket.gethostname())[:48] or "host"
    return f"{name}-{os.environ.get('LOCAL_RANK') or os.getpid()}"


@dataclass(frozen=True)
class Connection:
    """Where a host connects, as whom, and which certificate authority it trusts (``ca_file``; None: the
    system's, or ``REQUESTS_CA_BUNDLE``)."""

    coordinator_url: str
    host_id: str
    token: str | None = None
    telemetry_url: str | None = None
    ca_file: str | None = None

    def __post_init__(self) -> None:
        check_url(self.coordinator_url, f"coordinator URL (NodeoxStrategy(coordinator_url=...) or {ENV_URL})")
        if self.telemetry_url is not None:
            check_url(self.telemetry_url, f"telemetry URL ({ENV_TELEMETRY_URL})")
        check_host_id(self.host_id, f"host_id (NodeoxStrategy(host_id=...) or {ENV_HOST_ID})")
        if self.ca_file is not None and not Path(self.ca_file).is_file():
            raise ValueError(f"{ENV_CA_FILE}={self.ca_file} is not a file; point it at the PEM certificate (or CA) "
                             "the coordinator serves")


@dataclass(frozen=True)
class ConnectionSettings:
    """Where a host connects as given to NodeoxStrategy (None: from the environment when training starts)."""

    coordinator_url: str | None = None
    host_id: str | None = None
    token: str | None = None
    telemetry_url: str | None = None

    def given_host_id(self) -> str | None:
        """The host id given, else ``NODEOX_HOST_ID``; None when neither is."""
        return self.host_id or os.environ.get(ENV_HOST_ID) or None

    def resolved_host_id(self) -> str:
        """The host id given, else ``NODEOX_HOST_ID``, else the machine's name."""
        return self.given_host_id() or default_host_id()

    def resolve(self) -> Connection:
        """The arguments given, then the environment, then defaults."""
        url = self.coordinator_url or os.environ.get(ENV_URL)
        if not url:
            raise ValueError(
                "NodeoxStrategy needs the coordinator's URL: pass NodeoxStrategy(coordinator_url='http://HOST:8470') "
                f"or set {ENV_URL} (`nodeox launch` sets it for the hosts it starts)")
        return Connection(coordinator_url=url, host_id=self.resolved_host_id(),
                          token=self.token or os.environ.get(ENV_TOKEN) or None,
                          telemetry_url=self.telemetry_url or os.environ.get(ENV_TELEMETRY_URL) or None,
                          ca_file=os.environ.get(ENV_CA_FILE) or None)
