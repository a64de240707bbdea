"""Rank 0's link to the run: its client, its round, the exchange worker, its phase records (kept, shipped to the
coordinator, summed into progress lines) and its heartbeat; opened by joining, closed by leaving.

Only rank 0 of a host holds one; the other ranks follow rank 0 through :mod:`lightning_nodeox.host.ranks`.
A coordinator that stops answering mid-run ends the exchange with :class:`~lightning_nodeox.host.ending.RunNotCompleted`,
and a join to a run this process saw complete, whose coordinator is gone, with
:class:`~lightning_nodeox.host.ending.RunCompleted` (:mod:`lightning_nodeox.host.ending`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager

from ..core import phases as P
from ..core.ledger_terms import Covered, LeaseReply
from ..core.phases import PhaseLog, PhaseRecord
from ..core.protocol import Refusal, Unreachable, ValuesReply
from ..core.transport import HostClient
from .client import HttpClient
from .ending import completed_at, note_completed, run_not_completed
from .heartbeat import Heartbeat
from .progress import RoundProgress
from .round import HostRound
from .settings import RETRY_FOR, Connection, HostSettings
from .signals import SigtermHandler
from .standing import RoundResult
from .telemetry import TelemetryShipper
from .tensors import HostTensors
from .worker import ExchangeWorker

log = logging.getLogger(__name__)

TELEMETRY_FLUSH_SECONDS = 4.0

ClientFactory = Callable[[Connection], HostClient]


def http_client(settings: HostSettings) -> ClientFactory:
    """The default transport: HTTP(S) to the connection's coordinator, with the settings' timeouts."""

    def make(conn: Connection) -> HostClient:
        return HttpClient(conn.coordinator_url, host=conn.host_id, token=conn.token, ca_file=conn.ca_file,
                          read_timeout=settings.request_timeout, retry_for=settings.retry_for)

    return make


def telemetry_client(conn: Connection, client: HostClient) -> HostClient:
    """Where phase records go: the coordinator's client, or (``telemetry_url``) an HTTP client of their own that
    carries neither the token nor the host's credential, which go to the coordinator only."""
    if conn.telemetry_url is None:
        return client
    return HttpClient(conn.telemetry_url, host=conn.host_id, ca_file=conn.ca_file, retry_for=0.0)


class RunLink:
    """A joined host's exchange with the coordinator, as rank 0 runs it."""

    def __init__(self, conn: Connection, round_: HostRound, sigterm: SigtermHandler,
                 listeners: list[Callable[[PhaseRecord], None]], telemetry: HostClient,
                 retry_for: float = RETRY_FOR) -> None:
        self.connection = conn
        self.retry_for = retry_for  # how long values are posted again to a coordinator that restarted
        self.round = round_
        self.sigterm = sigterm
        self.telemetry = TelemetryShipper(telemetry, round_.client.clock)
        self.progress = RoundProgress(conn.host_id)
        round_.phases.listeners += [*listeners, self.telemetry, self.progress]
        self.heartbeat = Heartbeat(round_.client)  # keeps this host's lease from its join's answer until it leaves
        self.worker: ExchangeWorker | None = None
        self.steps = 0  # training steps of the rounds this host closed
        self._left = False
        self._late_values = False  # said once: values this host posted after the other hosts had moved on
        self._exchange: Future | None = None  # the exchange last handed to the worker

    @classmethod
    def join(cls, conn: Connection, client: HostClient, tensors: HostTensors, settings: HostSettings, *,
             codec_threads: int, sigterm: SigtermHandler, listeners: list[Callable[[PhaseRecord], None]],
             ranks: int) -> RunLink:
        """Join the run and agree on the starting model; a failed join leaves nothing running."""
        completed = completed_at(conn.coordinator_url)
        if completed is not None and not _answers(client):
            raise completed.error() from None
        round_ = HostRound(tensors, client, PhaseLog(conn.host_id), rounding=settings.rounding,
                           error_feedback=settings.error_feedback, codec_threads=codec_threads)
        link = cls(conn, round_, sigterm, listeners, telemetry_client(conn, client), settings.retry_for)
        log.info("NodeoxStrategy: host %s joining %s (%d tensors, %.1f MB, local_steps=%d%s, %d rank%s)", conn.host_id,
                 conn.coordinator_url, len(tensors.live), tensors.nbytes / 1e6, settings.local_steps,
                 f", fragments={settings.fragments}" if settings.fragments > 1 else "", ranks, "" if ranks == 1 else "s")
        try:
            round_.join()
        except BaseException:
            link.heartbeat.stop()
            link.telemetry.close(timeout=2.0)
            round_.close()
            raise
        link.worker = ExchangeWorker()
        return link

    @property
    def phases(self) -> PhaseLog:
        return self.round.phases

    def trained(self, start: float, steps: int, samples: int, ranks: int) -> None:
        """The round's training phase, from ``start`` until now."""
        self.steps += steps
        self.phases.emit(PhaseRecord(self.round.round, self.connection.host_id, P.TRAIN, start, time.time(),
                                     extra={"steps": steps, "samples": samples, "ranks": ranks}))

    def submit(self, fn: Callable, *args) -> Future:
        """Run ``fn(*args)`` on the exchange worker."""
        self._exchange = self.worker.submit(fn, *args)
        return self._exchange

    def wait(self, future: Future):
        """The exchange's result, given up at once on SIGTERM."""
        with self.standing():
            return self.sigterm.wait(future)

    def result(self, future: Future):
        """The result of an exchange that has finished."""
        with self.standing():
            return future.result()

    @contextmanager
    def standing(self) -> Iterator[None]:
        """Around an exchange: a coordinator that stopped answering raises
        :class:`~lightning_nodeox.host.ending.RunNotCompleted`, saying where this host stood; a run that completed
        is noted, for a later ``fit`` of this process."""
        round_ = self.round
        try:
            yield
        except Unreachable as e:
            raise run_not_completed(self.connection.host_id, self.connection.coordinator_url, round_.round,
                                    self.steps, round_.model_hash, e) from e
        if round_.complete:
            note_completed(self.connection.coordinator_url, round_.round - 1, round_.model_hash)

    def lease(self, epoch: int | None, units: int) -> LeaseReply:
        """Data units for this host under the ledger, from the training thread (a coordinator that stopped
        answering ends the fit with :class:`~lightning_nodeox.host.ending.RunNotCompleted`, as an exchange does)."""
        with self.standing():
            return self.round.lease(epoch, units)

    @property
    def left(self) -> bool:
        """Whether :meth:`leave` ran (this host takes no further part)."""
        return self._left

    def run_round(self, samples: int, final: bool, metrics: dict[str, list],
                  covered: Covered | None = None) -> RoundResult:
        """The whole exchange, while training waits (``covered``: the data it trained, under the data ledger)."""
        return self.wait(self.submit(self.round.run_round, samples, final, metrics, covered))

    def exchange_values(self, key: str, payload: object) -> ValuesReply | None:
        """Values exchanged with the other hosts outside a round (an epoch's values, a torchmetrics state), from the
        training thread; None once this host left, or when the coordinator refuses them (the values stay own). A
        coordinator that restarted is joined again (by the exchange in flight, if any) and the values posted
        again, for up to ``retry_for`` seconds."""
        if self._left:
            return None
        host = self.connection.host_id
        with self.standing():
            try:
                reply = self.round.exchange_values(key, payload, retry_for=self.retry_for, joins=self._no_exchange)
            except Refusal as e:  # e.g. another refusal, or a coordinator that still does not know this host
                log.warning("NodeoxStrategy: the coordinator refused values %s (%s); host %s uses its own", key, e,
                            host)
                return None
        if host not in reply.hosts and not self._late_values:
            self._late_values = True
            log.warning("NodeoxStrategy: host %s reached %s after the other hosts had moved on (hosts with uneven "
                        "batches per epoch); it takes their values without its own (said once)", host, key)
        return reply

    def _no_exchange(self) -> bool:
        """Whether no exchange is in flight on the worker (the training side may join again itself)."""
        return self._exchange is None or self._exchange.done()

    def cancel(self) -> None:
        """Make the exchange's calls in progress give up."""
        self.round.client.cancel()

    def leave(self, interrupted: bool = False) -> None:
        """Flush this host's phase records and tell the coordinator it left, within about 10 s (the flush, then
        the goodbye's own deadline), whether training ended or failed: cancelling stops only the exchange in
        flight, not the goodbye, so other hosts never wait for a host that is gone."""
        if self.worker is None or self._left:
            return
        self._left = True
        if interrupted:
            self.cancel()  # an exchange in flight gives up instead of waiting for its sync
        self.worker.close(wait=not interrupted)
        if not interrupted:
            self.round.close()
        self.heartbeat.stop()
        self.telemetry.close(timeout=TELEMETRY_FLUSH_SECONDS)  # first: the coordinator may stop once all left
        try:
            self.round.client.leave()
        except Exception as e:  # noqa: BLE001 - leaving is a courtesy; the coordinator's lease drops the host
            log.warning("NodeoxStrategy: could not tell the coordinator that host %s left: %s",
                        self.connection.host_id, e)


def _answers(client: HostClient) -> bool:
    """Whether anything answers at the client's coordinator (one try: a refusal is an answer)."""
    try:
        client.heartbeat()
    except Unreachable:
        return False
    except Exception:  # noqa: BLE001 - a refusal: a coordinator is there
        return True
    return True
