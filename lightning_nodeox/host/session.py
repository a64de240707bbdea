"""A host's rounds while it trains, whichever of Lightning's APIs drives it: what NodeoxStrategy (the Trainer) and
NodeoxFabricStrategy (Fabric) share.

A strategy tells its session where training stands (a step ended, training ended) and what a round's result means
to its user (a progress line, stopping: ``on_round``); the session holds the rest: the host's settings, its ranks
(:mod:`lightning_nodeox.host.ranks`), its link to the run (:mod:`lightning_nodeox.host.link`), the round in flight
(:mod:`lightning_nodeox.host.overlap`), when a round closes (:mod:`lightning_nodeox.host.timing`), the shared values
(:mod:`lightning_nodeox.host.metrics`), the SIGTERM handler (:mod:`lightning_nodeox.host.signals`) and the hash of
the weights held once the run completed (:mod:`lightning_nodeox.host.agreement`).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import fields
from typing import Any

import torch

from ..core.cpu import choose_threads, granted_cpus
from ..core.phases import PhaseRecord
from ..core.ledger_terms import Covered
from ..core.protocol import DataSpec, ValuesReply
from ..core.transport import HostClient
from .agreement import FinalHash
from .link import RunLink, http_client
from .metrics import SharedMetrics
from .overlap import InFlight
from .ranks import HostRanks, OneRank
from .settings import Connection, ConnectionSettings, HostSettings, Overlap
from .signals import SigtermHandler
from .standing import RoundResult
from .tensors import HostTensors, shared_tensors
from .timing import RoundTiming

log = logging.getLogger(__name__)

Ranks = Callable[..., OneRank | HostRanks]  # (exchanged tensors, *, per_step) -> the host's ranks
OnRound = Callable[[RoundResult, int], None]  # (a round's result, the step where it closed)


class HostSession:
    """One host's part in the run, on every rank."""

    def __init__(self, settings: HostSettings, connection: ConnectionSettings, *, cpu_threads: int | None = None,
                 client: Callable[[Connection], HostClient] | None = None) -> None:
        if cpu_threads is not None and cpu_threads < 1:
            raise ValueError(f"cpu_threads must be at least 1 (or None for the CPU quota), got {cpu_threads}")
        self.settings = settings
        self.connection_settings = connection
        self.cpu_threads = cpu_threads
        self.client = client or http_client(settings)
        self.connection: Connection | None = None
        self.ranks: OneRank | HostRanks | None = None  # while training: this host's ranks
        self.link: RunLink | None = None  # rank 0, once joined
        self.overlap: InFlight | None = None  # while training
        self.timing = RoundTiming(settings.round_steps, settings.round_budget)
        self.hash = ""  # ranks other than 0: the model hash rank 0 last shared
        self.phase_records: deque[PhaseRecord] = deque(maxlen=100_000)
        self.last_result: RoundResult | None = None
        self.closed_rounds = 0
        self.metrics = SharedMetrics()
        self.sigterm = SigtermHandler(self.cancel_waits)
        self.final = FinalHash()  # once the run completed: the hash of the weights held
        self.on_round: OnRound = lambda result, step: None
        self.final_at_end = False  # the final round waits for end(), even on a boundary (weight averaging)
        self.data: DataSpec | None = None  # declared at join: the coordinator's data ledger shares out the epochs
        self.covered: Callable[[bool], Covered | None] = lambda pass_ended: None  # a round's data, at its boundary

    @classmethod
    def of(cls, *, cpu_threads: int | None = None, client: Callable[[Connection], HostClient] | None = None,
           **arguments: Any) -> HostSession:
        """A session from NodeoxStrategy's arguments (documented there): where it connects, the rest its settings
        (a name neither knows is a TypeError that names it)."""
        names = {f.name for f in fields(ConnectionSettings)}
        connection = ConnectionSettings(**{k: v for k, v in arguments.items() if k in names})
        settings = {k: v for k, v in arguments.items() if k not in names}
        if "overlap" in settings:
            settings["overlap"] = Overlap.of(settings["overlap"])
        return cls(HostSettings(**settings), connection, cpu_threads=cpu_threads, client=client)

    def size_threads(self, ranks: int, who: str) -> None:
        """Size torch's CPU threads to this rank's share of the CPU quota (the host's ``ranks`` share it), unless
        ``cpu_threads`` was given."""
        threads = self.cpu_threads or min(torch.get_num_threads(), max(1, granted_cpus() // ranks))
        if threads != torch.get_num_threads():
            log.info("%s: torch CPU threads %d -> %d (CPU quota of this process)", who, torch.get_num_threads(),
                     threads)
            torch.set_num_threads(threads)

    # -- joining the run --------------------------------------------------------------------------------------
    def start(self, module: torch.nn.Module, device: torch.device, ranks: Ranks, on_round: OnRound) -> None:
        """Every rank: rank 0 joins the run, every rank takes its model; the first round starts. ``on_round`` is
        called on every rank with each round's result."""
        self.on_round = on_round
        per_step = self.settings.overlap is not Overlap.OFF or self.settings.round_seconds is not None
        self.ranks = ranks([t for _, t in shared_tensors(module)], per_step=per_step)
        self.connection, self.hash = self.ranks.lead(lambda: self._join(module, device))
        self.overlap = InFlight(self.settings.overlap, self.ranks, self.link)
        self.timing.begin()

    def _join(self, module: torch.nn.Module, device: torch.device) -> tuple[Connection, str]:
        """Rank 0: join the run through the client made for this connection, and agree on the starting model."""
        conn = self.connection_settings.resolve()
        codec_threads = 1 if device.type != "cpu" else choose_threads(self.settings.codec_threads,
                                                                      purpose="host codec")
        tensors = HostTensors.of_module(module, fragments=self.settings.fragments)
        client = self.client(conn)
        if self.data is not None:
            client.data = self.data
        self.link = RunLink.join(conn, client, tensors, self.settings,
                                 codec_threads=codec_threads, sigterm=self.sigterm,
                                 listeners=[self.phase_records.append], ranks=self.ranks.size)
        self.ranks.changed = self.link.round.tensors.take_changed  # the join's lead sends them all
        return conn, self.link.round.model_hash

    # -- round boundaries: when (host/timing.py), and overlapped or not (host/overlap.py) -----------------------
    def step_ended(self, step: Callable[[], int], final: Callable[[], bool], *, last: bool = False,
                   pass_ended: bool = False) -> None:
        """Where a batch that stepped may have ended: count it (host/timing.py); fold an arrived sync into the live
        model (overlap); close the round when due (``step()``: where, ``final()``: whether training ends after
        it), or as the final one whether due or not when ``last`` (training ends with this batch). A final round
        is left to :meth:`end` when ``final_at_end``. ``pass_ended``: the batch was its pass's last under the data
        ledger: the round closes whether due or not (the others may wait for what this host holds). On a host of
        several devices rank 0 decides both for all."""
        if self.ranks is None or not self.timing.batch_ended():
            return
        arrived, due = self.ranks.decide(self.overlap.arrived(), self.timing.due())
        if arrived:
            self.took(self.overlap.fold(), self.overlap.step)
        if due or last or pass_ended:
            final_ = last or final()
            if not (final_ and self.final_at_end):
                self.close_round(step(), final=final_, pass_ended=pass_ended)

    def close_round(self, step: int, final: bool = False, pass_ended: bool = False) -> None:
        """Hand the round that closed at ``step`` to the exchange worker; wait for it unless training overlaps. On
        a host of several devices rank 0 does this, with the samples of all ranks, and the others take its result
        and model. Under the data ledger the delta carries what the round trained (``pass_ended``: all the pass
        read)."""
        if self.overlap.pending:  # the previous round's sync has not been folded in yet
            self.took(self.overlap.fold(wait=True), self.overlap.step)
            if self.complete:
                return  # the run completed with that round: there is no next one to send
        timing = self.timing
        samples = self.ranks.total(timing.samples)
        overlapped = self.overlap.overlaps(final=final, closed_rounds=self.closed_rounds)
        covered = self.covered(pass_ended)

        def trained() -> None:
            self.link.trained(timing.start, timing.steps, samples, self.ranks.size)

        if overlapped:
            self.overlap.start(samples, step, begin=trained, metrics=self.metrics.take, covered=covered)
        else:
            def exchange() -> RoundResult:
                trained()
                return self.link.run_round(samples, final, self.metrics.take(), covered)

            self.took(self.ranks.lead(exchange), step)
        self.closed_rounds += 1
        timing.begin(overlapped=overlapped)

    def idle_round(self, step: int) -> bool:
        """Under the data ledger, a host with nothing to read while the others finish the epoch's last units: it
        sends the round they wait for (what it trained since its last boundary: nothing) and waits for it to close,
        or they would wait for it forever. True when the pass must end: the run completed, or training ended."""
        if self.ranks is not None and not self.complete:
            self.close_round(step)
        return self.ranks is None or self.complete

    def exchange_values(self, key: str, payload: object) -> ValuesReply | None:
        """Rank 0 exchanges ``payload`` under ``key`` with the other hosts outside a round
        (:meth:`~lightning_nodeox.host.link.RunLink.exchange_values`), and every rank takes its answer; None before
        joining or after leaving."""
        if self.ranks is None:
            return None
        return self.ranks.lead(lambda: self.link.exchange_values(key, payload), model=False)

    def took(self, result: RoundResult, step: int) -> None:
        """Every rank: a round's result is in. Take the run's shared values, then the strategy's ``on_round``."""
        self.last_result = result
        self.hash = result.model_hash
        self.metrics.update(result.metrics)
        self.on_round(result, step)

    @property
    def complete(self) -> bool:
        """Whether the run has completed (learned at a round boundary: no more rounds)."""
        return self.last_result is not None and self.last_result.complete

    # -- the end ------------------------------------------------------------------------------------------------
    def end(self, step: int) -> None:
        """This host's training ended at ``step``: fold a round in flight, then send its final round (what it
        trained since its last round; never overlapped), unless the run has completed already: then, when
        ``final_at_end``, the host goes back to the run's final model (what its callbacks wrote at the end came
        after it)."""
        if self.overlap is not None and self.overlap.pending:
            self.took(self.overlap.fold(wait=True), self.overlap.step)
        if self.ranks is None:
            return
        if not self.ranks.lead(lambda: self.link.round.complete, model=False):
            self.close_round(step, final=True)
        elif self.final_at_end:
            self.ranks.lead(self._back_to_final_model)

    def _back_to_final_model(self) -> None:
        """Rank 0: the run completed before this host's training ended, so its final round never carried what the
        weight-averaging callbacks wrote into the model at the end: drop it and hold the run's final model."""
        link = self.link
        if link.left:
            return
        log.warning("host %s: the run completed (another host's training ended) before this host's; the weights its "
                    "averaging callbacks wrote at the end of training came after the run's final round and are "
                    "dropped: this host ends on the run's final model %s", self.connection.host_id,
                    link.round.model_hash)
        link.round.tensors.restore_live()

    def check_final(self, module: torch.nn.Module, found: Callable[[], list[str]]) -> None:
        """Rank 0, once the run completed: hash the weights held (``found``: who could have changed them since)."""
        link = self.link
        if link is not None and link.round.complete and not link.left:
            tensors = link.round.tensors
            self.final.check_module(module, self.connection.host_id, link.round.model_hash, tensors.pool, found,
                                    tensors.frozen_changed)

    def close(self, module: torch.nn.Module | None, found: Callable[[], list[str]]) -> None:
        """Hash the weights held (once the run completed), leave the run, and release the host's ranks."""
        self.sigterm.uninstall()
        if self.link is not None:
            if module is not None:
                self.check_final(module, found)
            self.link.leave()
        if self.ranks is not None:
            self.ranks.close()
            self.ranks = None

    def interrupt(self) -> None:
        """Leave the run at once (an exception ended training): the exchange in flight gives up."""
        if self.link is not None:
            self.link.leave(interrupted=True)

    def cancel_waits(self) -> None:
        if self.link is not None:
            self.link.cancel()

    @property
    def model_hash(self) -> str | None:
        """Hash of this host's shared model: as agreed with the coordinator after each round; once the run completed,
        of the weights this host holds."""
        if self.final.value is not None:
            return self.final.value
        return self.link.round.model_hash if self.link is not None else self.hash or None


class SessionReadings:
    """What a user reads of a strategy's session (``self._session``): its settings, and the run as this host sees
    it."""

    _session: HostSession

    @property
    def settings(self) -> HostSettings:
        return self._session.settings

    @property
    def cpu_threads(self) -> int | None:
        return self._session.cpu_threads

    @property
    def connection(self) -> Connection | None:
        """Where this host connected, as whom (once it joined)."""
        return self._session.connection

    @property
    def phase_records(self) -> deque[PhaseRecord]:
        """This host's latest phase records (rank 0)."""
        return self._session.phase_records

    @property
    def last_result(self) -> RoundResult | None:
        """The result of the last round this host applied."""
        return self._session.last_result

    @property
    def metrics(self) -> SharedMetrics:
        """The values shared across hosts (``sync_dist``, ``fabric.all_reduce``): this host's and the run's."""
        return self._session.metrics

    @property
    def model_hash(self) -> str | None:
        """Hash of this host's shared model: as agreed with the coordinator after each round; once the run completed,
        of the weights this host holds (a callback that changed them after the final round is reported)."""
        return self._session.model_hash
