"""NodeoxStrategy: the Lightning side of local-step training with q4 exchanges through a coordinator.

Each host is its own world of one: Lightning's barrier, broadcast and reduce never wait on another host,
and every host is its own rank zero (its loggers and checkpoints write). After every ``local_steps``
optimizer steps the strategy closes a round; the round logic itself lives in :mod:`lightning_nodeox.exchange`.

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

from . import phases as P
from .client import ClockOffset, CoordinatorClient
from .cpu import choose_threads, granted_cpus
from .exchange import ExchangeWorker, HostExchange, RoundResult, shared_tensors
from .phases import PhaseLog, PhaseRecord
from .settings import HostSettings
from .telemetry import TelemetryShipper

log = logging.getLogger(__name__)


class NodeoxStrategy(SingleDeviceStrategy):
    """Local-step training across hosts: train ``local_steps`` steps alone, then exchange a q4 delta.

    Example::

        trainer = Trainer(strategy=NodeoxStrategy(local_steps=20), callbacks=[PhaseMonitor()])

    Settings not passed come from ``NODEOX_COORDINATOR_URL``, ``NODEOX_HOST_ID`` and ``NODEOX_TOKEN``
    (``nodeox launch`` sets them). See :class:`~lightning_nodeox.settings.HostSettings` for each argument;
    ``cpu_threads`` caps torch's CPU threads for the whole host process (None: the CPU quota granted).
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
        self._given = dict(coordinator_url=coordinator_url, host_id=host_id, token=token, telemetry_url=telemetry_url,
                           local_steps=local_steps, rounding=rounding, error_feedback=error_feedback,
                           codec_threads=codec_threads, request_timeout=request_timeout, retry_for=retry_for)
        # validate what can be validated now; the URL may come from the environment later
        HostSettings(**{**self._given, "coordinator_url": "http://validate", "host_id": "validate"})
        if cpu_threads is not None and cpu_threads < 1:
            raise ValueError(f"cpu_threads must be at least 1 (or None for the CPU quota), got {cpu_threads}")
        self.cpu_threads = cpu_threads
        self.parallel_devices: list[torch.device] | None = None  # set by the Trainer's accelerator connector
        self.settings: HostSettings | None = None
        self.phase_records: deque[PhaseRecord] = deque(maxlen=100_000)
        self.last_result: RoundResult | None = None
        self._exchange: HostExchange | None = None
        self._worker: ExchangeWorker | None = None
        self._telemetry: TelemetryShipper | None = None
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
        self.settings = settings = HostSettings.resolve(**self._given)
        clock = ClockOffset()
        client = CoordinatorClient(settings.coordinator_url, host=settings.host_id, token=settings.token,
                                   read_timeout=settings.request_timeout, retry_for=settings.retry_for, clock=clock)
        telemetry_client = client if settings.telemetry_url is None else CoordinatorClient(
            settings.telemetry_url, host=settings.host_id, token=settings.token, retry_for=0.0)
        self._phases = PhaseLog(settings.host_id)
        self._telemetry = TelemetryShipper(telemetry_client, clock)
        self._phases.listeners += [self.phase_records.append, self._telemetry]
        codec_threads = 1 if self.root_device.type != "cpu" else choose_threads(settings.codec_threads,
                                                                                   purpose="host codec")
        exchange = HostExchange(shared_tensors(self.lightning_module), client, self._phases,
                                rounding=settings.rounding, error_feedback=settings.error_feedback,
                                codec_threads=codec_threads)
        self._exchange = exchange
        log.info("NodeoxStrategy: host %s joining %s (%d tensors, %.1f MB, local_steps=%d)", settings.host_id,
                 settings.coordinator_url, len(exchange.live),
                 sum(t.numel() * t.element_size() for t in exchange.live) / 1e6, settings.local_steps)
        try:
            exchange.join()
        except BaseException:
            self._telemetry.close(timeout=2.0)
            exchange.close()
            raise
        self._worker = ExchangeWorker(exchange)
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
        exchange = self._exchange
        now = time.time()
        self._phases.emit(PhaseRecord(exchange.round, self.settings.host_id, P.TRAIN, self._round_start, now,
                                      extra={"steps": self._steps, "samples": self._samples}))
        result = self._worker.submit(self._samples, final).result()
        self.last_result = result
        self._steps = self._samples = 0
        self._round_start = time.time()
        return result

    @override
    def on_train_end(self) -> None:
        """The last, partial round (possibly empty), then every remaining sync until all hosts finish."""
        if self._worker is not None and not self._exchange.complete:
            result = self._close_round(final=True)
            log.info("NodeoxStrategy: host %s finished after round %d on model %s", self.settings.host_id,
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
        if self._worker is None or self._left:
            return
        self._left = True
        if interrupted:
            self._exchange.client.cancel()  # an exchange in flight gives up instead of waiting for its sync
        self._worker.close(wait=not interrupted)
        self._telemetry.close()  # before leaving: the coordinator may stop once every host has left
        try:
            self._exchange.client.leave()
        except Exception as e:  # noqa: BLE001 - leaving is a courtesy; the coordinator times hosts out
            log.warning("NodeoxStrategy: could not tell the coordinator that host %s left: %s",
                        self.settings.host_id, e)

    @property
    def model_hash(self) -> str | None:
        """Hash of this host's current shared model (as agreed with the coordinator)."""
        return None if self._exchange is None else self._exchange.model_hash

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
