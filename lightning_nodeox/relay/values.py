"""Values exchanged outside rounds, through a site relay: once a key is ready at the relay (each of its hosts
still in the run posted it, or cannot, as at a coordinator), the relay posts it upstream as one host, its
payload being its hosts' payloads in host order (``{"nodeox_site": [[host, payload], ...]}``), and answers its
hosts with the upstream's answer, flattened: every host's payload of every site, in the upstream's host order and
each site's host order within it. That order is the same at every site, so every host of the run reduces the
same list alike. The relay's own hosts are named as they are; other sites' as ``RELAY/HOST``.
"""

from __future__ import annotations

from ..core.host_order import host_order
from ..core.protocol import ValuesReply

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
