"""What ``nodeox launch`` starts: a coordinator and its hosts (:class:`OneCoordinator`), or sites (:class:`Sites`):
the coordinator as the root (``--hosts S``), one relay per site (``nodeox relay --upstream ROOT``, run directory
``RUN_DIR/sites/site<k>``, id ``site<k>``) and the hosts spread over the relays in blocks as even as possible
(:func:`spread`).

The two shapes differ here alone: the launch and its supervision read a :class:`Topology` and never ask which one
it is.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path


def spread(hosts: int, sites: int) -> list[list[int]]:
    """The host ids of each site: consecutive blocks, sizes differing by at most one (the first sites the larger)."""
    if sites < 1:
        raise ValueError(f"--sites must be at least 1, got {sites}")
    if sites > hosts:
        raise ValueError(f"--sites {sites} is more than --hosts {hosts}: every site needs a host; give at most "
                         f"--sites {hosts}")
    per, extra = divmod(hosts, sites)
    sizes = [per + (k < extra) for k in range(sites)]
    return [list(range(sum(sizes[:k]), sum(sizes[: k + 1]))) for k in range(sites)]


def site_dir(run_dir: Path, site: int) -> Path:
    """The run directory of relay ``site`` (its name is the relay's id upstream)."""
    return run_dir / "sites" / f"site{site}"


@dataclass(frozen=True)
class RelaySite:
    """One site's relay: its index ``k``, the hosts it serves and its run directory."""

    index: int
    hosts: tuple[int, ...]
    run_dir: Path

    @property
    def name(self) -> str:
        """Its name in the launch's output (``[relay 1]``)."""
        return f"relay {self.index}"

    @property
    def ready_file(self) -> Path:
        return self.run_dir / ".relay-url"

    def args(self, upstream: str, relay_args: list[str]) -> list[str]:
        """``nodeox relay``'s arguments: under the root at ``upstream``, serving its hosts on loopback."""
        return ["relay", "--upstream", upstream, "--hosts", str(len(self.hosts)), "--run-dir", str(self.run_dir),
                "--bind", "127.0.0.1:0", *relay_args]


class Topology(ABC):
    """The processes a launch starts: the coordinator, its relays (none, or one per site), and ``hosts`` hosts."""

    relays: tuple[RelaySite, ...] = ()
    hosts_reach_the_root: bool = True  # the hosts join the coordinator itself (and trust its TLS certificate)
    stop_order: str = "the hosts, then the coordinator"  # the order a stop ends the processes in, as launch says it

    def __init__(self, hosts: int) -> None:
        self.hosts = hosts

    @staticmethod
    def of(hosts: int, sites: int, run_dir: Path) -> Topology:
        """``hosts`` hosts in ``sites`` sites (1: no relays); a ``ValueError`` names a site count that cannot be."""
        blocks = spread(hosts, sites)
        return OneCoordinator(hosts) if len(blocks) == 1 else Sites(blocks, run_dir)

    @abstractmethod
    def root_args(self, coordinator_args: list[str]) -> list[str]:
        """The coordinator's arguments, from those given to the launch."""

    @abstractmethod
    def host_name(self, host: int) -> str:
        """Host ``host``'s name in the launch's output (``[host 2]``)."""

    @abstractmethod
    def host_url(self, host: int, root_url: str, relay_urls: list[str]) -> str:
        """The URL host ``host`` joins at, given the coordinator's and the relays' (in :attr:`relays`' order)."""


class OneCoordinator(Topology):
    """Every host joins the coordinator itself."""

    def root_args(self, coordinator_args: list[str]) -> list[str]:
        return coordinator_args

    def host_name(self, host: int) -> str:
        return f"host {host}"

    def host_url(self, host: int, root_url: str, relay_urls: list[str]) -> str:
        return root_url


class Sites(Topology):
    """The coordinator is the root of one relay per block of hosts; a host joins its site's relay, which serves it
    plain (no TLS)."""

    hosts_reach_the_root = False
    stop_order = "the hosts, then the relays, then the coordinator"

    def __init__(self, blocks: list[list[int]], run_dir: Path) -> None:
        super().__init__(sum(len(block) for block in blocks))
        self.relays = tuple(RelaySite(k, tuple(block), site_dir(run_dir, k)) for k, block in enumerate(blocks))
        self._site_of = {i: site.index for site in self.relays for i in site.hosts}

    def root_args(self, coordinator_args: list[str]) -> list[str]:
        return [*coordinator_args, "--hosts", str(len(self.relays))]  # the last wins

    def host_name(self, host: int) -> str:
        return f"site {self._site_of[host]} host {host}"

    def host_url(self, host: int, root_url: str, relay_urls: list[str]) -> str:
        return relay_urls[self._site_of[host]]
