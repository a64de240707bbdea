"""The coordinator's tensors: its copy of the model, the round's accumulator, and the sync it publishes.

All methods here do tensor work and run on the coordinator's work thread, never on the event loop.
"""

from __future__ import annotations

import os

import torch

from ..core.codec import accumulate_tensor, encode_sync_and_apply
from ..core.hashing import RowHasher, combine, model_hash
from ..core.modelfile import model_header
from ..core.pool import WorkerPool
from ..core.settings import Q4Settings
from ..core.specs import TensorSpec
from ..core.wire import Q4Layout, Q4Message, Q4Meta
from .outer import OuterSettings, make_outer


class CoordinatorModel:
    """θ (in the hosts' dtypes), the fp32 accumulator of weighted deltas, and double-buffered sync messages."""

    def __init__(self, specs: tuple[TensorSpec, ...], tensors: list[torch.Tensor], settings: Q4Settings,
                 pool: WorkerPool, outer: OuterSettings = OuterSettings()) -> None:
        self.specs = specs
        self.tensors = [t.detach().contiguous() for t in tensors]  # views of the received file, kept alive here
        self.settings = settings
        self.pool = pool
        self.layout = Q4Layout.of(specs, settings)
        self.acc = [torch.empty(s.numel, dtype=torch.float32) for s in specs]
        self.outer = make_outer(outer, specs)
        self.weight = 0
        self.hash = model_hash(self.named(), pool)
        self.latest_sync: Q4Message | None = None
        self._spare_sync: Q4Message | None = None
        self._readers: dict[int, int] = {}

    def named(self) -> list[tuple[str, torch.Tensor]]:
        return [(s.name, t) for s, t in zip(self.specs, self.tensors)]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    # -- one round ------------------------------------------------------------------------------------------
    def accumulate(self, message: Q4Message, samples: int) -> None:
        """Add ``samples * delta`` to the accumulator (the round's first delta overwrites it)."""
        if samples <= 0:
            return
        assign = self.weight == 0

        def work(k, i: int, start: int, stop: int) -> None:
            accumulate_tensor(k, message.codes(i), message.scales(i), self.acc[i], float(samples), start=start,
                              stop=stop, assign=assign)

        self.pool.over_ranges([a.numel() for a in self.acc], work)
        self.weight += samples

    def close_round(self, round_: int, metrics: dict[str, list] | None = None) -> Q4Message:
        """The outer step of the mean delta, quantized and applied to θ as hosts will; returns the sync (with
        the round's ``metrics`` reduced across hosts)."""
        if self.weight == 0:
            for acc in self.acc:
                acc.zero_()
        inv_weight = 1.0 / max(self.weight, 1)
        base_hash = self.hash
        message = self._free_sync_buffer()
        hashers = [RowHasher(t) for t in self.tensors]
        stepping = self.weight > 0 and bool(self.outer.state)  # no contribution: no outer step, a zero sync

        def work(k, i: int, start: int, stop: int) -> None:
            fused = hashers[i] if hashers[i].fusable(self.pool.chunk) else None
            encode_sync_and_apply(k, self.acc[i], inv_weight, self.tensors[i].view(-1), message.codes(i),
                                  message.scales(i), start=start, stop=stop, hasher=fused,
                                  outer_step=(lambda x, a, b: self.outer.step(i, x, a, b)) if stepping else None)

        self.pool.over_ranges([a.numel() for a in self.acc], work)
        self.pool.run([t for h in hashers if not h.fusable(self.pool.chunk) for t in h.tasks()])
        message.write_header(Q4Meta("sync", round_, "coordinator", base_hash, samples=self.weight,
                                    model_hash=combine(self.named(), hashers), metrics=metrics or {}))
        self.weight = 0
        return message

    def publish(self, message: Q4Message) -> None:
        """Make ``message`` the latest sync and its resulting model hash the model's (on the event loop)."""
        self.latest_sync = message
        self.hash = message.meta.model_hash

    # -- sync buffers: reused, unless a slow download still reads one ------------------------------------------
    def _free_sync_buffer(self) -> Q4Message:
        spare, self._spare_sync = self._spare_sync, self.latest_sync
        if spare is not None and self._readers.get(id(spare), 0) == 0:
            return spare
        return Q4Message.allocate(self.layout)

    def reading(self, message: Q4Message, delta: int) -> None:
        """Count downloads in flight of ``message`` (+1 when one starts, -1 when it ends)."""
        key = id(message)
        self._readers[key] = self._readers.get(key, 0) + delta
        if self._readers[key] <= 0:
            del self._readers[key]

    # -- the full model, only on demand ---------------------------------------------------------------------------
    def model_chunks(self, round_: int, model_hash: str | None = None) -> list[memoryview]:
        """The safetensors file of θ as a header and one view per tensor (no copy of the tensors)."""
        views = [memoryview(model_header(self.specs, round_, model_hash or self.hash))]
        for t in self.tensors:
            views.append(memoryview(t.view(-1).view(torch.uint8).numpy()))
        return views

    def save(self, path, round_: int, model_hash: str) -> int:
        """Write θ as a safetensors file (synced to disk); returns its size."""
        size = 0
        with open(path, "wb") as f:
            for view in self.model_chunks(round_, model_hash):
                size += f.write(view)
            f.flush()
            os.fsync(f.fileno())
        return size

    def model_size(self, round_: int) -> int:
        return len(model_header(self.specs, round_, self.hash)) + self.nbytes
