"""A relay's side as one host of its upstream (the root coordinator, or another relay): its client, its round
(:class:`~lightning_nodeox.host.round.HostRound` over :class:`~lightning_nodeox.relay.tensors.RelayTensors`, with
every recovery rule a host has: rejoin, resend, fetch), its heartbeat and its phase records, which go upstream
(the root's run directory holds them) and into the relay's own run log.

Every call upstream blocks (a :class:`~lightning_nodeox.core.transport.HostClient`'s: HTTP for ``nodeox relay``,
:func:`~lightning_nodeox.relay.run.upstream_client`), so it runs on a thread of its own (:meth:`Upstream.call`),
never on the relay's event loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import torch

from ..coordinator.service import RoundMean
from ..core.files import write_atomic
from ..core.logs import Named
from ..core.modelfile import ModelFileReader, model_header
from ..core.phases import DATA, PhaseLog, PhaseRecord
from ..core.protocol import JoinReply
from ..core.codecs.settings import CodecSettings, settings_from_json
from ..core.specs import TensorSpec
from ..core.transport import HostClient
from ..host.heartbeat import Heartbeat
from ..host.round import HostRound, Into
from ..host.telemetry import TelemetryShipper
from .config import RelayConfig
from .tensors import RelayTensors, read_whole

log = logging.getLogger(__name__)

T = TypeVar("T")
FLUSH_SECONDS = 4.0
HELD_RECORDS = 100_000  # the site's records kept until the relay's first join upstream (then sent, oldest first)


class SiteLease:
    """What the relay's heartbeat beats through: its upstream client, while the site has a live host. A site whose
    hosts are all gone lets its lease upstream run out, so the upstream's rounds no longer wait for it; its next
    heartbeat or delta, once a host is back, makes it expected again. Once the upstream's run is complete the
    lease is kept until the relay leaves (:meth:`Upstream.close`), so the upstream waits for its last records."""

    def __init__(self, upstream: Upstream) -> None:
        self.upstream = upstream
        self.host = upstream.client.host

    @property
    def joined(self) -> bool:
        return self.upstream.client.joined and self.upstream.site_live

    def heartbeat(self) -> float:
        return self.upstream.client.heartbeat()


class Upstream:
    """One relay's link upstream; :attr:`round` is set once the relay's θ is the upstream's model."""

    def __init__(self, config: RelayConfig, client: HostClient, credential_file: Path | None = None) -> None:
        """``client``: the calls upstream, as host ``config.relay_id``; ``credential_file``: where the relay keeps
        its upstream credential, so that a restarted relay takes its id back at once (None: not kept)."""
        self.config = config
        self.log = Named(log, config.name)
        self.client = client
        self.phases = PhaseLog(config.relay_id)
        self.telemetry = TelemetryShipper(self.client, self.client.clock)
        self.phases.listeners.append(self.telemetry)  # and the relay's own run log (RelayRun)
        self.site_live = True  # whether the site has a host in the round (set by the relay's ticker)
        # the relay's lease upstream, while its site has live hosts
        self.heartbeat = Heartbeat(SiteLease(self), name=config.name)
        self.credential_file = credential_file
        self._kept = ""
        self.round: HostRound | None = None
        self.ready = asyncio.Event()  # set once :attr:`round` is
        self._held: deque[PhaseRecord] = deque(maxlen=HELD_RECORDS)  # the site's, until the relay joins upstream
        self._holding = threading.Lock()  # forwarded on the loop, released after a join on the upstream thread
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="nodeox-upstream")
        self._values = ThreadPoolExecutor(1, thread_name_prefix="nodeox-upstream-values")  # never holds a round
        self._data = ThreadPoolExecutor(1, thread_name_prefix="nodeox-upstream-data")  # leases: never behind a round

    @property
    def url(self) -> str:
        return self.client.url

    async def call(self, fn: Callable[..., T], *args) -> T:
        """Run a blocking call upstream on the relay's upstream thread."""
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    async def call_values(self, fn: Callable[..., T], *args) -> T:
        """Run a blocking values exchange upstream on a thread of its own (it may wait long: never behind it)."""
        return await asyncio.get_running_loop().run_in_executor(self._values, fn, *args)

    async def call_data(self, fn: Callable[..., T], *args) -> T:
        """Run a blocking data ledger call upstream (a lease) on a thread of its own: the site's hosts lease while
        the relay's round waits upstream."""
        return await asyncio.get_running_loop().run_in_executor(self._data, fn, *args)

    def forward(self, record: PhaseRecord) -> None:
        """A record of the relay's site (its hosts', its own coordinator side's) goes upstream as ``RELAY/HOST``,
        so the root's run directory holds the whole picture (its upstream phases go as they are, by itself); a
        list (the hosts an aggregate took) goes as text, which is what a record upstream may hold. The site's
        ledger records (``data``) stay in the relay's run log: the root keeps the run's own."""
        if record.host != self.config.relay_id and record.phase != DATA:
            extra = {k: ",".join(map(str, v)) if isinstance(v, (list, tuple)) else v for k, v in record.extra.items()}
            self._ship(dataclasses.replace(record, host=f"{self.config.relay_id}/{record.host}", extra=extra))

    def _ship(self, record: PhaseRecord | None = None) -> None:
        """Records go upstream once the relay has joined it (before, the upstream refuses them: the relay is no
        host of it yet; its coordinator side records from its start, while it waits for its first host): until
        then they are held, and go first after the join."""
        with self._holding:
            if not self.client.joined:
                if record is not None:
                    self._held.append(record)
                return
            while self._held:
                self.telemetry(self._held.popleft())
            if record is not None:
                self.telemetry(record)

    # -- the credential, across restarts ----------------------------------------------------------------------
    def restore_credential(self) -> None:
        """A resumed relay presents its upstream credential again (when it kept one)."""
        path = self.credential_file
        if path is not None and path.exists():
            self.client.credential = self._kept = json.loads(path.read_text())["credential"]

    def keep_credential(self) -> None:
        """Write the upstream credential when a join changed it (atomically, its owner's alone)."""
        path, credential = self.credential_file, self.client.credential
        if path is None or not credential or credential == self._kept:
            return
        write_atomic(path, [json.dumps({"relay": self.config.relay_id, "credential": credential}).encode()])
        self._kept = credential

    # -- blocking calls (on the upstream thread) ----------------------------------------------------------------
    def settings(self) -> CodecSettings:
        """The upstream run's codec, which the relay's hosts must use too (its sync passes down unchanged)."""
        return settings_from_json(self.client.status()["codec"])

    def join(self, specs: tuple[TensorSpec, ...]) -> JoinReply:
        """Join upstream with the site's model's tensors (waiting while another host provides the model)."""
        body = [s.as_json() for s in specs]
        reply = self.client.join(body)
        while reply.retry:
            reply = self.client.join(body)
        self.keep_credential()
        self._ship()  # the records held until this join
        return reply

    def fetch(self) -> torch.Tensor:
        """The upstream's full model, as a model file in memory."""
        return read_whole(self.client.get_model())

    def provide(self, model: RoundMean, round_: int) -> str:
        """Upload the site's model (the upstream asked this relay to provide it); returns the upstream's hash."""
        return self.client.put_model(ModelFileReader(model_header(model.specs, round_, model.hash), model.tensors))

    def attach(self, model: RoundMean, settings: CodecSettings, round_: int, threads: int,
               before_change: Callable[[], None]) -> HostRound:
        """From now on the relay's θ (``model``'s tensors) is its upstream host's, at ``round_``;
        ``before_change()`` runs (on this thread) before anything upstream changes θ."""
        tensors = RelayTensors(model, self.config.name)
        tensors.before_change = before_change
        tensors.allocate(settings, threads)
        hr = HostRound(tensors, self.client, self.phases, codec_threads=threads, name=self.config.name)
        hr.round, hr.model_hash = round_, model.hash
        self.round = hr
        return hr

    def rejoin(self) -> HostRound:
        """A resumed relay's θ is back: join upstream again, giving it back when asked, fetching the upstream's
        when it differs (:meth:`HostRound.rejoin`)."""
        self.round.rejoin(Into.LIVE)
        self.keep_credential()
        self._ship()
        return self.round

    # -- the end ------------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Flush the phase records and leave upstream (the relay's run is over, or it stops); the lease is kept
        until then, so an upstream whose run is complete waits for them."""
        self.client.cancel()  # a values exchange still waiting upstream gives up
        self._ship()
        if self._held:
            self.log.info("%d records of the site were not sent: the relay never joined %s", len(self._held),
                          self.url)
        self.telemetry.close(timeout=FLUSH_SECONDS)
        self.heartbeat.stop()
        if self.client.joined:
            try:
                self.client.leave()
            except Exception as e:  # noqa: BLE001 - leaving is a courtesy; the upstream's lease drops the relay
                self.log.warning("could not tell %s that it left: %s", self.url, e)
        if self.round is not None:
            self.round.close()
        self._thread.shutdown(wait=False)
        self._values.shutdown(wait=False, cancel_futures=True)
        self._data.shutdown(wait=False, cancel_futures=True)
