"""NodeoxStrategy: the Lightning side of local-step training with q4 exchanges through a coordinator.

Each host is its own world of one: Lightning's barrier, broadcast and reduce never wait on another host,
and every host is its own rank zero (its loggers and checkpoints write). After every ``local_steps``
optimizer steps the strategy closes a round; the round logic itself lives in :mod:`lightning_nodeox.host.round`.

The last, partial round: when ``fit`` ends, each host sends what it trained since its last round (possibly
nothing) as its final delta, then applies every remaining sync until all hosts have finished, so every host
ends on the same final model.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.strategies import SingleDeviceStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.data import extract_batch_size
from lightning_utilities.core.rank_zero import rank_zero_only
from typing_extensions import override

from ..core import phases as P
from ..core.cpu import choose_threads, granted_cpus
from ..core.phases import PhaseLog, PhaseRecord
from .client import HttpClient
from .clock import ClockOffset
from .heartbeat import Heartbeat
from .round import HostRound, RoundResult
from .settings import Connection, HostSettings
from .telemetry import TelemetryShipper
from .tensors import HostTensors, shared_tensors
from .worker import ExchangeWorker

log = logging.getLogger(__name__)

TELEMETRY_FLUSH_SECONDS = 4.0


class NodeoxStrategy(SingleDeviceStrategy):
    """Local-step training across hosts: train ``local_steps`` steps alone, then exchange a q4 delta.

    Example::

        trainer = Trainer(strategy=NodeoxStrategy(local_steps=20), callbacks=[PhaseMonitor()])

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
        accelerator=None,
        checkpoint_io=None,
        precision_plugin=None,
    ) -> None:
        super().__init__(device="cpu", accelerator=accelerator, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)
        self.settings = HostSettings(local_steps=local_steps, rounding=rounding, error_feedback=error_feedback,
                                     codec_threads=codec_threads, request_timeout=request_timeout,
                                     retry_for=retry_for)
        self._given = dict(coordinator_url=coordinator_url, host_id=host_id, token=token, telemetry_url=telemetry_url)
        if cpu_threads is not None and cpu_threads < 1:
            raise ValueError(f"cpu_threads must be at least 1 (or None for the CPU quota), got {cpu_threads}")
        self.cpu_threads = cpu_threads
        self.parallel_devices: list[torch.device] | None = None  # set by the Trainer's accelerator connector
        self.connection: Connection | None = None
        self.phase_records: deque[PhaseRecord] = deque(maxlen=100_000)
        self.last_result: RoundResult | None = None
        self._round: HostRound | None = None
        self._worker: ExchangeWorker | None = None
        self._telemetry: TelemetryShipper | None = None
        self._heartbeat: Heartbeat | None = None
        self._phases: PhaseLog | None = None
        self._depth = 0
        self._stepped = False
        self._steps = 0
        self._samples = 0
        self._round_start = 0.0
        self._left = False

    # -- devices and ranks ------------------------------------------------------------------------------------
    @property
    @override
    def root_device(self) -> torch.device:
        return self.parallel_devices[0] if self.parallel_devices else self._root_device

    @override
    def setup_environment(self) -> None:
        """Make this process its own rank zero and size torch's CPU threads to the CPU quota."""
        if self.parallel_devices and len(self.parallel_devices) > 1:
            raise ValueError(
                f"NodeoxStrategy runs one device per host process, got {len(self.parallel_devices)} devices; "
                "use Trainer(devices=1, strategy=NodeoxStrategy()) and start one host per GPU "
                "(`nodeox launch` gives each host its own GPU)")
        rank_zero_only.rank = 0
        threads = self.cpu_threads or min(torch.get_num_threads(), granted_cpus())
        if threads != torch.get_num_threads():
            log.info("NodeoxStrategy: torch CPU threads %d -> %d (CPU quota of this process)",
                     torch.get_num_threads(), threads)
            torch.set_num_threads(threads)
        super().setup_environment()

    # -- joining the run --------------------------------------------------------------------------------------
    @override
    def setup(self, trainer: Trainer) -> None:
        super().setup(trainer)
        if trainer.state.fn != TrainerFn.FITTING:
            return
        settings = self.settings
        self.connection = conn = Connection.resolve(**self._given)
        clock = ClockOffset()
        client = HttpClient(conn.coordinator_url, host=conn.host_id, token=conn.token,
                            read_timeout=settings.request_timeout, retry_for=settings.retry_for, clock=clock)
        # the token goes to the coordinator only, never to another telemetry address
        telemetry_client = client if conn.telemetry_url is None else HttpClient(
            conn.telemetry_url, host=conn.host_id, retry_for=0.0)
        self._phases = PhaseLog(conn.host_id)
        self._telemetry = TelemetryShipper(telemetry_client, clock)
        self._phases.listeners += [self.phase_records.append, self._telemetry]
        codec_threads = 1 if self.root_device.type != "cpu" else choose_threads(settings.codec_threads,
                                                                                   purpose="host codec")
        tensors = HostTensors(shared_tensors(self.lightning_module))
        self._round = HostRound(tensors, client, self._phases, rounding=settings.rounding,
                                error_feedback=settings.error_feedback, codec_threads=codec_threads)
        log.info("NodeoxStrategy: host %s joining %s (%d tensors, %.1f MB, local_steps=%d)", conn.host_id,
                 conn.coordinator_url, len(tensors.live), tensors.nbytes / 1e6, settings.local_steps)
        self._heartbeat = Heartbeat(client)  # keeps this host's lease, from before it joins until it leaves
        try:
            self._round.join()
        except BaseException:
            self._heartbeat.stop()
            self._telemetry.close(timeout=2.0)
            self._round.close()
            raise
        self._worker = ExchangeWorker()
        self._round_start = time.time()

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
        """Count a batch that stepped (once, however many optimizers stepped); close the round when due."""
        if self._depth or not self._stepped or self._worker is None:
            return
        self._stepped = False
        self._steps += 1
        if self._steps >= self.settings.local_steps:
            self._close_round(final=False)

    def _close_round(self, final: bool) -> RoundResult:
        now = time.time()
        self._phases.emit(PhaseRecord(self._round.round, self.connection.host_id, P.TRAIN, self._round_start, now,
                                      extra={"steps": self._steps, "samples": self._samples}))
        result = self._worker.submit(self._round.run_round, self._samples, final).result()
        self.last_result = result
        self._steps = self._samples = 0
        self._round_start = time.time()
        return result

    @override
    def on_train_end(self) -> None:
        """The last, partial round (possibly empty), then every remaining sync until all hosts finish."""
        if self._worker is not None and not self._round.complete:
            result = self._close_round(final=True)
            log.info("NodeoxStrategy: host %s finished after round %d on model %s", self.connection.host_id,
                     result.round, result.model_hash)
        super().on_train_end()

    @override
    def teardown(self) -> None:
        self._leave()
        super().teardown()

    @override
    def on_exception(self, exception: BaseException) -> None:
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
        """Hash of this host's current shared model (as agreed with the coordinator)."""
        return None if self._round is None else self._round.model_hash

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
