"""Values logged with ``self.log(..., sync_dist=True)``, shared across hosts.

Lightning reduces such a value by calling ``strategy.reduce`` from the logged value's own update (a step
value) or compute (an epoch value); :mod:`.lightning_private` tells which value a call reduces, by its full logged name
(``loss_step`` and ``loss_epoch`` apart). Reductions are those of
:func:`~lightning_nodeox.core.reduction.reduce_values`: the mean weighted by samples; ``sum``, ``max``, ``min``.

- A step value never waits: this host's latest value rides on the next round's delta, and ``reduce`` returns the
  cross-host value from the last sync this host applied (one round stale; this host's own value, with a warning
  once, until the name was first shared). After the last round, :meth:`SharedMetrics.publish` puts the last
  sync's step values into ``trainer.callback_metrics``.
- An epoch value is that epoch's cross-host value, as under DDP: the first epoch value Lightning computes at an
  epoch's end (training or validation; never the sanity check) exchanges all of this host's epoch values of
  that pass in one call (``exchange``: the coordinator answers once every host still in the run has posted, or
  cannot, :mod:`lightning_nodeox.coordinator.values`), keyed by stage, epoch and pass, so callbacks that read
  ``callback_metrics`` (EarlyStopping, ModelCheckpoint, ReduceLROnPlateau) see the epoch that just ended, on
  every host alike, including the last epoch before ``fit`` returns. Without an exchange (not joined) an epoch
  value is this host's own.

Other calls of ``strategy.reduce`` (Lightning's own) stay within the host; torchmetrics objects sync through
:mod:`.metric_states`.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Callable

import torch

from ..core.protocol import ValuesReply
from ..core.reduction import reduce_values
from ..core.wire import fit_metrics
from .lightning_private import EpochValue, LoggedValue, epoch_values

log = logging.getLogger(__name__)

Sync = Callable[..., torch.Tensor]  # (tensor, op=None): reduced across the host's ranks (op: the call's own)
Exchange = Callable[[str, object], ValuesReply | None]  # (key, payload): the answer, or None (no exchange now)


class SharedMetrics:
    """This host's latest sync_dist step values, the run's from the last sync, and the epoch values exchanged."""

    def __init__(self) -> None:
        self.local: dict[str, tuple[torch.Tensor, str]] = {}
        self.shared: dict[str, float] = {}
        self._warned = False
        self._dropped: set[str] = set()
        self._passes: Counter = Counter()  # (stage, epoch) -> epoch-end passes exchanged
        self._where: tuple[str, int] | None = None  # the current pass's stage and epoch
        self._answers: dict[str, float] = {}  # the current pass's cross-host epoch values
        self._taken: set[str] = set()  # names of the current pass Lightning has computed
        self._served: torch.Tensor | None = None  # the count of the epoch mean just given its shared value

    def reduce(self, logged: LoggedValue | None, tensor: torch.Tensor, reduce_op, *, trainer,
               recording: bool = True, sync: Sync | None = None, exchange: Exchange | None = None) -> torch.Tensor:
        """Lightning's ``strategy.reduce`` for ``logged``, the value it reduces (None: not a ``self.log`` value).
        ``sync`` reduces a tensor across the host's ranks (a host of several devices), so the host's value is recorded;
        ``exchange`` exchanges epoch values with the other hosts; ``recording`` False (the sanity check): this
        host's own values, nothing recorded or exchanged."""
        sync = sync or (lambda t, op=None: t)
        if logged is None or not isinstance(tensor, torch.Tensor):
            return sync(tensor)  # not a self.log value: reduced within the host only
        count = logged.count
        if count is not None and tensor is count:  # an epoch mean's sample count, after its sum
            served, self._served = self._served is count, None
            count = sync(tensor)  # every rank reduces it, as Lightning's DDP does
            return torch.ones_like(count) if served else count  # the sum carried the shared mean: divided by 1
        tensor = sync(tensor)
        if not recording:
            return tensor
        if logged.epoch is not None:
            shared = self._epoch_value(logged.epoch, trainer, sync, exchange)
        else:
            self.local[logged.name] = (tensor.detach().clone(), _reduction(reduce_op))
            shared = self.shared.get(logged.name)
            if shared is None:
                self._warn_once(logged.name)
        if shared is None:
            return tensor
        self._served = count  # a mean's count is divided by next: 1, so every host ends on the same bits
        return torch.full_like(tensor, shared)

    def share(self, name: str, tensor: torch.Tensor, reduce_op) -> torch.Tensor:
        """A value known by ``name`` alone (Fabric's ``all_reduce``): recorded for the next round; returns the run's
        value as of the last sync, or this host's own until it was first shared."""
        self.local[name] = (tensor.detach().clone(), _reduction(reduce_op))
        shared = self.shared.get(name)
        return tensor if shared is None else torch.full_like(tensor, shared)

    # -- epoch values -----------------------------------------------------------------------------------------
    def _epoch_value(self, value: EpochValue, trainer, sync: Sync, exchange: Exchange | None) -> float | None:
        """The cross-host value of ``value``; the first of a pass (at an epoch's end) exchanges them all."""
        where = (trainer.state.stage.value, trainer.current_epoch)
        if where != self._where or value.name not in self._answers or value.name in self._taken:
            self._where, self._taken = where, set()
            self._answers = self._exchange(value, trainer, sync, exchange)
        self._taken.add(value.name)
        return self._answers.get(value.name)

    def _exchange(self, value: EpochValue, trainer, sync: Sync, exchange: Exchange | None) -> dict[str, float]:
        """Every epoch value of this pass (``value``, and those Lightning computes with it), this host's
        (``{name: [value, reduction, samples]}``), exchanged for the cross-host values."""
        stage, epoch = trainer.state.stage.value, trainer.current_epoch
        self._passes[stage, epoch] += 1
        key = f"epoch.{stage}.{epoch}.{self._passes[stage, epoch]}"
        pending = {v.name: v for v in epoch_values(trainer)}
        own = {name: _host_value(v, sync) for name, v in {**pending, value.name: value}.items()}
        reply = exchange(key, {"values": {n: [_number(x), op, w] for n, (x, op, w) in own.items()}}) if exchange \
            else None
        mine = {name: x for name, (x, _, _) in own.items()}
        if reply is None:
            return mine
        posted: dict[str, list[tuple[float, float]]] = {}
        reductions: dict[str, str] = {}
        for payload in reply.payloads:  # every host's, in host order: every host reduces them alike
            for name, (x, op, weight) in dict(payload.get("values", {})).items():
                posted.setdefault(name, []).append((float(weight), float(x)))
                reductions.setdefault(name, str(op))
        return {**mine, **{name: reduce_values(pairs, reductions[name]) for name, pairs in posted.items()}}

    # -- step values ------------------------------------------------------------------------------------------
    def take(self) -> dict[str, list]:
        """This host's latest step values, ``{name: [value, reduction]}``, as much as a delta can carry."""
        values = {name: [float(v), op] for name, (v, op) in self.local.items()}
        kept, dropped = fit_metrics(values)
        if set(dropped) - self._dropped:
            self._dropped |= set(dropped)
            log.warning("nodeox: sync_dist values %s are not shared across hosts: a round carries at most 4 KiB of "
                        "metric names and values; log fewer values with sync_dist=True", sorted(self._dropped))
        return kept

    def update(self, metrics: dict[str, list]) -> None:
        """The run's step values from an applied sync."""
        self.shared.update({name: float(value) for name, (value, _) in metrics.items()})

    def publish(self, callback_metrics: dict) -> None:
        """Put the run's latest step values into ``trainer.callback_metrics`` (after the last round; the epoch
        values there are the cross-host ones already)."""
        for name, value in self.shared.items():
            if name in callback_metrics:
                callback_metrics[name] = torch.tensor(value, dtype=getattr(callback_metrics[name], "dtype", None))

    def _warn_once(self, name: str) -> None:
        if not self._warned:
            self._warned = True
            log.warning("nodeox: %r is logged with sync_dist=True; until a round has shared it this host uses its "
                        "own value. Hosts share step values at round boundaries: each sees the mean across hosts "
                        "as of the last round (see docs/lightning.md).", name)


def _host_value(value: EpochValue, sync: Sync) -> tuple[float, str, float]:
    """An epoch value of this host (all its ranks): ``(value, reduction, samples)``."""
    if value.count is None:
        return float(sync(value.value.clone(), value.reduction)), value.reduction, 1.0
    total = sync(value.value.clone(), "sum")
    samples = float(sync(value.count.clone(), "sum"))
    return (float(total) / samples if samples else float("nan")), "mean", samples


def _number(x: float) -> float | str:
    """A float as JSON can carry it (``nan``, ``inf`` and ``-inf`` as text; ``float`` reads them back)."""
    return x if math.isfinite(x) else str(x)


def _reduction(reduce_op) -> str:
    name = str(getattr(reduce_op, "name", reduce_op) or "mean").lower()
    return "mean" if name in ("avg", "mean") else name
