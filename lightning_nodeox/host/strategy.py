"""NodeoxStrategy: the Lightning side of local-step training with q4 exchanges through a coordinator.

Each host is its own world: Lightning's barrier, broadcast and reduce never wait on another host, and every
host's rank 0 is its own rank zero (its loggers and checkpoints write). A host of one device is a world of one
(no process group); a host of K devices is Lightning's DDP over its K ranks, of which rank 0 alone exchanges
with the coordinator and the others follow it (:mod:`lightning_nodeox.host.ranks`). After every ``local_steps``
optimizer steps the strategy closes a round; the round logic itself lives in :mod:`lightning_nodeox.host.round`.

Stopping together: when ``fit`` ends on one host (max_steps, max_epochs, early stopping), it sends what it
trained since its last round as its final delta, and that round completes the run: the other hosts stop at
their next round boundary, and every host ends on the same final model (:mod:`lightning_nodeox.host.stopping`).
Values logged with ``sync_dist=True`` are shared across hosts at round boundaries
(:mod:`lightning_nodeox.host.metrics`; on a host of several devices, first reduced across its ranks); under
``nodeox launch`` each host writes into its own folder of the run directory (:mod:`lightning_nodeox.host.machine`);
SIGTERM makes a host leave at once (:mod:`lightning_nodeox.host.signals`).
"""

from __future__ import annotations

import logging
import sys
import time
from collections import deque
from concurrent.futures import Future
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.strategies import DDPStrategy, Strategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.data import extract_batch_size
from typing_extensions import override

from ..core import phases as P
from ..core.cpu import choose_threads, granted_cpus
from ..core.phases import PhaseLog, PhaseRecord
from . import machine
from .agreement import FinalHash
from .client import HttpClient
from .clock import ClockOffset
from .heartbeat import Heartbeat
from .metrics import SharedMetrics
from .progress import RoundProgress
from .ranks import HostRanks, OneRank, WorldOfOne
from .round import HostRound, RoundResult
from .settings import Connection, HostSettings, overlap_mode
from .signals import SigtermHandler, exit_code_for
from .stopping import ends_after_this_batch, steps_taken
from .telemetry import TelemetryShipper
from .tensors import HostTensors, shared_tensors
from .worker import ExchangeWorker

log = logging.getLogger(__name__)

TELEMETRY_FLUSH_SECONDS = 4.0


class NodeoxStrategy(DDPStrategy):
    """Local-step training across hosts: train ``local_steps`` steps alone, then exchange a q4 delta.

    Example::

        trainer = Trainer(strategy=NodeoxStrategy(local_steps=20), callbacks=[PhaseMonitor()])
        trainer = Trainer(strategy=NodeoxStrategy(), devices=8)  # a host of 8 GPUs: DDP inside, one exchange

    A host is one machine (or one process): ``Trainer(devices=K)`` runs Lightning's DDP over its K devices (Lightning
    starts the ranks, or ``torchrun --nproc-per-node K`` does), and the host takes part in the run as one host,
    with one ``NODEOX_HOST_ID``. ``Trainer(num_nodes=...)`` stays 1: machines are joined by the coordinator.

    Args:
        coordinator_url: ``http://HOST:PORT`` of ``nodeox coordinator`` (default: ``NODEOX_COORDINATOR_URL``,
            which ``nodeox launch`` sets).
        local_steps: optimizer steps each host takes alone between exchanges. More steps send fewer bytes per
            sample but let hosts drift further apart; 20 is the study's setting.
        host_id: this host's name in the run, 1 to 64 characters (default: ``NODEOX_HOST_ID``, else the host name).
        token: bearer token, when the coordinator was started with ``--token-file`` (default: ``NODEOX_TOKEN``).
        rounding: ``"nearest"`` or ``"stochastic"`` rounding of the delta's codes (stochastic is unbiased but
            noisier; nearest with error feedback is usually better).
        error_feedback: carry each round's quantization residual into the next round (costs 0.5x the model in
            bf16; turn off only to measure what it buys).
        codec_threads: CPU threads for encoding on a CPU host (default: the CPU quota granted to this process).
        cpu_threads: caps torch's CPU threads for the whole host process (default: the CPU quota).
        telemetry_url: where phase records go (default: the coordinator; ``NODEOX_TELEMETRY_URL``).
        request_timeout: seconds to wait for one answer from the coordinator; raise it for very large models
            on slow links.
        retry_for: seconds to keep retrying while the coordinator does not answer.
        overlap: keep training while a round's exchange is in flight. ``True`` (or ``"eager"``): training goes on
            from this host's own result, and when the sync arrives the live model becomes the new shared model
            plus the progress made since the boundary. ``"delayed"``: training goes on from the round's shared
            model instead. A host waits only if the previous sync has not arrived by its next boundary; costs one
            more copy of the model (the snapshot). The last round at ``fit`` end is never overlapped.
        round_seconds: work to a time budget instead of ``local_steps``: a round closes at the first step after
            this many seconds of training, so a fast host does more steps than a slow one and nobody idles at the
            barrier (deltas are weighted by the samples they saw).
        ddp_kwargs: passed to ``torch.nn.parallel.DistributedDataParallel`` on a host with several devices, e.g.
            ``find_unused_parameters=True``; ignored on one device.
    """

    strategy_name = "nodeox"

    def __init__(
        self,
        *,
        coordinator_url: str | None = None,
        local_steps: int = 20,
        host_id: str | None = None,
        token: str | None = None,
        rounding: str = "nearest",
        error_feedback: bool = True,
        codec_threads: int | None = None,
        cpu_threads: int | None = None,
        telemetry_url: str | None = None,
        request_timeout: float = 120.0,
        retry_for: float = 60.0,
        overlap: bool | str = False,
        round_seconds: float | None = None,
        accelerator=None,
        checkpoint_io=None,
        precision_plugin=None,
        **ddp_kwargs: Any,
    ) -> None:
        super().__init__(accelerator=accelerator, checkpoint_io=checkpoint_io, precision_plugin=precision_plugin,
                         **ddp_kwargs)
        self.settings = HostSettings(local_steps=local_steps, rounding=rounding, error_feedback=error_feedback,
                                     codec_threads=codec_threads, request_timeout=request_timeout,
                                     retry_for=retry_for, overlap=overlap_mode(overlap), round_seconds=round_seconds)
        self._given = dict(coordinator_url=coordinator_url, host_id=host_id, token=token, telemetry_url=telemetry_url)
        if cpu_threads is not None and cpu_threads < 1:
            raise ValueError(f"cpu_threads must be at least 1 (or None for the CPU quota), got {cpu_threads}")
        self.cpu_threads = cpu_threads
        self.connection: Connection | None = None
        self._ranks: OneRank | HostRanks | None = None  # while fitting: this host's ranks
        self._hash = ""  # ranks other than 0: the model hash rank 0 last shared
        self._pending = False  # an overlapped round's exchange is in flight (known on every rank)
        self.phase_records: deque[PhaseRecord] = deque(maxlen=100_000)
        self.last_result: RoundResult | None = None
        self._round: HostRound | None = None
        self._worker: ExchangeWorker | None = None
        self._in_flight: Future | None = None  # overlap: the exchange of the round that closed last
        self._in_flight_round = 0
        self._in_flight_step = 0  # where the overlapped round closed (for its progress line)
        self._telemetry: TelemetryShipper | None = None
        self._heartbeat: Heartbeat | None = None
        self._phases: PhaseLog | None = None
        self._depth = 0
        self._stepped = False
        self._steps = 0
        self._samples = 0
        self._round_start = 0.0
        self._deadline = 0.0  # with round_seconds: when the current round closes
        self._closed_rounds = 0
        self._left = False
        self.metrics = SharedMetrics()
        self._progress: RoundProgress | None = None  # rank 0
        self._sigterm = SigtermHandler(self._cancel_waits)
        self._final = FinalHash()  # once the run completed: the hash of the weights held (host/agreement.py)

    # -- devices and ranks ------------------------------------------------------------------------------------
    @property
    def _one_device(self) -> bool:
        return not self.parallel_devices or len(self.parallel_devices) == 1

    @property
    @override
    def root_device(self) -> torch.device:
        devices = self.parallel_devices
        if not devices:
            return torch.device("cpu")
        return devices[0] if len(devices) == 1 else devices[self.local_rank]

    @override
    def set_world_ranks(self) -> None:
        """One device: rank 0 of a world of one, whatever launched this process. Several: the ranks of Lightning's
        DDP world, which must be this one machine."""
        if self._one_device:  # its local rank: its place among the hosts on this machine (prepare_data)
            self.cluster_environment = WorldOfOne(machine.local_rank())
        elif self.num_nodes != 1:
            raise ValueError(
                f"NodeoxStrategy joins machines through its coordinator: a host is one machine, got "
                f"Trainer(num_nodes={self.num_nodes}). Use Trainer(devices=K, num_nodes=1, strategy=NodeoxStrategy()) "
                "and start each machine as its own host with its own NODEOX_HOST_ID (on SLURM: one task per node "
                "running `torchrun --standalone --nproc-per-node K`; see docs/clusters.md)")
        super().set_world_ranks()

    @override
    def _configure_launcher(self) -> None:
        if self._one_device:
            self._launcher = None  # nothing to start: this process is the host
        else:
            super()._configure_launcher()

    @override
    def setup_environment(self) -> None:
        """Use the run folder, size torch's CPU threads to this rank's share of the CPU quota; on several devices,
        join the host's process group."""
        trainer = self.lightning_module.trainer
        machine.use_run_folder(trainer, Connection.host_id_from_env(self._given["host_id"]))
        if self._one_device:  # each host loads its own data: no DistributedSampler (Lightning has no public switch)
            trainer._accelerator_connector.use_distributed_sampler = False
        ranks = len(self.parallel_devices or ()) or 1  # the host's ranks share this machine's CPU quota
        threads = self.cpu_threads or min(torch.get_num_threads(), max(1, granted_cpus() // ranks))
        if threads != torch.get_num_threads():
            log.info("NodeoxStrategy: torch CPU threads %d -> %d (CPU quota of this process)",
                     torch.get_num_threads(), threads)
            torch.set_num_threads(threads)
        super().setup_environment()

    @override
    def setup_distributed(self) -> None:
        if self._one_device:
            self.set_world_ranks()  # rank zero of its own world: its loggers write; no process group
        else:
            super().setup_distributed()

    @override
    def barrier(self, name: str | None = None, *args: Any, **kwargs: Any) -> None:
        """Hosts never wait on each other. One device: only at ``pre_setup`` do the hosts of one machine wait until
        its local rank 0 has run ``prepare_data``. Several: the host's ranks wait for each other (DDP)."""
        if not self._one_device:
            super().barrier(name, *args, **kwargs)
        elif name == "pre_setup":
            machine.after_prepare_data(self.lightning_module.trainer, self.local_rank)

    @override
    def broadcast(self, obj, src: int = 0):
        return obj if self._one_device else super().broadcast(obj, src)

    @property
    def is_distributed(self) -> bool:
        """True, so that Lightning hands values logged with ``sync_dist=True`` to :meth:`reduce`."""
        return True

    @override
    def reduce(self, tensor, group: Any = None, reduce_op: Any = "mean"):
        """A value logged with ``sync_dist=True``: returns at once, with the mean across hosts as of the last round
        (this host's own value until the value was first shared); see :mod:`lightning_nodeox.host.metrics`. On a
        host of several devices the value is first reduced across its ranks (so every rank holds the host's)."""
        def across_ranks(t):
            return t if self._one_device else DDPStrategy.reduce(self, t, group, reduce_op)

        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None or trainer.state.fn != TrainerFn.FITTING:
            return across_ranks(tensor)  # validate/test/predict: no rounds
        return self.metrics.reduce(sys._getframe(1), tensor, reduce_op, recording=not trainer.sanity_checking,
                                   sync=across_ranks)

    @override
    def all_gather(self, tensor: torch.Tensor, group: Any = None, sync_grads: bool = False) -> torch.Tensor:
        return tensor if self._one_device else super().all_gather(tensor, group, sync_grads)

    @override
    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return model if self._one_device else super()._setup_model(model)

    # -- joining the run --------------------------------------------------------------------------------------
    @override
    def setup(self, trainer: Trainer) -> None:
        """One device: set up as Lightning's single-device strategy does (the loaders keep their own samplers).
        Several: as DDP does (the model wrapped, a DistributedSampler splitting the host's data among its ranks).
        Then, when fitting, rank 0 joins the run and every rank takes its model."""
        if self._one_device:
            Strategy.setup(self, trainer)
        else:
            super().setup(trainer)
        if trainer.state.fn != TrainerFn.FITTING:
            return
        if self._one_device:
            self._ranks = OneRank()
        else:
            per_step = self.settings.overlap is not None or self.settings.round_seconds is not None
            self._ranks = HostRanks([t for _, t in shared_tensors(self.lightning_module)], per_step=per_step)
        self.connection, self._hash = self._ranks.lead(self._join)
        self._round_start = time.time()
        self._schedule_deadline(overlapped=False)

    def _join(self) -> tuple[Connection, str]:
        """Rank 0: join the run and agree on the starting model."""
        settings = self.settings
        conn = Connection.resolve(**self._given)
        clock = ClockOffset()
        client = HttpClient(conn.coordinator_url, host=conn.host_id, token=conn.token, ca_file=conn.ca_file,
                            read_timeout=settings.request_timeout, retry_for=settings.retry_for, clock=clock)
        # the token and the host's credential go to the coordinator only, never to another telemetry address
        telemetry_client = client if conn.telemetry_url is None else HttpClient(
            conn.telemetry_url, host=conn.host_id, ca_file=conn.ca_file, retry_for=0.0)
        self._phases = PhaseLog(conn.host_id)
        self._telemetry = TelemetryShipper(telemetry_client, clock)
        self._progress = RoundProgress(conn.host_id)
        self._phases.listeners += [self.phase_records.append, self._telemetry, self._progress]
        codec_threads = 1 if self.root_device.type != "cpu" else choose_threads(settings.codec_threads,
                                                                                   purpose="host codec")
        tensors = HostTensors(shared_tensors(self.lightning_module))
        self._round = HostRound(tensors, client, self._phases, rounding=settings.rounding,
                                error_feedback=settings.error_feedback, codec_threads=codec_threads)
        log.info("NodeoxStrategy: host %s joining %s (%d tensors, %.1f MB, local_steps=%d, %d rank%s)", conn.host_id,
                 conn.coordinator_url, len(tensors.live), tensors.nbytes / 1e6, settings.local_steps,
                 self._ranks.size, "" if self._ranks.size == 1 else "s")
        self._heartbeat = Heartbeat(client)  # keeps this host's lease from its join's answer until it leaves
        try:
            self._round.join()
        except BaseException:
            self._heartbeat.stop()
            self._telemetry.close(timeout=2.0)
            self._round.close()
            raise
        self._worker = ExchangeWorker()
        return conn, self._round.model_hash

    # -- round boundaries -------------------------------------------------------------------------------------
    @override
    def training_step(self, *args: Any, **kwargs: Any):
        self._depth += 1
        try:
            output = super().training_step(*args, **kwargs)
        finally:
            self._depth -= 1
        self._samples += _batch_size(args[0] if args else kwargs.get("batch"))
        self._at_batch_end()
        return output

    @override
    def optimizer_step(self, optimizer, closure, model: LightningModule | None = None, **kwargs: Any):
        self._depth += 1
        try:
            output = super().optimizer_step(optimizer, closure, model, **kwargs)
        finally:
            self._depth -= 1
        self._stepped = True
        self._at_batch_end()
        return output

    def _at_batch_end(self) -> None:
        """Count a batch that stepped (once, however many optimizers stepped); fold an arrived sync into the live
        model (overlap); close the round when due. On a host of several devices rank 0 decides both for all."""
        if self._depth or not self._stepped or self._ranks is None:
            return
        self._stepped = False
        self._steps += 1
        arrived = self._in_flight is not None and self._in_flight.done()
        arrived, due = self._ranks.decide(arrived, self._round_due())
        if arrived:
            self._fold()
        if due:
            self._close_round(final=ends_after_this_batch(self.lightning_module.trainer))

    def _round_due(self) -> bool:
        if self.settings.round_seconds is not None:
            return time.time() >= self._deadline
        return self._steps >= self.settings.local_steps

    def _close_round(self, final: bool = False) -> None:
        """Hand the round to the exchange worker; wait for it unless training overlaps. The first round is never
        overlapped (the hosts' rounds start together after it, whatever their start-up took), nor the final one.
        On a host of several devices rank 0 does this, with the samples of all ranks, and the others take its
        result and model."""
        if self._pending:  # overlap: the previous round's sync has not been folded in yet
            self._wait_and_fold()
        samples = self._ranks.total(self._samples)
        mode = self.settings.overlap
        overlapped = mode is not None and not final and self._closed_rounds > 0
        if overlapped:
            self._ranks.lead(lambda: self._start_round(samples, mode), model=mode == "delayed")
            self._pending = True
            self._in_flight_step = steps_taken(self.lightning_module.trainer)
        else:
            self.last_result = self._ranks.lead(lambda: self._run_round(samples, final))
            self._hash = self.last_result.model_hash
            self._after_round(self.last_result, steps_taken(self.lightning_module.trainer))
        self._closed_rounds += 1
        self._steps = self._samples = 0
        self._round_start = time.time()
        self._schedule_deadline(overlapped)

    def _schedule_deadline(self, overlapped: bool) -> None:
        """With ``round_seconds``: a round that waited for its sync starts a budget of its own; overlapped rounds
        keep to a fixed schedule (boundaries ``round_seconds`` apart), so time lost at a boundary or to a step that
        overran is made up and the hosts' boundaries do not drift apart."""
        budget = self.settings.round_seconds
        if budget is None:
            return
        self._deadline = self._deadline + budget if overlapped else self._round_start + budget
        if self._deadline <= self._round_start:  # behind by a whole round: start afresh
            self._deadline = self._round_start + budget

    def _emit_train(self, samples: int) -> None:
        self._phases.emit(PhaseRecord(self._round.round, self.connection.host_id, P.TRAIN, self._round_start,
                                      time.time(), extra={"steps": self._steps, "samples": samples,
                                                          "ranks": self._ranks.size}))

    def _run_round(self, samples: int, final: bool) -> RoundResult:
        """Rank 0: the whole exchange, while training waits."""
        self._emit_train(samples)
        return self._sigterm.wait(self._worker.submit(self._round.run_round, samples, final, self.metrics.take()))

    def _start_round(self, samples: int, mode: str) -> None:
        """Rank 0: set the round's snapshot aside and start its exchange; training goes on."""
        self._emit_train(samples)
        self._round.tensors.take_snapshot(restart_from_base=mode == "delayed")
        self._in_flight_round = self._round.round
        self._in_flight = self._worker.submit(self._round.run_overlapped, samples, mode == "delayed",
                                              self.metrics.take())

    def _wait_and_fold(self) -> None:
        self._fold(wait=True)

    def _fold(self, wait: bool = False) -> None:
        """The overlapped round's sync has arrived (``wait``: training waits for it first): the live model becomes
        it plus the progress made since (or just it, when the run completed with that round: every host ends on
        the same model). Rank 0 folds; the other ranks take its folded model."""
        self.last_result = self._ranks.lead(lambda: self._fold_in(wait))
        self._hash = self.last_result.model_hash
        self._pending = False
        self._after_round(self.last_result, self._in_flight_step)

    def _fold_in(self, wait: bool) -> RoundResult:
        if wait:
            with self._phases.timed(self._in_flight_round, P.WAIT):
                self._sigterm.wait(self._in_flight)
        result = self._in_flight.result()
        self._in_flight = None
        with self._phases.timed(result.round, P.FOLD):
            if result.complete:
                self._round.tensors.restore_live()
            else:
                self._round.tensors.fold()
        return result

    def _after_round(self, result: RoundResult, step: int) -> None:
        """Every rank: take the run's shared values, show the round's progress line (rank 0; ``step``: where the
        round closed), and stop when the run is complete."""
        trainer = self.lightning_module.trainer
        self.metrics.update(result.metrics)
        if self._progress is not None:
            self._progress.show(trainer, self._progress.line(result.round, step, result.model_hash,
                                                             trainer.callback_metrics, result.complete))
        if result.complete:
            trainer.should_stop = True  # a host's training ended: every host stops at this round

    @override
    def on_train_start(self) -> None:
        self._sigterm.install()  # after Lightning's own SIGTERM handler, which it chains
        super().on_train_start()

    def _cancel_waits(self) -> None:
        if self._round is not None:
            self._round.client.cancel()

    @override
    def on_train_end(self) -> None:
        """This host's final round (what it trained since its last round; never overlapped), unless the run has
        completed already (another host's training ended, or this host's last batch closed its final round); then
        the run's values of the metrics logged with ``sync_dist=True`` go into ``trainer.callback_metrics``."""
        if self._pending:
            self._wait_and_fold()
        if self._ranks is not None and not self._ranks.lead(lambda: self._round.complete, model=False):
            self._close_round(final=True)
        self.metrics.publish(self.lightning_module.trainer.callback_metrics)
        self._check_final()
        super().on_train_end()

    def _check_final(self) -> None:
        """Rank 0, once the run completed: hash the weights held (a callback may have changed them since)."""
        if self._round is not None and self._round.complete and not self._left:
            self._final.check(self.lightning_module.trainer, self.connection.host_id, self._round.model_hash,
                              self._round.tensors.pool)

    @override
    def teardown(self) -> None:
        self._sigterm.uninstall()
        self._check_final()
        self._leave()
        if self._ranks is not None:
            self._ranks.close()
            self._ranks = None
        super().teardown()

    @override
    def on_exception(self, exception: BaseException) -> None:
        exit_code_for(exception)
        self._leave(interrupted=True)
        super().on_exception(exception)

    def _leave(self, interrupted: bool = False) -> None:
        """Flush this host's phase records and tell the coordinator it left, within about 10 s (the flush, then
        the goodbye's own deadline), whether training ended or failed: cancelling stops only the exchange in
        flight, not the goodbye, so other hosts never wait for a host that is gone."""
        if self._worker is None or self._left:
            return
        self._left = True
        if interrupted:
            self._round.client.cancel()  # an exchange in flight gives up instead of waiting for its sync
        self._worker.close(wait=not interrupted)
        if not interrupted:
            self._round.close()
        self._heartbeat.stop()
        self._telemetry.close(timeout=TELEMETRY_FLUSH_SECONDS)  # first: the coordinator may stop once all left
        try:
            self._round.client.leave()
        except Exception as e:  # noqa: BLE001 - leaving is a courtesy; the coordinator's lease drops the host
            log.warning("NodeoxStrategy: could not tell the coordinator that host %s left: %s",
                        self.connection.host_id, e)

    @property
    def model_hash(self) -> str | None:
        """Hash of this host's shared model: as agreed with the coordinator after each round; once the run completed,
        of the weights this host holds (a callback that changed them after the final round is reported)."""
        if self._final.value is not None:
            return self._final.value
        return self._round.model_hash if self._round is not None else self._hash or None

    @classmethod
    @override
    def register_strategies(cls, strategy_registry) -> None:
        strategy_registry.register(cls.strategy_name, cls, description="Local-step training with q4 deltas "
                                   "through a nodeox coordinator", override=True)


def _batch_size(batch: Any) -> int:
    try:
        return int(extract_batch_size(batch))
    except Exception:  # noqa: BLE001 - an unusual batch counts as one sample
        return 1


NodeoxStrategy.register_strategies(StrategyRegistry)
