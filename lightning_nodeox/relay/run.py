"""A site relay: to its hosts a coordinator (the same protocol, server and rooms), to its upstream one host
whose delta is its site's sample-weighted mean and whose sample count is the site's sum
(:mod:`~lightning_nodeox.relay.close`). It never applies an outer step; the root's sync and model hash pass
down unchanged, so every host of every site ends bit-identical with the root.

A relay restarted on its run directory resumes as a coordinator does (its hosts ride it out: they rejoin, give
its θ back, resend their deltas); once θ is back it joins upstream again with the credential it kept
(``upstream.json`` in its run directory), so the upstream takes it back at once, and goes on from the upstream's model.
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

from ..coordinator import server
from ..coordinator.config import CoordinatorConfig
from ..coordinator.service import Published, SiteControl
from ..core.transport import HostClient
from ..host.client import HttpClient
from ..core.protocol import Refusal, ValuesReply
from ..core.specs import TensorSpec
from .close import UpstreamClose
from .config import RelayConfig
from .data import SiteData
from .membership import SiteModel
from .upstream import Upstream
from .values import flatten, site_payload

CREDENTIAL_FILE = "upstream.json"  # in the run directory, beside state/ (which holds only what its store names)


class Site:
    """A site relay's link to its coordinator's run (a :class:`~lightning_nodeox.coordinator.link.SiteLink`): its
    rounds close upstream, its model comes from (or goes to) upstream, its values are answered upstream."""

    def __init__(self, upstream: Upstream) -> None:
        self.upstream = upstream
        self.control: SiteControl | None = None
        self.model: SiteModel | None = None
        self._close: UpstreamClose | None = None
        self._joining: asyncio.Future | None = None  # θ the relay holds, becoming its upstream host's

    def attach(self, control: SiteControl) -> None:
        upstream = self.upstream
        self.control = control
        self.model = SiteModel(upstream, control)
        self.data = SiteData(upstream, control.config.name, patience=control.config.long_poll)
        control.use_data(self.data)  # its hosts lease from the run's ledger through the relay
        self._close = UpstreamClose(upstream, control, self.data)
        loop = asyncio.get_running_loop()  # the upstream's records come from its thread; the run log is the loop's
        upstream.phases.listeners.append(lambda record: loop.call_soon_threadsafe(control.record, record))
        control.listen(upstream.forward)  # its site's records, upstream

    async def start(self, resumed: bool) -> None:
        if resumed:
            self.upstream.restore_credential()  # its id upstream is taken back at once

    async def tick(self) -> None:
        hr = self.upstream.round  # the upstream's run complete: its lease is kept until the relay's records are in
        self.upstream.site_live = bool(self.control.busy() or (hr and hr.complete))
        if self.model.upstream_pending() and (self._joining is None or self._joining.done()):
            self._joining = asyncio.ensure_future(self.model.join_upstream_with_model())

    async def before_join(self, specs: tuple[TensorSpec, ...]) -> None:
        try:
            await self.model.before_join(specs)
        except Refusal:
            self.data.join_refused()  # (the site's data, say): the next host's is declared upstream
            raise

    async def close_round(self, round_: int, since: float) -> Published:
        return await self._close.close(round_, since)

    async def exchange_values(self, key: str, posted: dict[str, object]) -> ValuesReply:
        upstream = self.upstream
        reply = await upstream.call_values(upstream.client.exchange_values, key, site_payload(posted))
        return flatten(reply, upstream.config.relay_id)

    def stopping(self) -> None:
        """An exchange upstream in flight gives up (a stopped relay does not wait for its upstream's round; its
        hosts resend their deltas to it once it is back, and the upstream takes its delta once)."""
        self.upstream.client.cancel()

    def status(self) -> dict:
        return {"relay": self.upstream.config.relay_id, "upstream": self.upstream.url}

    def close(self) -> None:
        self.upstream.close()


def upstream_client(relay: RelayConfig) -> HostClient:
    """The relay's calls upstream, over HTTP(S) to ``--upstream``."""
    return HttpClient(relay.upstream, host=relay.relay_id, token=relay.token, ca_file=relay.ca_file,
                      retry_for=relay.retry_for,
                      check="Check `nodeox relay --upstream` and that the coordinator (or relay) is running there.")


async def serve(config: CoordinatorConfig, relay: RelayConfig, ready_file: Path | None = None) -> int:
    """Run a relay over HTTP until its run completes (or a signal); returns the exit status. Its hosts use the
    upstream's codec (asked of it first)."""
    upstream = Upstream(relay, upstream_client(relay), credential_file=Path(config.run_dir) / CREDENTIAL_FILE)
    try:
        codec = await upstream.call(upstream.settings)
    except Exception as e:  # noqa: BLE001 - unreachable, refused: say so and stop
        print(f"{relay.name}: cannot reach the upstream {relay.upstream}: {e}", flush=True)
        upstream.close()
        return 2
    config = dataclasses.replace(config, codec=codec, name=relay.name)  # its coordinator side's lines name it too
    print(f"{relay.name}: upstream {relay.upstream} ({codec})",
          flush=True)
    return await server.serve(config, ready_file, site=Site(upstream))
