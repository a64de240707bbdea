"""The coordinator's tensors: its copy of the model, the round's accumulator, the sync it publishes, and the
full-model downloads in flight.

Tensor work here runs on the coordinator's work thread, never on the event loop; a :class:`ModelStream` is read
on the loop, a chunk at a time.

Raw tensors (integer and boolean: BatchNorm's ``num_batches_tracked``, counters) are not averaged: each round
takes them from one host, the one whose id sorts first (:func:`raw_source_key`) among the hosts whose delta the
round took with samples; a round that took none keeps the model's values. The choice does not depend on the
order in which deltas arrive, so a restarted round chooses the same host.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..core.codec import accumulate_tensor, apply_sync, chunk_ranges, encode_sync
from ..core.hashing import RowHasher, combine, model_hash, rest_tasks
from ..core.modelfile import model_header
from ..core.pool import WorkerPool
from ..core.settings import Q4Settings
from ..core.specs import TensorSpec
from ..core.wire import Q4Layout, Q4Message, Q4Meta
from .outer import OuterSettings, make_outer


@dataclass
class ClosedRound:
    """A round's sync; ``not_finite`` names the tensors that would have left it NaN or Inf (the round was then
    refused: the sync changes nothing)."""

    sync: Q4Message
    not_finite: list[str] = field(default_factory=list)


def raw_source_key(host: str) -> tuple:
    """The order in which hosts are preferred as the source of a round's raw tensors: numeric ids by number
    (``"2"`` before ``"10"``), before other ids, which go by text."""
    return (0, int(host), host) if host.isdecimal() else (1, 0, host)


class CoordinatorModel:
    """θ (in the hosts' dtypes), the fp32 accumulator of weighted deltas, and double-buffered sync messages."""

    def __init__(self, specs: tuple[TensorSpec, ...], tensors: list[torch.Tensor], settings: Q4Settings,
                 pool: WorkerPool, outer: OuterSettings = OuterSettings()) -> None:
        self.specs = specs
        self.tensors = [t.detach().contiguous() for t in tensors]  # views of the received file, kept alive here
        self.settings = settings
        self.pool = pool
        self.layout = Q4Layout.of(specs, settings)
        self.acc = [torch.empty(s.coded, dtype=torch.float32) for s in specs]
        self.raw = [i for i, s in enumerate(specs) if s.raw]
        self.raw_taken = [torch.empty(specs[i].nbytes, dtype=torch.uint8) for i in self.raw]  # the round's choice
        self.raw_from: str | None = None  # the host they were taken from
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
        if assign:
            self.raw_from = None
        if self.raw and (self.raw_from is None or raw_source_key(message.meta.host) < raw_source_key(self.raw_from)):
            for taken, i in zip(self.raw_taken, self.raw):
                taken.copy_(message.raw(i))
            self.raw_from = message.meta.host

        def work(k, i: int, start: int, stop: int) -> None:
            accumulate_tensor(k, message.codes(i), message.scales(i), self.acc[i], float(samples), start=start,
                              stop=stop, assign=assign)

        self.pool.over_ranges([a.numel() for a in self.acc], work)
        self.weight += samples

    def close_round(self, round_: int, metrics: dict[str, list] | None = None) -> ClosedRound:
        """The outer step of the mean delta, quantized, then applied to θ as hosts will, in two passes: the first
        quantizes the sync and checks per chunk that θ + sync stays finite without writing θ; only then the
        second applies it (and the outer step's state) and digests θ's hash. A result that is not finite is
        refused: θ, its hash and the outer state stay as they were, and the sync adds -0.0 (which leaves every
        value's bits as they are), so hosts keep the same model too.

        A failure half-way through the second pass leaves θ partly applied; the hash is then recomputed, so
        model and hash always agree (hosts will find the next sync's base differs and fetch the model).

        The sync also carries ``metrics``: the round's sync_dist values, reduced across hosts."""
        if self.weight == 0:
            for acc in self.acc:
                acc.zero_()
        inv_weight = 1.0 / max(self.weight, 1)
        base_hash = self.hash
        message = self._free_sync_buffer()
        stepping = self.weight > 0 and self.outer.has_step  # no contribution: no outer step, a zero sync
        sizes = [a.numel() for a in self.acc]
        not_finite: set[int] = set()

        def quantize(k, i: int, start: int, stop: int) -> None:
            if not encode_sync(k, self.acc[i], inv_weight, self.tensors[i].view(-1), message.codes(i),
                               message.scales(i), start=start, stop=stop,
                               outer_step=(lambda x, a, b: self.outer.step(i, x, a, b)) if stepping else None):
                not_finite.add(i)

        self.pool.over_ranges(sizes, quantize)
        self._raw_sync(message, taken=self.weight > 0 and not not_finite)
        if not_finite:
            for i in range(len(self.specs)):
                if not self.specs[i].raw:
                    self.layout.codec.fill_noop(message.codes(i), message.scales(i))
            message.write_header(Q4Meta("sync", round_, "coordinator", base_hash, samples=0, model_hash=base_hash,
                                        metrics=metrics or {}))
            self.weight = 0
            return ClosedRound(message, sorted(self.specs[i].name for i in not_finite))
        try:
            new_hash = self._apply(message, inv_weight, stepping and self.outer.has_state)
        except BaseException:
            self.hash = model_hash(self.named(), self.pool)
            self.weight = 0
            raise
        message.write_header(Q4Meta("sync", round_, "coordinator", base_hash, samples=self.weight,
                                    model_hash=new_hash, metrics=metrics or {}))
        self.weight = 0
        return ClosedRound(message)

    def _raw_sync(self, message: Q4Message, taken: bool) -> None:
        """The sync's raw tensors: the values taken this round (``taken``), else θ's own (a no-op)."""
        for j, i in enumerate(self.raw):
            message.raw(i).copy_(self.raw_taken[j] if taken else _bytes(self.tensors[i]))

    def _apply(self, message: Q4Message, inv_weight: float, committing: bool) -> str:
        """θ += the dequantized sync (and the outer step's state update), θ's raw tensors := the sync's; returns
        θ's new hash."""
        hashers = [RowHasher(t) for t in self.tensors]
        for i in self.raw:
            _bytes(self.tensors[i]).copy_(message.raw(i))

        def work(k, i: int, start: int, stop: int) -> None:
            if committing:
                for s, e in chunk_ranges(self.acc[i].numel(), k.chunk, start, stop):
                    self.outer.commit(i, torch.mul(self.acc[i][s:e], inv_weight, out=k.x[: e - s]), s, e)
            fused = hashers[i] if hashers[i].fusable(self.pool.chunk) else None
            theta = self.tensors[i].view(-1)
            apply_sync(k, message.codes(i), message.scales(i), theta, theta, start=start, stop=stop, hasher=fused)

        self.pool.over_ranges([a.numel() for a in self.acc], work)
        self.pool.run(rest_tasks(hashers, self.pool.chunk, set(self.raw)))
        return combine(self.named(), hashers)

    def publish(self, message: Q4Message) -> None:
        """Make ``message`` the latest sync and its resulting model hash the model's (on the event loop)."""
        self._spare_sync, self.latest_sync = self.latest_sync, message
        self.hash = message.meta.model_hash

    def adopt_sync(self, message: Q4Message) -> None:
        """A sync read back from the run's saved state becomes the latest (never reused as a buffer)."""
        self.latest_sync = message

    def restore_outer(self, state: dict[str, torch.Tensor]) -> None:
        """Load saved outer-optimizer state (the same names and sizes, or a ValueError naming the difference)."""
        if set(state) != set(self.outer.state):
            raise ValueError(f"the saved outer-optimizer state holds {sorted(state)[:3]}..., this run's optimizer "
                             f"{sorted(self.outer.state)[:3]}...; start with the run's --outer-optimizer or --fresh")
        for name, t in state.items():
            self.outer.state[name].view(-1).copy_(t.reshape(-1))

    # -- sync buffers: reused, unless a slow download still reads one ------------------------------------------
    def _free_sync_buffer(self) -> Q4Message:
        """The buffer for the next sync: never the published one, nor one a download still reads, nor one of
        another layout (a sync read back from saved state)."""
        spare = self._spare_sync
        if spare is None or spare.layout is not self.layout or self._readers.get(id(spare), 0):
            self._spare_sync = Q4Message.allocate(self.layout)
        return self._spare_sync

    def reading(self, message: Q4Message, delta: int) -> None:
        """Count downloads in flight of ``message`` (+1 when one starts, -1 when it ends)."""
        key = id(message)
        self._readers[key] = self._readers.get(key, 0) + delta
        if self._readers[key] <= 0:
            del self._readers[key]

    # -- the full model, only on demand ---------------------------------------------------------------------------
    def stream(self, round_: int) -> ModelStream:
        """A download of θ as it is now (call on the loop, while no round changes θ)."""
        return ModelStream(model_header(self.specs, round_, self.hash), self.tensors)

    def model_chunks(self, round_: int, model_hash: str | None = None) -> list[memoryview]:
        """The safetensors file of θ as a header and one view per tensor (no copy of the tensors)."""
        views = [memoryview(model_header(self.specs, round_, model_hash or self.hash))]
        for t in self.tensors:
            views.append(memoryview(t.view(-1).view(torch.uint8).numpy()))
        return views


class ModelStream:
    """One full-model download in flight: the safetensors file of θ as it was when the download began.

    It reads θ's own tensors, copying one chunk at a time as it sends it (the transport never holds a view of
    θ). Before a round changes θ, :meth:`unsent` and :meth:`keep` copy aside the tensors not sent yet
    (copy-on-publish), so the download stays consistent and the round never waits for it; the copies (at most
    the model's size, usually far less) die with the download.
    """

    def __init__(self, header: bytes, tensors: list[torch.Tensor]) -> None:
        self.parts = [torch.frombuffer(bytearray(header), dtype=torch.uint8)]
        self.parts += [t.detach().reshape(-1).view(torch.uint8) for t in tensors]
        self.size = sum(p.numel() for p in self.parts)
        self.next_part = 0  # parts before it are sent; it may be half sent
        self.kept_bytes = 0

    def chunks(self, size: int):
        """The file in copied chunks of at most ``size`` bytes (each part is looked up afresh, so kept copies
        take over mid-part)."""
        for i in range(len(self.parts)):
            self.next_part = i
            for start in range(0, self.parts[i].numel(), size):
                yield bytes(memoryview(self.parts[i][start : start + size].numpy()))
        self.next_part = len(self.parts)

    def unsent(self) -> list[tuple[int, torch.Tensor]]:
        """Copies of the parts not sent yet (work thread, before θ changes)."""
        return [(i, self.parts[i].clone()) for i in range(max(self.next_part, 1), len(self.parts))]

    def keep(self, copies: list[tuple[int, torch.Tensor]]) -> None:
        """Read the remaining parts from ``copies`` from now on (on the loop, before θ changes)."""
        for i, copy in copies:
            self.parts[i] = copy
            self.kept_bytes += copy.numel()


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(-1).view(torch.uint8)
