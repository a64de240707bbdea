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
from functools import partial
from pathlib import Path

from ..coordinator import server
from ..coordinator.config import CoordinatorConfig
from ..coordinator.lifecycle import CoordinatorRun
from ..coordinator.rounds import BeforePublish
from ..coordinator.runlog import RunLog
from ..coordinator.state import RunStore, SavedRun
from ..core.pool import WorkerPool
from .close import UpstreamClose
from .config import RelayConfig
from .membership import RelayMembership
from .upstream import Upstream
from .values import RelayValues

CREDENTIAL_FILE = "upstream.json"  # in the run directory, beside state/ (which holds only what its store names)


class RelayRun(CoordinatorRun):
    """A coordinator's run whose rounds close upstream and whose model comes from (or goes to) upstream."""

    def __init__(self, config: CoordinatorConfig, runlog: RunLog, pool: WorkerPool, store: RunStore | None = None,
                 before_publish: BeforePublish | None = None, *, upstream: Upstream) -> None:
        super().__init__(config, runlog, pool, store, before_publish)
        self.upstream = upstream
        loop = asyncio.get_running_loop()  # the upstream's records come from its thread; the run log is the loop's
        upstream.phases.listeners.append(lambda record: loop.call_soon_threadsafe(self.state.record, record))
        self.state.listeners.append(upstream.forward)  # its site's records, upstream
        self.rounds.close_with = UpstreamClose(upstream)
        self.membership = RelayMembership(self.state, self.recovery, self.rounds, upstream)
        self.values = RelayValues(self.state, self.rounds, upstream)
        self._joining: asyncio.Future | None = None  # θ the relay holds, becoming its upstream host's

    async def start(self, saved: SavedRun | None) -> None:
        await super().start(saved)
        if saved is not None:
            self.upstream.restore_credential()  # its id upstream is taken back at once

    async def tick(self) -> None:
        await super().tick()
        hr = self.upstream.round  # the upstream's run complete: its lease is kept until the relay's records are in
        self.upstream.site_live = bool(self.state.hosts.live() or self.rounds.received or (hr and hr.complete))
        if self.membership.upstream_pending() and (self._joining is None or self._joining.done()):
            self._joining = asyncio.ensure_future(self.membership.join_upstream_with_model())

    async def save_at_shutdown(self) -> None:
        """An exchange upstream in flight gives up first (a stopped relay does not wait for its upstream's round;
        its hosts resend their deltas to it once it is back, and the upstream takes its delta once)."""
        self.upstream.client.cancel()
        await super().save_at_shutdown()

    def status(self) -> dict:
        return {**super().status(), "relay": self.upstream.config.relay_id, "upstream": self.upstream.url}

    def close(self) -> None:
        super().close()
        self.upstream.close()


async def serve(config: CoordinatorConfig, relay: RelayConfig, ready_file: Path | None = None) -> int:
    """Run a relay over HTTP until its run completes (or a signal); returns the exit status. Its hosts use the
    upstream's codec (asked of it first)."""
    upstream = Upstream(relay, credential_file=Path(config.run_dir) / CREDENTIAL_FILE)
    try:
        q4 = await upstream.call(upstream.settings)
    except Exception as e:  # noqa: BLE001 - unreachable, refused: say so and stop
        print(f"{relay.name}: cannot reach the upstream {relay.upstream}: {e}", flush=True)
        upstream.close()
        return 2
    config = dataclasses.replace(config, q4=q4, name=relay.name)  # its coordinator side's lines name it too
    print(f"{relay.name}: upstream {relay.upstream} ({q4})",
          flush=True)
    return await server.serve(config, ready_file, make_run=partial(RelayRun, upstream=upstream))
