"""torchmetrics ``Metric`` objects of the LightningModule, synced across hosts when they compute, as under DDP.

A ``Metric`` syncs itself when it computes (``sync_on_compute``, the default; not on a step's ``forward``): if
its ``distributed_available_fn`` says so, it hands each state tensor to its ``dist_sync_fn``, which returns one
tensor per process, and reduces them (sum, cat, ...). Under DDP that is ``torch.distributed``; a host here is its
own world (a host of one device has no process group at all), so :func:`attach` gives every ``Metric`` of the
module, at the start of training, a ``dist_sync_fn`` that gathers the state across the host's ranks (when it has
several) and then across hosts, through the coordinator's values exchange (one call a state tensor; keys by
stage, epoch and call, which every host names alike), and a ``distributed_available_fn`` that says yes while
training (not in the sanity check) and what torchmetrics would say otherwise. So a logged ``Accuracy`` is one
number on every host, over every host's samples, whether logged with ``sync_dist=True`` or computed by hand.

A state larger than ``MAX_STATE_BYTES`` is not sent: that metric stays per host, with a warning naming it.
When training ends the metrics get their own functions back (:meth:`MetricStates.detach`), so a module saved whole
(``torch.save(model)``) holds no reference to the trainer; a copy of the module made while training
(``copy.deepcopy``) shares this object rather than copying the trainer with it.
"""

from __future__ import annotations

import base64
import logging
from collections import Counter
from collections.abc import Callable

import torch
from torchmetrics import Metric
from torchmetrics.metric import jit_distributed_available
from torchmetrics.utilities.distributed import gather_all_tensors

from ..core.protocol import MAX_VALUES_BYTES, ValuesReply

log = logging.getLogger(__name__)

MAX_STATE_BYTES = MAX_VALUES_BYTES // 2  # one state of one host, before base64 (the exchange carries 1 MiB)

Exchange = Callable[[str, object], ValuesReply | None]  # (key, payload): the answer, or None (no exchange now)


class MetricStates:
    """The ``dist_sync_fn`` and ``distributed_available_fn`` of the module's metrics."""

    def __init__(self, trainer, exchange: Exchange) -> None:
        self.trainer = trainer
        self.exchange = exchange
        self._calls: Counter = Counter()  # (stage, epoch) -> states gathered
        self._warned = False
        self._attached: list[tuple[Metric, object, object]] = []  # each metric and its own two functions

    def __deepcopy__(self, memo: dict) -> MetricStates:
        return self  # a module copied while training syncs through the same exchange; the trainer is not copied

    def attach(self, module: torch.nn.Module) -> list[str]:
        """Make every torchmetrics ``Metric`` in ``module`` sync across hosts; returns their names."""
        names = []
        for name, metric in module.named_modules():
            if isinstance(metric, Metric):
                self._attached.append((metric, metric.dist_sync_fn, metric.distributed_available_fn))
                metric.dist_sync_fn = self.gather
                metric.distributed_available_fn = self.available
                names.append(name)
        return names

    def detach(self) -> None:
        """Give the metrics their own ``dist_sync_fn`` and ``distributed_available_fn`` back (training ended)."""
        for metric, sync, available in self._attached:
            metric.dist_sync_fn, metric.distributed_available_fn = sync, available
        self._attached = []

    def available(self) -> bool:
        trainer = self.trainer
        return (trainer.training or trainer.validating) and not trainer.sanity_checking or jit_distributed_available()

    def gather(self, tensor: torch.Tensor, group=None) -> list[torch.Tensor]:
        """``tensor`` of every rank of every host (this host's ranks alone when no exchange runs now)."""
        local = gather_all_tensors(tensor, group) if jit_distributed_available() else [tensor]
        trainer = self.trainer
        stage, epoch = trainer.state.stage.value, trainer.current_epoch
        self._calls[stage, epoch] += 1
        key = f"state.{stage}.{epoch}.{self._calls[stage, epoch]}"
        size = sum(t.numel() * t.element_size() for t in local)
        if size > MAX_STATE_BYTES:
            if not self._warned:
                self._warned = True
                log.warning("nodeox: a torchmetrics state of %d bytes (shape %s) is larger than the %d bytes hosts "
                            "exchange; that metric is computed from this host's samples alone. Use a metric with "
                            "smaller states (fewer classes or thresholds)", size, tuple(tensor.shape), MAX_STATE_BYTES)
            return local
        reply = self.exchange(key, {"tensors": [_encode(t) for t in local]})
        if reply is None:
            return local
        return [_decode(t, tensor.device) for payload in reply.payloads for t in payload["tensors"]]


def _encode(tensor: torch.Tensor) -> dict:
    t = tensor.detach().cpu().contiguous()
    return {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
            "data": base64.b64encode(t.reshape(-1).view(torch.uint8).numpy().tobytes()).decode()}


def _decode(d: dict, device: torch.device) -> torch.Tensor:
    dtype = getattr(torch, d["dtype"])
    data = bytearray(base64.b64decode(d["data"]))
    flat = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    return flat.view(dtype).reshape(d["shape"]).to(device)
