"""NodeoxStrategy: the Lightning side of local-step training with q4 exchanges through a coordinator.

Each host is its own world: Lightning's barrier, broadcast and reduce never wait on another host, and every
host's rank 0 is its own rank zero (its loggers and checkpoints write). A host of one device is a world of one
(no process group); a host of K devices is Lightning's DDP over its K ranks (the difference is one object,
:mod:`lightning_nodeox.host.devices`), of which rank 0 alone exchanges with the coordinator through its link to
the run (:mod:`lightning_nodeox.host.link`) and the others follow it (:mod:`lightning_nodeox.host.ranks`). The
strategy closes a round when it is due (:mod:`lightning_nodeox.host.timing`), waiting for its exchange or
overlapping it (:mod:`lightning_nodeox.host.overlap`); what drives the rounds is shared with Fabric's sibling
strategy (:mod:`lightning_nodeox.host.session`), and the round logic itself lives in
:mod:`lightning_nodeox.host.round`.

Stopping together: when ``fit`` ends on one host (max_steps, max_epochs, early stopping), it sends what it
trained since its last round as its final delta, and that round completes the run: the other hosts stop at
their next round boundary, and every host ends on the same final model (:mod:`lightning_nodeox.host.stopping`).
Values logged with ``sync_dist=True`` are shared across hosts: step values at round boundaries, epoch values at
the epoch's end (:mod:`lightning_nodeox.host.metrics`; on a host of several devices, first reduced across its
ranks), and torchmetrics objects when they compute (:mod:`lightning_nodeox.host.metric_states`); under
``nodeox launch`` each host writes into its own folder of the run directory (:mod:`lightning_nodeox.host.machine`);
SIGTERM makes a host leave at once (:mod:`lightning_nodeox.host.signals`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.data import extract_batch_size
from torch.utils.data import DataLoader
from typing_extensions import override

from ..core.protocol import ValuesReply
from ..core.transport import HostClient
from . import eventlogs, machine
from .agreement import averages_weights, suspects
from .devices import OneDevice, SeveralDevices, devices_of
from .ledger_data import LedgerData
from .ledger_shards import ShardData
from .lightning_private import value_being_reduced
from .metric_states import MetricStates
from .session import HostSession, SessionReadings
from .settings import RETRY_FOR, Connection
from .signals import exit_code_for
from .standing import RoundResult
from .stopping import ends_after_this_batch, steps_taken


class NodeoxStrategy(SessionReadings, DDPStrategy):
    """Local-step training across hosts: train ``local_steps`` steps alone, then exchange a q4 delta.

    Example::

        trainer = Trainer(strategy=NodeoxStrategy(local_steps=20), callbacks=[PhaseMonitor()])
        trainer = Trainer(strategy=NodeoxStrategy(), devices=8)  # a host of 8 GPUs: DDP inside, one exchange

    A host is one process, one machine or several: ``Trainer(devices=K)`` runs Lightning's DDP over its K devices
    (Lightning starts the ranks, or ``torchrun --nproc-per-node K`` does), ``Trainer(num_nodes=M, devices=K)`` over
    K devices on each of M machines (``torchrun --nnodes M --nproc-per-node K`` or ``srun`` starts them: a site's
    fast network inside the host), and the host takes part in the run as one host, with one ``NODEOX_HOST_ID``
    (the same on each of its machines); hosts are joined by the coordinator.

    Args:
        coordinator_url: ``http://HOST:PORT`` of ``nodeox coordinator`` (default: ``NODEOX_COORDINATOR_URL``,
            which ``nodeox launch`` sets).
        local_steps: optimizer steps each host takes alone between exchanges, counted as ``trainer.global_step``
            counts them (two optimizers stepping in a batch are two steps; with ``accumulate_grad_batches=k`` a step
            is k batches); the round closes at the first batch end with at least this many. More steps send fewer
            bytes per sample but let hosts drift further apart; 20 is the study's setting.
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
        retry_for: seconds to keep retrying while the coordinator does not answer (default 600: a coordinator
            restarted, or moved to another machine, within ten minutes is waited for).
        overlap: keep training while a round's exchange is in flight. ``True`` (or ``"eager"``): training goes on
            from this host's own result, and when the sync arrives the live model becomes the new shared model
            plus the progress made since the boundary. ``"delayed"``: training goes on from the round's shared
            model instead. A host waits only if the previous sync has not arrived by its next boundary; costs one
            more copy of the model (the snapshot). The last round at ``fit`` end is never overlapped.
        round_seconds: work to a time budget instead of ``local_steps``: a round closes at the first step after
            this many seconds of training, so a fast host does more steps than a slow one and nobody idles at the
            barrier (deltas are weighted by the samples they saw).
        fragments: streaming fragments: the tensors that move are cut into this many fragments of about equal
            bytes, and a round, every ``local_steps / fragments`` steps (or ``round_seconds / fragments``), exchanges
            one of them, so each fragment still syncs every ``local_steps`` steps but an exchange carries a
            fragment's bytes (staggered: the link is busy evenly, and with ``overlap`` the snapshot is one
            fragment). ``local_steps`` must be a multiple of it; the final round exchanges every tensor. Every host of
            a run should use the same value. See :mod:`lightning_nodeox.host.fragments`.
        client: how rank 0 talks to the coordinator: called with the resolved
            :class:`~lightning_nodeox.host.settings.Connection`, returns a
            :class:`~lightning_nodeox.core.transport.HostClient` (default: HTTP(S) to ``coordinator_url``, with
            ``request_timeout`` and ``retry_for``). Give one for another transport: an in-process coordinator in
            tests, a relay's upstream.
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
        retry_for: float = RETRY_FOR,
        overlap: bool | str = False,
        round_seconds: float | None = None,
        fragments: int = 1,
        client: Callable[[Connection], HostClient] | None = None,
        accelerator=None,
        checkpoint_io=None,
        precision_plugin=None,
        **ddp_kwargs: Any,
    ) -> None:
        super().__init__(accelerator=accelerator, checkpoint_io=checkpoint_io, precision_plugin=precision_plugin,
                         **ddp_kwargs)
        self._session = HostSession.of(coordinator_url=coordinator_url, local_steps=local_steps, host_id=host_id,
                                       token=token, rounding=rounding, error_feedback=error_feedback,
                                       codec_threads=codec_threads, cpu_threads=cpu_threads,
                                       telemetry_url=telemetry_url, request_timeout=request_timeout,
                                       retry_for=retry_for, overlap=overlap, round_seconds=round_seconds,
                                       fragments=fragments, client=client)
        self._metric_states: MetricStates | None = None  # while training: the module's torchmetrics synced across hosts
        self._samplers = True  # Trainer(use_distributed_sampler=...), before a host of one device turns it off
        self._data: LedgerData | None = None  # while fitting under the data ledger (host/ledger_data.py)

    # -- devices and ranks: one device plays Lightning's single-device strategy, several its DDP (host/devices.py)
    @property
    def _devices(self) -> OneDevice | SeveralDevices:
        return devices_of(self)

    @property
    @override
    def root_device(self) -> torch.device:
        devices = self.parallel_devices
        if not devices:
            return torch.device("cpu")
        return devices[0] if len(devices) == 1 else devices[self.local_rank]

    @override
    def set_world_ranks(self) -> None:
        """One device: rank 0 of a world of one, whatever launched this process. Several devices or machines: the
        ranks of Lightning's DDP world (as many as the launcher started: ``num_nodes`` x ``devices``)."""
        self._devices.set_world_ranks(self)

    @override
    def _configure_launcher(self) -> None:
        self._devices.configure_launcher(self)

    @override
    def setup_environment(self) -> None:
        """Use the run folder, keep the hosts' loggers apart, size torch's CPU threads to this rank's share of the CPU
        quota; on several devices, join the host's process group."""
        trainer = self.lightning_module.trainer
        host_id = self._session.connection_settings.resolved_host_id()
        machine.use_run_folder(trainer, host_id)
        machine.keep_loggers_apart(trainer, host_id)
        self._samplers = trainer._accelerator_connector.use_distributed_sampler
        self._devices.setup_environment(trainer)
        self._session.size_threads(len(self.parallel_devices or ()) or 1, "NodeoxStrategy")  # ranks share the quota
        super().setup_environment()

    @override
    def setup_distributed(self) -> None:
        """Several devices: join the host's process group; every rank must carry the host's one id."""
        self._devices.setup_distributed(self, self._session.connection_settings.given_host_id())

    @override
    def barrier(self, name: str | None = None, *args: Any, **kwargs: Any) -> None:
        """Hosts never wait on each other. One device: only at ``pre_setup`` do the hosts of one machine wait until
        its local rank 0 has run ``prepare_data``. Several: the host's ranks wait for each other (DDP)."""
        self._devices.barrier(self, name, *args, **kwargs)

    @override
    def broadcast(self, obj, src: int = 0):
        return self._devices.broadcast(self, obj, src)

    @property
    def is_distributed(self) -> bool:
        """True, so that Lightning hands values logged with ``sync_dist=True`` to :meth:`reduce`."""
        return True

    @override
    def reduce(self, tensor, group: Any = None, reduce_op: Any = "mean"):
        """A value logged with ``sync_dist=True``: a step value returns at once, with the value across hosts as of
        the last round; an epoch value is that epoch's value across hosts (see :mod:`lightning_nodeox.host.metrics`).
        On a host of several devices the value is first reduced across its ranks (so every rank holds the host's)."""
        def across_ranks(t, op=None):
            return self._devices.reduce(self, t, group, reduce_op if op is None else op)

        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None or trainer.state.fn != TrainerFn.FITTING:
            return across_ranks(tensor)  # validate/test/predict: no rounds
        return self.metrics.reduce(value_being_reduced(), tensor, reduce_op, trainer=trainer,
                                   recording=not trainer.sanity_checking, sync=across_ranks,
                                   exchange=self._exchange_values)

    def _exchange_values(self, key: str, payload: object) -> ValuesReply | None:
        """Rank 0 exchanges ``payload`` under ``key`` with the other hosts
        (:meth:`~lightning_nodeox.host.link.RunLink.exchange_values`), and every rank takes its answer; None while no
        values are exchanged (not fitting, the sanity check, left)."""
        trainer = self.lightning_module.trainer
        if trainer.state.fn != TrainerFn.FITTING or trainer.sanity_checking:
            return None
        return self._session.exchange_values(key, payload)

    @override
    def all_gather(self, tensor: torch.Tensor, group: Any = None, sync_grads: bool = False) -> torch.Tensor:
        return self._devices.all_gather(self, tensor, group, sync_grads)

    @override
    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return self._devices.setup_model(self, model)

    # -- joining the run --------------------------------------------------------------------------------------
    @override
    def setup(self, trainer: Trainer) -> None:
        """One device: set up as Lightning's single-device strategy does (the loaders keep their own samplers). Several:
        as DDP does (the model wrapped, a DistributedSampler splitting the host's data among its ranks). Either way a
        map-style train loader gets the data ledger's sampler when ``use_distributed_sampler`` (host/ledger_data.py).
        Then, when fitting, rank 0 joins the run and every rank takes its model. A disk that fails never ends
        training through its TensorBoard loggers (:mod:`~lightning_nodeox.host.eventlogs`)."""
        eventlogs.keep_writing_through_disk_failures(trainer.loggers, type(self).__name__)
        devices = self._devices
        devices.setup(self, trainer)
        self._data = None
        if trainer.state.fn != TrainerFn.FITTING:
            return
        self._data = ShardData.of(trainer, self._session, samplers=self._samplers, step=lambda: steps_taken(trainer))
        self._session.start(self.lightning_module, self.root_device, devices.ranks, self._took)

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Under the data ledger, the train loader gets the ledger's sampler (as DDP's gets a DistributedSampler; on
        a host of several devices, in place of the DistributedSampler Lightning gave it)."""
        trainer = self.lightning_module.trainer
        if self._data is not None and trainer.training and isinstance(dataloader, DataLoader):
            return self._data.loader(dataloader)
        return super().process_dataloader(dataloader)

    # -- round boundaries: when (host/timing.py), and overlapped or not (host/overlap.py), in host/session.py ---
    @override
    def training_step(self, *args: Any, **kwargs: Any):
        timing = self._session.timing
        samples = _batch_size(args[0] if args else kwargs.get("batch"))
        train = self._data is None or self._data.batch(self.lightning_module.trainer.current_epoch, samples)
        output = None  # not trained: a batch read under a data lease found void since is another host's now
        if train:
            with timing.inside():
                output = super().training_step(*args, **kwargs)
            timing.add_samples(samples)
        self._at_batch_end()
        return output

    @override
    def optimizer_step(self, optimizer, closure, model: LightningModule | None = None, **kwargs: Any):
        timing = self._session.timing
        with timing.inside():
            output = super().optimizer_step(optimizer, closure, model, **kwargs)
        timing.stepped()
        self._at_batch_end()
        return output

    def _at_batch_end(self) -> None:
        """Count the optimizer steps of a batch that ended (host/timing.py); fold an arrived sync into the live
        model (overlap); close the round when due, or at a pass's last batch under the data ledger. On a host of
        several devices rank 0 decides both for all."""
        trainer = self.lightning_module.trainer
        pass_ended = self._data is not None and trainer.fit_loop.epoch_loop.batch_progress.is_last_batch
        self._session.step_ended(lambda: steps_taken(trainer), lambda: ends_after_this_batch(trainer),
                                 pass_ended=pass_ended)

    def _took(self, result: RoundResult, step: int) -> None:
        """Every rank, once the session took a round's result: show the round's progress line (rank 0; ``step``:
        where the round closed), and stop when the run is complete. A delta not taken voids the data lease."""
        trainer = self.lightning_module.trainer
        if result.lease_void and self._data is not None:
            self._data.void()
        link = self._session.link
        if link is not None:
            progress = link.progress
            progress.show(trainer, progress.line(result.round, step, result.model_hash, trainer.callback_metrics,
                                                 result.complete))
        if result.complete:
            trainer.should_stop = True  # a host's training ended: every host stops at this round

    @override
    def on_train_start(self) -> None:
        self._session.sigterm.install()  # after Lightning's own SIGTERM handler, which it chains
        self._session.final_at_end = averages_weights(self.lightning_module.trainer)
        self._metric_states = MetricStates(self.lightning_module.trainer, self._exchange_values)
        self._metric_states.attach(self.lightning_module)
        super().on_train_start()

    @override
    def on_train_end(self) -> None:
        """This host's final round (what it trained since its last round; never overlapped), unless the run has
        completed already (another host's training ended, or this host's last batch closed its final round); then
        the run's step values logged with ``sync_dist=True`` go into ``trainer.callback_metrics`` (its epoch values
        there are the cross-host ones already)."""
        trainer = self.lightning_module.trainer
        self._session.end(steps_taken(trainer))
        self.metrics.publish(trainer.callback_metrics)
        self._check_final()
        super().on_train_end()

    def _check_final(self) -> None:
        """Rank 0, once the run completed: hash the weights held (a callback may have changed them since)."""
        trainer = self.lightning_module.trainer
        self._session.check_final(trainer.lightning_module, lambda: suspects(trainer))

    @override
    def teardown(self) -> None:
        if self._metric_states is not None:  # first: a close that fails leaves no trainer inside the metrics
            self._metric_states.detach()
            self._metric_states = None
        module = self.lightning_module
        self._session.close(module, lambda: suspects(module.trainer))
        super().teardown()

    @override
    def on_exception(self, exception: BaseException) -> None:
        exit_code_for(exception)
        self._session.interrupt()
        super().on_exception(exception)

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
