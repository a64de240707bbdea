"""Who takes part in the run: the host registry, each host's state and its lease.

A host is expected in every round while it is ``TRAINING`` and heard from (heartbeat, join, upload, sync)
within the lease: it is *live*. A host not heard from for longer is ``DROPPED``: no round waits for it until it
is heard from again, and then it trains on. ``FINISHED`` hosts have sent their final delta; ``LEFT`` hosts said
goodbye (training ended or failed) and take part again only by joining again. The hosts of a resumed run are
*not yet heard from* (``heard`` False): rounds wait for them for one lease, and a new process may take the id.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Container
from dataclasses import dataclass, field

from ..core.logs import Named
from ..core.protocol import Reason, Refusal
from .config import NAME

log = logging.getLogger(__name__)


class HostState(enum.Enum):
    TRAINING = "training"  # expected in every round while its lease holds
    DROPPED = "dropped"  # its lease expired; expected again once heard from
    FINISHED = "finished"  # sent its final delta
    LEFT = "left"  # said goodbye (or failed): takes no further part


@dataclass
class Host:
    id: str
    credential: str  # what every call of this host presents (from its join)
    state: HostState = HostState.TRAINING
    seen: float = field(default_factory=time.monotonic)  # when last heard from
    joined: float = field(default_factory=time.time)
    heard: bool = True  # False for a resumed run's host until this coordinator hears from it
    merged_base: int = -1  # the base round of its last delta taken (--merge async: a retry of it is a duplicate)
    merged_into: int = -1  # the round that took its last delta (later than its base round when it was late)


class Hosts(dict[str, Host]):
    """The registry: host id -> :class:`Host`, with the lease rules (changed only on the event loop)."""

    def __init__(self, lease: float, name: str = NAME) -> None:
        """``name``: what its log lines start with (its run's)."""
        super().__init__()
        self.lease = lease
        self.log = Named(log, name)

    def restore(self, saved: dict[str, dict]) -> None:
        """Hosts of a resumed run (``{"state", "credential"}`` each), each with a fresh lease, not yet heard from; one
        dropped when the run stopped is expected back like the others (the run stopped waiting for it), so the first
        host back does not train the next round alone."""
        now = time.monotonic()

        def resumed(state: HostState) -> HostState:
            return HostState.TRAINING if state is HostState.DROPPED else state

        self.update({h: Host(h, str(d["credential"]), resumed(HostState(d["state"])), now, heard=False)
                     for h, d in saved.items()})

    def saved(self) -> dict[str, dict]:
        """What :meth:`restore` takes back."""
        return {h.id: {"state": h.state.value, "credential": h.credential} for h in self.values()}

    def register(self, host: str, credential: str) -> Host:
        """(Re)admit ``host`` with a new ``credential``; returns its entry."""
        entry = self.setdefault(host, Host(host, credential))
        entry.credential, entry.seen, entry.joined, entry.heard = credential, time.monotonic(), time.time(), True
        if entry.state is not HostState.FINISHED:  # a finished host that joins again stays finished
            entry.state = HostState.TRAINING
        return entry

    def known(self, host: str) -> Host:
        """The host's entry, or NOT_JOINED for a host that never joined or left."""
        entry = self.get(host)
        if entry is None or entry.state is HostState.LEFT:
            raise Refusal(Reason.NOT_JOINED, f"host {host} is not in the run{' (it left)' if entry else ''}; "
                                             "POST /v1/join first")
        return entry

    def seen(self, entry: Host) -> None:
        """The host was heard from: its lease starts over, and a dropped host is expected again."""
        entry.seen, entry.heard = time.monotonic(), True
        if entry.state is HostState.DROPPED:
            entry.state = HostState.TRAINING
            self.log.info("host %s is back; rounds wait for it again", entry.id)

    def expire(self) -> list[Host]:
        """Drop the training hosts not heard from within the lease; returns them."""
        now = time.monotonic()
        expired = [h for h in self.values() if h.state is HostState.TRAINING and now - h.seen > self.lease]
        for h in expired:
            h.state = HostState.DROPPED
            self.log.warning("host %s: no heartbeat for %.1f s (--lease %g); rounds no longer wait "
                             "for it", h.id, now - h.seen, self.lease)
        return expired

    def expected(self, received: Container[str]) -> list[Host]:
        """The hosts whose delta this round waits for (or has): live training hosts, finishing hosts."""
        return [h for h in self.values()
                if h.state is HostState.TRAINING or (h.state is HostState.FINISHED and h.id in received)]

    def in_run(self, received: Container[str]) -> int:
        """Hosts that may still send a delta this round: training or dropped (they may come back), or sent one."""
        return sum(h.state in (HostState.TRAINING, HostState.DROPPED) or h.id in received for h in self.values())

    def live(self) -> list[Host]:
        """The hosts training and heard from within the lease (a resumed run's: given one lease to be heard from)."""
        return [h for h in self.values() if h.state is HostState.TRAINING]

    def takeable(self, entry: Host) -> bool:
        """Whether a new process may take ``entry``'s id: its holder left, was dropped, or (a resumed run) has not
        been heard from since the restart."""
        return entry.state in (HostState.LEFT, HostState.DROPPED) or not entry.heard

    def all_gone(self, awaited: Container[str] = ()) -> bool:
        """Every host has left or is no longer heard from; a host ``awaited`` only once it has left."""
        now = time.monotonic()
        return all(h.state is HostState.LEFT or (now - h.seen > self.lease and h.id not in awaited)
                   for h in self.values())

    def all_finished(self) -> bool:
        """Every host has sent its final delta: the run completes with the round that takes them."""
        return bool(self) and all(h.state is HostState.FINISHED for h in self.values())

    def dropped(self) -> str:
        """The dropped hosts, each with how long it has not been heard from."""
        return self._listed(lambda h: h.state is HostState.DROPPED)

    def absent(self) -> str:
        """The hosts not live, each with why (dropped for how long, left, finished)."""
        return self._listed(lambda h: h.state is not HostState.TRAINING)

    def _listed(self, which) -> str:
        now = time.monotonic()
        why = {HostState.DROPPED: lambda h: f"not heard from for {now - h.seen:.0f} s"}
        return ", ".join(f"{h.id} ({why.get(h.state, lambda h: h.state.value)(h)})" for h in self.values()
                         if which(h)) or "none"
