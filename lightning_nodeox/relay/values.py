"""Values exchanged outside rounds, through a site relay: once a key is ready at the relay (each of its hosts
still in the run posted it, or cannot, as at a coordinator), the relay posts it upstream as one host, its
payload being its hosts' payloads in host order (``{"nodeox_site": [[host, payload], ...]}``), and answers its
hosts with the upstream's answer, flattened: every host's payload of every site, in the upstream's host order and
each site's host order within it. That order is the same at every site, so every host of the run reduces the
same list alike. The relay's own hosts are named as they are; other sites' as ``RELAY/HOST``.
"""

from __future__ import annotations

import asyncio
import logging

from ..coordinator.rounds import Rounds
from ..coordinator.runstate import RunState
from ..coordinator.values import ValueExchanges, host_order
from ..core.logs import Named
from ..core.protocol import ValuesReply
from .upstream import Upstream

log = logging.getLogger(__name__)

SITE = "nodeox_site"


def site_payload(posted: dict[str, object]) -> dict:
    """A relay's payload upstream: its hosts' payloads, in host order."""
    return {SITE: [[h, posted[h]] for h in sorted(posted, key=host_order)]}


def flatten(reply: ValuesReply, own: str) -> ValuesReply:
    """The upstream's answer as every host's payload (the hosts of relay ``own`` under their own names: also when
    the upstream is a relay that flattened it already, naming them ``OWN/HOST``)."""
    hosts: list[str] = []
    payloads: list[object] = []

    def add(name: str, payload: object, prefix: str) -> None:
        if isinstance(payload, dict) and set(payload) == {SITE}:
            for sub, inner in payload[SITE]:
                add(str(sub), inner, "" if prefix == "" and name == own else f"{prefix}{name}/")
            return
        full = f"{prefix}{name}"
        hosts.append(full.removeprefix(f"{own}/"))
        payloads.append(payload)

    for name, payload in zip(reply.hosts, reply.payloads):
        add(name, payload, "")
    return ValuesReply(reply.key, hosts, payloads)


class RelayValues(ValueExchanges):
    """A coordinator's value exchanges, each answered by the upstream once the site is ready."""

    def __init__(self, state: RunState, rounds: Rounds, upstream: Upstream) -> None:
        super().__init__(state, rounds)
        self.log = Named(log, state.config.name)
        self.upstream = upstream
        self._forwarding: dict[str, asyncio.Future] = {}

    async def answer(self, key: str, exchange) -> None:
        if key not in self._forwarding:
            self._forwarding[key] = asyncio.ensure_future(self._forward(key, exchange))

    async def _forward(self, key: str, exchange) -> None:
        upstream = self.upstream
        try:
            reply = await upstream.call_values(upstream.client.exchange_values, key, site_payload(exchange.posted))
            exchange.answer = flatten(reply, upstream.config.relay_id)
            exchange.posted = {}
        except Exception as e:  # noqa: BLE001 - the site's hosts ask again; the next post forwards it again
            self.log.warning("values %s could not be exchanged with %s: %s", key, upstream.url, e)
        finally:
            del self._forwarding[key]
        await self.state.notify()
