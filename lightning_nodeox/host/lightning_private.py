"""The package's one reach past Lightning's public API: what it needs and Lightning offers no public way to learn or
change, kept here alone (frames read, private objects read, one method wrapped). Each workaround below says why no
public way exists; all three were checked against Lightning 2.6.6, the first also with 2.4 and 2.5
(``LIGHTNING_VERSIONS``). tests/test_lightning_private.py checks the installed version is within them, that every
name listed in ``RELIED_ON`` is still there, and that each workaround still finds what it looks for.

1. Which ``self.log(..., sync_dist=True)`` value a ``strategy.reduce`` call reduces (:func:`value_being_reduced`),
   and which epoch values Lightning is about to compute (:func:`epoch_values`). Lightning hands ``strategy.reduce``
   a bare tensor, its reduction and its process group, never the value's name, and lists its logged values only in
   the trainer's private result collection. It keeps each logged value in a ``_ResultMetric``, whose ``update`` (a
   step value) and ``compute`` (an epoch value) call ``strategy.reduce`` directly (``meta.sync`` hands back a
   ``functools.partial``, so no frame of Lightning's sits between them): the frame that called ``reduce`` is the
   metric's own. An epoch mean's ``compute`` reduces its sum and then its sample count, ``cumulated_batch_size``. A
   value is named as Lightning names it in ``callback_metrics``: ``meta.forked_name`` (``loss_step`` and
   ``loss_epoch`` for a value logged ``on_step`` and ``on_epoch``, else ``loss``), with the ``/dataloader_idx_N``
   suffix of an evaluation loader.
2. Which line of the script called ``fabric.all_reduce`` (:class:`AllReduceCalls`). ``Fabric.all_reduce`` hands the
   strategy each tensor of the collection (through ``lightning_utilities``' ``apply_to_collection``), never a name;
   the script's line, the same on every host running the same script, is the first frame outside Lightning.
3. ``Fabric(strategy=NodeoxStrategy(...))`` failing with an error that names the fix (:func:`refuse_in_fabric`).
   Fabric's connector refuses a Trainer strategy with "invalid strategy name" and offers no hook before it; its
   check is one private method, ``_Connector._check_config_and_set_final_flags``, wrapped once at import.
4. The train loader before the fit loop asks for it (:func:`train_loader_early`): a host declares its data (the
   dataset's length) when it joins, at the strategy's ``setup``, but Lightning requests the train loader later
   (``FitLoop.setup_data``) and offers no public way to reach its source (``fit_loop._data_source``) before.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import torch
from lightning.fabric import Fabric
from lightning.fabric.connector import _Connector
from lightning.pytorch import Trainer
from lightning.pytorch.trainer.connectors.data_connector import _DataLoaderSource
from lightning.pytorch.trainer.connectors.logger_connector.result import _Metadata, _ResultCollection, _ResultMetric

LIGHTNING_VERSIONS = ((2, 4), (2, 7))  # from, up to (not including): the versions this module was checked with

RELIED_ON: tuple[tuple[type, str], ...] = (  # what the workarounds call, read or wrap on Lightning's classes
    (_ResultMetric, "update"), (_ResultMetric, "compute"),
    (_Metadata, "forked_name"), (_Metadata, "is_mean_reduction"), (_Metadata, "reduce_fx"), (_Metadata, "sync"),
    (_Metadata, "on_epoch"), (_Metadata, "add_dataloader_idx"), (_Metadata, "dataloader_idx"),
    (_ResultCollection, "valid_items"), (_ResultCollection, "DATALOADER_SUFFIX"), (Trainer, "_results"),
    (Fabric, "all_reduce"), (_Connector, "_check_config_and_set_final_flags"), (_DataLoaderSource, "dataloader"),
    (_DataLoaderSource, "is_defined"),
)  # a _ResultMetric's own attributes (meta, value, cumulated_batch_size, ...) are checked on a real fit, in the test
_OUTSIDE_THE_SCRIPT = ("lightning.", "lightning_utilities.")  # frames between a script and the strategy's all_reduce


def missing(relied_on: tuple[tuple[type, str], ...] = RELIED_ON) -> list[str]:
    """What of ``relied_on`` this Lightning lacks, as ``Owner.attribute``."""
    return [f"{owner.__name__}.{name}" for owner, name in relied_on if not hasattr(owner, name)]


# -- 1. logged values ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class EpochValue:
    """An epoch value Lightning has yet to compute: its full name, its accumulated value (for a mean: the sum of
    value times batch size), its sample count (a mean only) and its reduction (mean, sum, max, min)."""

    name: str
    value: torch.Tensor
    count: torch.Tensor | None
    reduction: str


@dataclass(frozen=True)
class LoggedValue:
    """A value being reduced: its full logged name, and for an epoch value (else a step value) what it is computed
    from; ``count``: an epoch mean's sample count (else None)."""

    name: str
    epoch: EpochValue | None

    @property
    def count(self) -> torch.Tensor | None:
        return self.epoch.count if self.epoch is not None else None


def value_being_reduced() -> LoggedValue | None:
    """Called by ``strategy.reduce`` itself: the ``self.log`` value whose update or compute called it; None when
    anything else called it (Lightning's own reductions, a torchmetrics object)."""
    caller = sys._getframe(2)  # 0: this function, 1: strategy.reduce, 2: its caller
    metric = caller.f_locals.get("self")
    if not isinstance(metric, _ResultMetric):
        return None
    if caller.f_code.co_name == "compute":
        return LoggedValue(_name(metric.meta, on_step=False), _epoch_value(metric))
    return LoggedValue(_name(metric.meta, on_step=True), None)


def epoch_values(trainer: Trainer) -> list[EpochValue]:
    """The epoch values logged with ``sync_dist=True`` that Lightning computes at this epoch's end and has not
    computed yet, in Lightning's order (every host, and every rank of a host, lists them alike)."""
    results: _ResultCollection | None = trainer._results
    if results is None:
        return []
    out = []
    for _, metric in results.valid_items():
        meta = metric.meta
        if not (metric.is_tensor and meta.on_epoch and meta.sync.should and not meta.sync.rank_zero_only
                and metric._computed is None):
            continue
        out.append(_epoch_value(metric))
    return out


def _epoch_value(metric: _ResultMetric) -> EpochValue:
    meta = metric.meta
    count = metric.cumulated_batch_size if meta.is_mean_reduction else None
    return EpochValue(_name(meta, on_step=False), metric.value, count, meta.reduce_fx.__name__)


def _name(meta: _Metadata, on_step: bool) -> str:
    name = meta.forked_name(on_step)
    if meta.add_dataloader_idx and meta.dataloader_idx is not None:
        name += _ResultCollection.DATALOADER_SUFFIX.format(meta.dataloader_idx)
    return name


# -- 2. fabric.all_reduce's caller --------------------------------------------------------------------------------
class AllReduceCalls:
    """Names each value ``fabric.all_reduce`` reduces by the script's line that called it (file name and line
    number), and a collection's values by their place in it (``[1]``, ``[2]``, ...)."""

    def __init__(self) -> None:
        self._reducing: tuple[FrameType | None, int] = (None, 0)  # the all_reduce call now reducing, and where

    def name(self) -> str:
        """Called by the strategy's ``all_reduce`` itself: the name of the value it is handed."""
        frame = sys._getframe(2)  # 0: this method, 1: the strategy's all_reduce, 2: its caller
        call = None
        while frame is not None and frame.f_globals.get("__name__", "").startswith(_OUTSIDE_THE_SCRIPT):
            if frame.f_code.co_name == "all_reduce":
                call = frame
            frame = frame.f_back
        last, index = self._reducing
        index = index + 1 if call is not None and call is last else 0
        self._reducing = (call, index)  # held, so that a later call's frame is never taken for this one
        name = "all_reduce" if frame is None else f"all_reduce@{Path(frame.f_code.co_filename).name}:{frame.f_lineno}"
        return name + (f"[{index}]" if index else "")


# -- 3. Fabric's refusal of a strategy it cannot take --------------------------------------------------------------
def refuse_in_fabric(kind: type, error: Callable[[Any], Exception]) -> None:
    """Make ``Fabric(strategy=s)``, ``s`` a ``kind``, raise ``error(s)`` instead of Lightning's "invalid strategy
    name" (which names no fix). Wraps Fabric's connector check once; a second call changes nothing."""
    check = getattr(_Connector, "_check_config_and_set_final_flags", None)
    if check is None or getattr(check, "nodeox", False):
        return

    @functools.wraps(check)
    def checked(self: _Connector, *args: Any, **kwargs: Any) -> Any:
        strategy = kwargs.get("strategy", args[0] if args else None)
        if isinstance(strategy, kind):
            raise error(strategy)
        return check(self, *args, **kwargs)

    checked.nodeox = True
    _Connector._check_config_and_set_final_flags = checked


# -- 4. the train loader, early -----------------------------------------------------------------------------------
def train_loader_early(trainer: Trainer) -> object | None:
    """The loader ``fit`` will train on, as the user gives it (before Lightning adds samplers): the one passed to
    ``fit``, or what the ``train_dataloader`` hook returns (the hook is then called once more by Lightning, which
    must give a loader of the same dataset); None when there is none."""
    source = trainer.fit_loop._data_source
    if not isinstance(source, _DataLoaderSource) or not source.is_defined():
        return None
    return source.dataloader()
