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
import logging
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

log = logging.getLogger(__name__)

CREDENTIAL_FILE = "upstream.json"  # in the run directory, beside state/ (which holds only what its store names)


class RelayRun(CoordinatorRun):
    """A coordinator's run whose rounds close upstream and whose model comes from (or goes to) upstream."""

    def __init__(self, config: CoordinatorConfig, runlog: RunLog, pool: WorkerPool, store: RunStore | None = None,
                 before_publish: BeforePublish | None = None, *, upstream: Upstream) -> None:
        super().__init__(config, runlog, pool, store, before_publish)
        self.upstream = upstream
        upstream.phases.listeners.append(lambda record: self.state.record(record))  # in its own run log too
        self.state.listeners.append(upstream.forward)  # its site's records, upstream
        self.rounds.close_with = UpstreamClose(upstream)
        self.membership = RelayMembership(self.state, self.recovery, self.rounds, upstream)
        self.values = RelayValues(self.state, self.rounds, upstream)
        self._rejoin: asyncio.Future | bool = False  # resumed: join upstream again once θ is back

    async def start(self, saved: SavedRun | None) -> None:
        await super().start(saved)
        if saved is not None:
            self.upstream.restore_credential()
            self._rejoin = True

    async def tick(self) -> None:
        await super().tick()
        self.upstream.site_live = bool(self.state.hosts.live() or self.rounds.received)
        if self._rejoin is True and self.state.model is not None:
            self._rejoin = asyncio.ensure_future(self._join_again())

    async def save_at_shutdown(self) -> None:
        """An exchange upstream in flight gives up first (a stopped relay does not wait for its upstream's round;
        its hosts resend their deltas to it once it is back, and the upstream takes its delta once)."""
        self.upstream.client.cancel()
        await super().save_at_shutdown()

    async def _join_again(self) -> None:
        """θ of the resumed run is back: the relay's upstream host is it again, joined upstream again."""
        state, upstream = self.state, self.upstream
        model = state.model
        hr = await upstream.call(upstream.attach, model, self.config.q4, state.round, state.pool.threads)
        try:
            await upstream.call(upstream.rejoin)
        except Exception:  # noqa: BLE001 - tried again at the next tick
            log.exception("nodeox relay: joining %s again failed; trying again", upstream.url)
            upstream.round, self._rejoin = None, True
            return
        if hr.model_hash != model.hash:  # the upstream moved on while the relay was away: θ is its model now
            model.hash, model.latest_sync = hr.model_hash, None
            state.round, state.published_round = hr.round, hr.round - 1
        log.info("nodeox relay: joined %s again at round %d (model %s)", upstream.url, hr.round, hr.model_hash)
        upstream.ready.set()
        await state.notify()

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
        print(f"nodeox relay: cannot reach the upstream {relay.upstream}: {e}", flush=True)
        upstream.close()
        return 2
    config = dataclasses.replace(config, q4=q4)
    print(f"nodeox relay {relay.relay_id}: upstream {relay.upstream} ({q4.codec}, block size {q4.block_size})",
          flush=True)
    return await server.serve(config, ready_file, make_run=partial(RelayRun, upstream=upstream))
