"""NodeoxFabricStrategy: NodeoxStrategy's exchange under Lightning Fabric, for a host of one device.

``Fabric(strategy=NodeoxFabricStrategy(local_steps=20))``, or ``Fabric(strategy="nodeox")`` (``import
lightning_nodeox`` registers it in Fabric's strategy registry), takes NodeoxStrategy's arguments. Fabric has no fit
loop, so the strategy's hooks are the places where Fabric calls it:

- Joining: at the first optimizer step (under the data ledger, at the loop's first read if that comes first), so
  that weights loaded after ``fabric.setup`` (LitGPT loads its pretrained checkpoint after
  ``fabric.setup_optimizers``; a resumed host its own checkpoint) are in place. The
  model set up is the one exchanged: the first host to join provides it, the others take it (a first step's
  gradients were computed on the host's own weights, the same as the run's when every host starts alike).
- Rounds close in ``optimizer.step()``: every ``local_steps`` optimizer steps (or ``round_seconds``), and under
  the data ledger where a pass over the train loader ends; each step weighs as one sample in the mean of the
  deltas (Fabric never shows the strategy a batch). With ``max_steps`` (Fabric has no Trainer to hold it) the
  round that closes at that step is the host's final one.
- Stopping together: ``fabric.strategy.should_stop`` turns True at the round boundary where this host learns that the
  run completed (another host's loop ended, or this host reached ``max_steps``). A loop ends there, or where it
  decides to (early stopping), and then calls ``fabric.strategy.finish()``: the host's final round (what it trained
  since its last round, unless the run completed already), after which every host holds the same final model, and
  the host leaves the run. (A loop that ends right after a round boundary without ``max_steps`` sends an empty final
  round: a message of a round's delta size.) Optimizer steps after the run completed are skipped (warned once), so a
  loop that checks the flag late still ends on the run's model. ``teardown()`` without ``finish()`` finishes, unless
  an exception is on its way (then the host leaves at once); a script that ends with neither leaves the run without
  a final round (warned).
- ``fabric.all_reduce(x)`` shares a scalar across hosts with ``self.log(sync_dist=True)``'s rule: it returns the
  cross-host value as of the last round (this host's own until the first round shared it), and this host's value
  travels with its next delta. A value is known by the line of the script that calls ``fabric.all_reduce`` (file
  name and line number; inside a collection, its position there), the same on every host running the same script.
- Data: ``fabric.setup_dataloaders(loader)`` (``use_distributed_sampler=True``, Fabric's default) of a shuffled
  map-style loader gives it the coordinator's data ledger's sampler, as the Trainer's strategy does (each epoch
  shared out among the hosts, each sample once); a pass over it ends where the ledger has nothing more for the
  host, and the round closes there by itself (:mod:`.fabric_data`). Set it up before the training loop starts.
- ``fabric.barrier()``/``broadcast()`` stay within the host, a world of one; ``fabric.save``/``load`` are this
  host's own: under ``nodeox launch`` a relative path lies in the host's run folder (:mod:`.machine`).
- SIGTERM: the host leaves the run at its next optimizer step (at once when it waits on the exchange) and the
  process exits with 128 + SIGTERM.

``Fabric(strategy=NodeoxStrategy(...))`` fails with an error that names this class: NodeoxStrategy is the
Trainer's strategy, and Fabric takes its own kind (:func:`trainer_strategy_error`, raised through
:func:`.lightning_private.refuse_in_fabric`); ``Fabric(devices>1)`` and ``Fabric(num_nodes>1)`` fail naming the
Trainer, whose host can span devices and machines.
"""

from __future__ import annotations

import atexit
import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.strategies import STRATEGY_REGISTRY, SingleDeviceStrategy
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch.nn import Module
from torch.utils.data import DataLoader
from typing_extensions import override

from . import machine
from .devices import ONE_DEVICE
from .fabric_data import FabricData, fabric_sampled
from .ledger_data import lease_for_ranks
from .lightning_private import AllReduceCalls, refuse_in_fabric
from .round import RoundResult
from .session import HostSession, SessionReadings
from .signals import exit_code_for
from .strategy import NodeoxStrategy

log = logging.getLogger(__name__)


class NodeoxFabricStrategy(SessionReadings, SingleDeviceStrategy):
    """Local-step training across hosts under Fabric: ``local_steps`` optimizer steps alone, then a q4 exchange.

    Example::

        fabric = Fabric(devices=1, strategy=NodeoxFabricStrategy(local_steps=20))
        model, optimizer = fabric.setup(model, optimizer)
        for batch in loader:
            fabric.backward(loss_of(model, batch))
            optimizer.step()  # the first step joins the run; a round closes every local_steps steps
            optimizer.zero_grad()
            if done or fabric.strategy.should_stop:  # another host's loop ended: the run is complete
                break
        fabric.strategy.finish()  # this host's final round: every host ends on the same model

    Args:
        **arguments: NodeoxStrategy's (documented there): ``coordinator_url``, ``local_steps``, ``host_id``,
            ``token``, ``rounding``, ``error_feedback``, ``codec_threads``, ``cpu_threads``, ``telemetry_url``,
            ``request_timeout``, ``retry_for``, ``overlap``, ``round_seconds``, ``fragments``, ``client``.
        max_steps: this host's optimizer steps at most, as ``Trainer(max_steps=...)``: the round that closes at that
            step is its final one (``should_stop`` turns True there), so :meth:`finish` sends no empty round.
        accelerator, checkpoint_io, precision: Fabric's plugins, as for its own strategies (usually left to
            ``Fabric(accelerator=..., precision=...)``).
    """

    strategy_name = "nodeox"

    def __init__(self, *, max_steps: int | None = None, accelerator=None, checkpoint_io=None, precision=None,
                 **arguments: Any) -> None:
        super().__init__(accelerator=accelerator, checkpoint_io=checkpoint_io, precision=precision)
        self._session = HostSession.of(**arguments)
        if max_steps is not None and max_steps < 1:
            raise ValueError(f"max_steps must be at least 1 (or None: the loop ends with finish()), got {max_steps}")
        self.max_steps = max_steps
        self.parallel_devices: list[torch.device] | None = None  # Fabric's connector sets them (Fabric(devices=...))
        self._num_nodes = 1  # and this (Fabric(num_nodes=...)), seeing num_nodes
        self._module: Module | None = None  # the model set up: the one exchanged
        self._steps = 0  # optimizer steps this host took
        self._ended = False  # finish() ran, or the host left the run
        self._warned_complete = False
        self._all_reduce_calls = AllReduceCalls()  # names each value fabric.all_reduce hands over
        self._data: FabricData | None = None  # the train loader the data ledger shares out (host/fabric_data.py)

    # -- what a user reads --------------------------------------------------------------------------------------
    @property
    def should_stop(self) -> bool:
        """True once the run has completed (learned at a round boundary): end the training loop."""
        return self._session.complete

    @property
    def steps(self) -> int:
        """Optimizer steps this host took (the step count its progress lines show)."""
        return self._steps

    # -- one device -----------------------------------------------------------------------------------------------
    @property
    @override
    def root_device(self) -> torch.device:
        return self.parallel_devices[0] if self.parallel_devices else torch.device("cpu")

    @property
    def num_nodes(self) -> int:
        """``Fabric(num_nodes=...)``: 1, or refused (:meth:`_set_world_ranks`)."""
        return self._num_nodes

    def _set_world_ranks(self) -> None:
        """Called by Fabric's connector once it gave the devices and nodes: a host of one device is rank 0 of its
        world."""
        if self._num_nodes > 1:
            raise ValueError(
                f"NodeoxFabricStrategy runs a host of one device on one machine, got Fabric(num_nodes="
                f"{self._num_nodes}): each machine would join the run as a host of its own. Use Fabric(devices=1, "
                "num_nodes=1, strategy=NodeoxFabricStrategy(...)) on every machine, each with its own NODEOX_HOST_ID "
                "(a host per device), or the Trainer for a host that spans machines: Trainer(devices=K, num_nodes=M, "
                "strategy=NodeoxStrategy(...)) (docs/clusters.md, \"A host that spans machines\")")
        devices = self.parallel_devices or []
        if len(devices) > 1:
            raise ValueError(
                f"NodeoxFabricStrategy runs a host of one device, got Fabric(devices={len(devices)}) ({devices}). Use "
                "Fabric(devices=1, strategy=NodeoxFabricStrategy(...)) and start one host per device (`nodeox launch "
                "--hosts N` gives each host its own GPU), or the Trainer for a host of several devices: "
                "Trainer(devices=K, strategy=NodeoxStrategy(...))")

    # -- the data ledger (host/fabric_data.py) ------------------------------------------------------------------
    @property
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        """``setup_dataloaders(use_distributed_sampler=True)`` gives a map-style loader a DistributedSampler of this
        host's one replica: :meth:`process_dataloader` knows the loader so offered by it."""
        return {"num_replicas": 1, "rank": 0}

    @override
    def process_dataloader(self, dataloader: DataLoader) -> DataLoader:
        """The first shuffled loader offered (the train loader) gets the data ledger's sampler; the others keep
        their order (a DistributedSampler of one replica reads as their own sampler did)."""
        if not fabric_sampled(dataloader) or not dataloader.sampler.shuffle:
            return dataloader
        if self._session.ranks is not None or self._ended:
            raise ValueError(
                "NodeoxFabricStrategy: the train loader is set up after this host joined the run (at its first "
                "optimizer step), so its data can no longer be declared to the coordinator's data ledger: call "
                "fabric.setup_dataloaders(loader) before the training loop, or pass use_distributed_sampler=False")
        if self._data is not None:
            raise ValueError(
                "NodeoxFabricStrategy: the coordinator's data ledger shares out one train loader, and one is set up "
                "already; set up this one with fabric.setup_dataloaders(loader, use_distributed_sampler=False) (each "
                "host then reads all of it), or the train loader alone with use_distributed_sampler=True")
        session = self._session
        self._data = FabricData(dataloader, self._lease, lambda: session.idle_round(self._steps), self._pass_ended)
        session.data, session.covered = self._data.data.spec, self._data.data.covered
        return self._data.loader

    def _lease(self, epoch: int | None):
        """The sampler asks for a unit: the host joins first when the loop reads before its first optimizer step."""
        if self._session.ranks is None and not self._ended:
            self._join()
        return lease_for_ranks(self._session, epoch)

    def _pass_ended(self) -> None:
        """The train loader ran out: the ledger has nothing more for this host now, and the others may wait for
        what it holds, so its round closes here, whether due or not."""
        session = self._session
        if session.ranks is None or session.complete or self._ended:
            return
        with self._leaving_on_error():
            session.close_round(self._steps, pass_ended=True)

    # -- joining the run ----------------------------------------------------------------------------------------
    @override
    def setup_module(self, module: Module) -> Module:
        """The model that trains: the one exchanged (from the first optimizer step)."""
        if self._module is not None and module is not self._module:
            raise ValueError(
                f"NodeoxFabricStrategy exchanges one model, and {type(self._module).__name__} is set up already; "
                f"got {type(module).__name__} too. Set up the model that trains alone with fabric.setup(...), or put "
                "the models that train into one torch.nn.Module")
        self._module = module
        return super().setup_module(module)

    def _join(self) -> None:
        """Join the run: the model's weights become the run's."""
        if self._module is None:
            raise ValueError("NodeoxFabricStrategy joins the run with the model it trains: set it up with its "
                             "optimizer, model, optimizer = fabric.setup(model, optimizer), or "
                             "fabric.setup_module(model) before fabric.setup_optimizers(optimizer)")
        session = self._session
        session.size_threads(1, "NodeoxFabricStrategy")
        with self._leaving_on_error():
            session.start(self._module, self.root_device, ONE_DEVICE.ranks, self._took)
        session.sigterm.install()
        atexit.register(self._at_exit)

    # -- round boundaries ---------------------------------------------------------------------------------------
    @override
    def optimizer_step(self, optimizer, **kwargs: Any) -> Any:
        """The optimizer's step (the first joins the run before it), then the round's boundary when it is due;
        skipped once the run has completed."""
        session = self._session
        if session.complete:
            if not self._warned_complete:
                self._warned_complete = True
                log.warning("NodeoxFabricStrategy: host %s: the run is complete, so optimizer steps are skipped (every "
                            "host keeps the run's final model); end the training loop when fabric.strategy."
                            "should_stop is True, then call fabric.strategy.finish()", self._host)
            return None
        if session.ranks is None and not self._ended:
            self._join()
        timing = session.timing
        with timing.inside():
            output = super().optimizer_step(optimizer, **kwargs)
        timing.stepped()
        timing.add_samples(1)
        self._steps += 1
        with self._leaving_on_error():
            if session.sigterm.received:
                raise SIGTERMException()
            last = self.max_steps is not None and self._steps >= self.max_steps
            session.step_ended(lambda: self._steps, lambda: False, last=last)
        return output

    def _took(self, result: RoundResult, step: int) -> None:
        if result.lease_void and self._data is not None:
            self._data.data.void()
        link = self._session.link
        line = None if link is None else link.progress.line(result.round, step, result.model_hash, {}, result.complete)
        if line is not None:  # None: folded into a later line (rounds shorter than host/progress.py's EVERY_S)
            log.info(line)

    # -- values across hosts, and this host's own files -----------------------------------------------------------
    @override
    def all_reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any | None = "mean") -> Any:
        """``fabric.all_reduce``: a scalar's cross-host value as of the last round (``mean``, ``sum``, ``max``,
        ``min``); this host's own until it was first shared. Before joining, the value itself."""
        if not isinstance(tensor, torch.Tensor) or self._session.ranks is None:
            return tensor
        if tensor.numel() != 1:
            raise ValueError(f"NodeoxFabricStrategy shares one number per value across hosts, got a tensor of shape "
                             f"{tuple(tensor.shape)}: reduce it to a scalar first (e.g. fabric.all_reduce(x.mean()))")
        return self._session.metrics.share(self._all_reduce_calls.name(), tensor, reduce_op or "mean")

    @override
    def save_checkpoint(self, path, state, storage_options: Any | None = None, filter: Any | None = None) -> None:
        super().save_checkpoint(self._own(path), state, storage_options=storage_options, filter=filter)

    @override
    def load_checkpoint(self, path, state=None, strict: bool = True, weights_only: bool | None = None) -> dict:
        return super().load_checkpoint(self._own(path), state, strict=strict, weights_only=weights_only)

    def _own(self, path) -> Path:
        return machine.own_path(path, self._host)

    @property
    def _host(self) -> str:
        return self._session.connection_settings.resolved_host_id()

    # -- the end ----------------------------------------------------------------------------------------------------
    def finish(self) -> str | None:
        """End this host's training: its final round (unless the run completed already), then leave the run. Call it
        once the training loop ends. Returns the hash of the model this host holds, the run's final model."""
        if self._ended or self._session.ranks is None:
            return self.model_hash
        atexit.unregister(self._at_exit)
        with self._leaving_on_error():
            self._session.end(self._steps)
        self._ended = True
        self._session.close(self._module, list)
        return self.model_hash

    @override
    def teardown(self) -> None:
        """Without :meth:`finish`: finish, unless an exception is on its way (then leave the run at once)."""
        if not self._ended and self._session.ranks is not None:
            if sys.exc_info()[0] is None:
                self.finish()
            else:
                self._leave(interrupted=True)
        super().teardown()

    @contextmanager
    def _leaving_on_error(self) -> Iterator[None]:
        """An error (SIGTERM included) ends this host's part: it leaves the run at once, and a SIGTERM exits the
        process with 128 + SIGTERM."""
        try:
            yield
        except BaseException as e:
            exit_code_for(e)
            self._leave(interrupted=True)
            raise

    def _leave(self, *, interrupted: bool) -> None:
        self._ended = True
        atexit.unregister(self._at_exit)
        if interrupted:
            self._session.interrupt()
        self._session.close(None, list)

    def _at_exit(self) -> None:
        """The script ended with neither :meth:`finish` nor :meth:`teardown`: leave the run (no final round)."""
        if self._ended:
            return
        failed = getattr(sys, "last_value", None) is not None  # an exception ended the script
        if not failed and not self._session.complete:
            log.warning("NodeoxFabricStrategy: host %s's script ended without fabric.strategy.finish(): it left the "
                        "run without its final round, and may not hold the run's final model; call finish() when the "
                        "training loop ends", self._host)
        self._leave(interrupted=failed)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry) -> None:
        strategy_registry.register(cls.strategy_name, cls, description="Local-step training with q4 deltas "
                                   "through a nodeox coordinator, under Fabric", override=True)


def trainer_strategy_error(strategy: NodeoxStrategy) -> TypeError:
    settings = strategy.settings
    return TypeError(
        f"Fabric(strategy=NodeoxStrategy(...)): NodeoxStrategy is the Trainer's strategy; Fabric takes its sibling "
        f"with the same arguments: Fabric(strategy=NodeoxFabricStrategy(local_steps={settings.local_steps}, ...)) "
        "(from lightning_nodeox import NodeoxFabricStrategy), or Fabric(strategy=\"nodeox\")")


NodeoxFabricStrategy.register_strategies(STRATEGY_REGISTRY)
refuse_in_fabric(NodeoxStrategy, trainer_strategy_error)
