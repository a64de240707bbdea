"""Values logged with ``self.log(..., sync_dist=True)``, shared across hosts without stalling training.

Lightning reduces such a value by calling ``strategy.reduce`` from the logged value's own update (a step
value) or compute (an epoch value); :mod:`.logged` tells which value a call reduces. :class:`SharedMetrics`
answers at once:
- it keeps this host's latest value of each name, which the next round's delta carries;
- it returns the value the coordinator reduced across hosts (the mean weighted by samples; ``sum``, ``max``,
  ``min`` for those ``reduce_fx``) from the last sync this host applied: one round stale. Hosts that log at the
  same steps see the same value, so a callback monitoring it (EarlyStopping, ModelCheckpoint,
  ReduceLROnPlateau) decides the same everywhere;
- until a name has been shared once (its first round), it returns this host's own value, and warns once.

After the last round, :meth:`publish` puts the run's values into ``trainer.callback_metrics``. Other calls of
``strategy.reduce`` (Lightning's own, and torchmetrics objects, which sync themselves) stay local.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from types import FrameType

import torch

from ..core.wire import fit_metrics
from .logged import logged_value

log = logging.getLogger(__name__)


class SharedMetrics:
    """This host's latest sync_dist values, and the run's values from the last sync."""

    def __init__(self) -> None:
        self.local: dict[str, tuple[torch.Tensor, str]] = {}
        self.shared: dict[str, float] = {}
        self._warned = False
        self._dropped: set[str] = set()

    def reduce(self, caller: FrameType, tensor: torch.Tensor, reduce_op, recording: bool = True,
               sync: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        """Lightning's ``strategy.reduce`` for a logged value; ``caller`` is the frame that called it. ``sync``
        reduces a tensor across the host's ranks (a host of several devices), so the host's value is recorded."""
        sync = sync or (lambda t: t)
        logged = logged_value(caller)
        if logged is None or not isinstance(tensor, torch.Tensor):
            return sync(tensor)  # not a self.log value: reduced within the host only
        count = logged.count
        if count is not None and tensor is count:
            return sync(tensor)  # the epoch mean's sample count stays this host's (its sum carries the shared mean)
        tensor = sync(tensor)
        if count is not None:
            count = sync(count.clone())  # the host's count, as Lightning's next call reduces it (sync is in-place)
        name = logged.name
        local = tensor if count is None else tensor / count
        if recording:
            self.local[name] = (local.detach().clone(), _reduction(reduce_op))
        shared = self.shared.get(name)
        if shared is None:
            self._warn_once(name)
            return tensor
        value = torch.full_like(tensor, shared)
        return value if count is None else value * count

    def share(self, name: str, tensor: torch.Tensor, reduce_op) -> torch.Tensor:
        """A value known by ``name`` alone (Fabric's ``all_reduce``): recorded for the next round; returns the run's
        value as of the last sync, or this host's own until it was first shared."""
        self.local[name] = (tensor.detach().clone(), _reduction(reduce_op))
        shared = self.shared.get(name)
        return tensor if shared is None else torch.full_like(tensor, shared)

    def take(self) -> dict[str, list]:
        """This host's latest values, ``{name: [value, reduction]}``, as much as a delta can carry."""
        values = {name: [float(v), op] for name, (v, op) in self.local.items()}
        kept, dropped = fit_metrics(values)
        if set(dropped) - self._dropped:
            self._dropped |= set(dropped)
            log.warning("nodeox: sync_dist values %s are not shared across hosts: a round carries at most 4 KiB of "
                        "metric names and values; log fewer values with sync_dist=True", sorted(self._dropped))
        return kept

    def update(self, metrics: dict[str, list]) -> None:
        """The run's values from an applied sync."""
        self.shared.update({name: float(value) for name, (value, _) in metrics.items()})

    def publish(self, callback_metrics: dict) -> None:
        """Put the run's latest values into ``trainer.callback_metrics`` (after the last round)."""
        for name, value in self.shared.items():
            if name in callback_metrics:
                callback_metrics[name] = torch.tensor(value, dtype=getattr(callback_metrics[name], "dtype", None))

    def _warn_once(self, name: str) -> None:
        if not self._warned:
            self._warned = True
            log.warning("nodeox: %r is logged with sync_dist=True; until a round has shared it this host uses its "
                        "own value. Hosts share such values at round boundaries: each sees the mean across hosts "
                        "as of the last round (see docs/lightning.md).", name)


def _reduction(reduce_op) -> str:
    name = str(getattr(reduce_op, "name", reduce_op) or "mean").lower()
    return "mean" if name in ("avg", "mean") else name
