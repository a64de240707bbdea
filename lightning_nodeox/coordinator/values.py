"""Values exchanged outside rounds: each host posts a small JSON payload under a key that every host names alike
(an epoch's logged values, a torchmetrics state), and once the hosts that can post it have, every host gets all
the payloads posted, in host order. The hosts reduce them themselves, all alike.

A key is answered once, the same to every host (a host posting it later gets that answer, without its own
payload: the answer names the hosts it holds), when each host still in the run (training or finished, heard from
within ``--lease``, not left) has posted it, or cannot post it for now:
- it waits in the open round (its delta is in, the round waits for others, and its training waits for the
  sync): a host that stopped at an epoch's end would otherwise hold a host that closed a round first, and that
  host would hold it. A host whose round overlaps its training (it said so with its delta and its sync polls:
  :meth:`Rounds.trains_on`) is not waiting: it reaches the epoch's end itself and posts, so it is waited for,
  until a sync poll of it says its training now waits (its next round boundary came first);
- it waits on another key of its own (hosts that name keys differently never hold each other);
and no key is answered while round 0 waits for ``--hosts`` hosts to join, as the round does. With
``--round-timeout S`` a key is also answered S seconds after its first post.

Values are not saved: a restarted coordinator holds none, and the hosts post theirs again once they joined again
(:meth:`~lightning_nodeox.host.round.HostRound.exchange_values`); a coordinator restarted afresh (nothing saved)
is at round 0 and waits for ``--hosts`` hosts, a resumed one for the hosts of the saved run (for one lease). A key
answered to some hosts just before the restart is answered to the others from the posts made after it (those
that had their answer do not post again), so it may differ from theirs: the window is the answer's own moment.

A post is idempotent: a host's first payload for a key is kept, so a retried post changes nothing. Answered keys
are kept for hosts that post them late, the last ``KEEP`` of them and at most ``KEEP_BYTES`` of payloads (the
oldest are forgotten first).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from ..core.host_order import host_order
from ..core.logs import Named
from ..core.protocol import Reason, Refusal, ValuesReply
from .hosts import HostState
from .link import SiteLink
from .rounds import Rounds
from .runstate import RunState

log = logging.getLogger(__name__)

KEEP = 64  # answered keys kept for hosts that post them late ...
KEEP_BYTES = 32 << 20  # ... holding at most this many bytes of payloads (JSON)
OPEN = 256  # keys open (not answered) at once: more is a host naming a new key at every call
POLL = 0.05  # seconds between checks of whether a key can be answered (a delta's arrival is not notified)


@dataclass
class _Key:
    first: float = field(default_factory=time.monotonic)
    posted: dict[str, object] = field(default_factory=dict)  # host -> payload
    size: int = 0  # bytes of the payloads posted (as JSON)
    answer: ValuesReply | None = None


class ValueExchanges:
    """The keys being exchanged, and their answers."""

    def __init__(self, state: RunState, rounds: Rounds, site: SiteLink | None = None) -> None:
        """``site``: keys are answered upstream (a site relay's)."""
        self.state = state
        self.rounds = rounds
        self.site = site
        self.log = Named(log, state.config.name)
        self._keys: OrderedDict[str, _Key] = OrderedDict()
        self._forwarding: dict[str, asyncio.Future] = {}

    async def exchange(self, host: str, key: str, payload: object, wait: float) -> ValuesReply | None:
        """Post ``host``'s ``payload`` under ``key`` (once) and wait up to ``wait`` seconds for the answer (None:
        not yet; post again)."""
        entry = self.state.hosts.known(host)
        self.state.hosts.seen(entry)
        exchange = self._keys.get(key)
        if exchange is None:
            self._forget_old()
            exchange = self._keys[key] = _Key()
        if exchange.answer is None and host not in exchange.posted:
            exchange.posted[host] = payload
            exchange.size += len(json.dumps(payload))
            await self.state.notify()  # a host waiting on another key may now be answered
        deadline = time.monotonic() + wait
        while exchange.answer is None:
            if self._ready(key, exchange):
                await self.answer(key, exchange)
                if exchange.answer is not None:
                    break
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            await self.state.wait(lambda: exchange.answer is not None, min(POLL, left))
        return exchange.answer

    async def answer(self, key: str, exchange: _Key) -> None:
        """Answer a key that is ready: every payload posted, in host order (a site relay asks its upstream, once
        per key at a time, while its hosts wait)."""
        if self.site is not None:
            if key not in self._forwarding:
                self._forwarding[key] = asyncio.ensure_future(self._answer_upstream(key, exchange))
            return
        hosts = sorted(exchange.posted, key=host_order)
        exchange.answer = ValuesReply(key, hosts, [exchange.posted[h] for h in hosts])
        exchange.posted = {}
        await self.state.notify()

    async def _answer_upstream(self, key: str, exchange: _Key) -> None:
        try:
            exchange.answer = await self.site.exchange_values(key, dict(exchange.posted))
            exchange.posted = {}
        except Exception as e:  # noqa: BLE001 - the site's hosts ask again; the next post forwards it again
            self.log.warning("values %s could not be exchanged upstream: %s", key, e)
        finally:
            del self._forwarding[key]
        await self.state.notify()

    def pending(self, host: str) -> str | None:
        """A key ``host`` posted that is not answered yet (None when it waits on none)."""
        for key, exchange in self._keys.items():
            if exchange.answer is None and host in exchange.posted:
                return key
        return None

    def _ready(self, key: str, exchange: _Key) -> bool:
        timeout = self.state.config.round_timeout
        if timeout is not None and time.monotonic() - exchange.first >= timeout:
            return True
        if self.rounds.open.joins_awaited():  # round 0 (also of a coordinator restarted afresh) waits for --hosts
            return False
        return all(h.id in exchange.posted or self._held(h.id, key) for h in self._in_run())

    def _in_run(self) -> list:
        now, hosts = time.monotonic(), self.state.hosts
        return [h for h in hosts.values()
                if h.state in (HostState.TRAINING, HostState.FINISHED) and now - h.seen <= hosts.lease]

    def _held(self, host: str, key: str) -> bool:
        """Whether ``host`` cannot post ``key`` for now: its training waits in the open round, or on another key."""
        rounds = self.rounds
        if host in rounds.received and host not in rounds.deltas.training and not rounds.closing and rounds.open.missing():
            return True
        other = self.pending(host)
        return other is not None and other != key

    def _forget_old(self) -> None:
        """Forget the oldest answered keys beyond ``KEEP`` or ``KEEP_BYTES``; refuse a new key beyond ``OPEN``."""
        answered = [k for k, e in self._keys.items() if e.answer is not None]
        size = sum(self._keys[k].size for k in answered)
        for key in answered:
            if len(answered) < KEEP and size <= KEEP_BYTES:
                break
            size -= self._keys.pop(key).size
            answered = answered[1:]
        if len(self._keys) - len(answered) >= OPEN:
            raise Refusal(Reason.BUSY, f"{OPEN} value keys are open at once; a host names a new key at every call")

