"""A host's tensors for the exchange: the live model, the shared model θ_r (``base``), the error-feedback
residual, the snapshot a round sends while training goes on, and the reusable message buffers.

Everything here is tensor work on the training device; none of it knows about rounds, retries or the
transport (that is :mod:`lightning_nodeox.host.round`).

Integer and boolean tensors (BatchNorm's ``num_batches_tracked``, counters, masks) are *raw*: a delta carries
their values as they are and a sync the values every host takes (one host's, chosen by the coordinator), so they
are equal on every host after each round and covered by the model hash; no codec or residual touches them.

Memory beyond the model: the base (1x the exchanged tensors), the residual (bf16, 0.5x), two q4 messages
(about 0.14x each), on a GPU a device staging area of one message, and with overlap the snapshot (1x).
"""

from __future__ import annotations

import logging
import math

import torch

from ..core.codec import RESIDUAL_DTYPE, NonFiniteDeltaError, apply_sync, encode_delta, load_delta, relative_error
from ..core.hashing import RowHasher, combine, model_hash, rest_tasks
from ..core.modelfile import ModelFileReader, model_header, read_model_into
from ..core.pool import WorkerPool
from ..core.protocol import ByteStream, read_fully
from ..core.settings import Q4Settings
from ..core.specs import spec_of
from ..core.wire import Q4Layout, Q4Message, Q4Meta

log = logging.getLogger(__name__)

ERROR_SAMPLE = 1 << 15  # values per round used to estimate the q4 error metric


def shared_tensors(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The tensors that travel: parameters and persistent buffers (floating-point ones averaged, integer and
    boolean ones raw), in state_dict order, each storage once (tied weights travel under their first name)."""
    out, seen = [], set()
    for name, tensor in module.state_dict(keep_vars=True).items():
        if not isinstance(tensor, torch.Tensor):
            continue
        key = (tensor.data_ptr(), tensor.dtype, tuple(tensor.shape))
        if key in seen:
            continue
        seen.add(key)
        out.append((name, tensor.detach()))
    return out


class HostTensors:
    """The exchanged tensors of one host and the tensor work of a round (encode, apply, hash, read the model)."""

    def __init__(self, named: list[tuple[str, torch.Tensor]]) -> None:
        for name, t in named:
            if not t.is_contiguous():
                raise ValueError(f"tensor {name!r} is not contiguous; nodeox updates tensors in place")
        self.names = [n for n, _ in named]
        self.live = [t for _, t in named]
        self.specs = spec_of(named)
        self.raw = [i for i, s in enumerate(self.specs) if s.raw]  # integer and boolean tensors: their own bytes
        if len(self.raw) == len(self.specs):
            raise ValueError("the model has no floating-point parameters or buffers to exchange")
        self._coded = [s.coded for s in self.specs]  # values the codec works on, per tensor
        self.device = self.live[0].device
        if any(t.device != self.device for t in self.live):
            raise ValueError("all parameters and buffers must be on one device")
        self.settings: Q4Settings | None = None
        self.pool: WorkerPool | None = None
        self.layout: Q4Layout | None = None
        self.base: list[torch.Tensor] = []
        self.residual: list[torch.Tensor] | None = None
        self.snapshot: list[torch.Tensor] | None = None
        self._delta: Q4Message | None = None
        self._sync_buffer: torch.Tensor | None = None
        self._staging: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.live)

    def allocate(self, settings: Q4Settings, codec_threads: int) -> None:
        """Buffers for the run's codec; ``base`` starts as a copy of the live model."""
        cuda = self.device.type == "cuda"
        self.settings = settings
        self.pool = WorkerPool(settings, self.device, codec_threads)
        self.layout = Q4Layout.of(self.specs, settings)
        self._delta = Q4Message.allocate(self.layout, pin_memory=cuda)
        self._sync_buffer = torch.empty(self.layout.total, dtype=torch.uint8, pin_memory=cuda)
        if self.device.type != "cpu":  # the codec works on the device; only packed bytes cross to host memory
            self._staging = torch.empty(self.layout.total - self.layout.data_start, dtype=torch.uint8,
                                        device=self.device)
        self.base = [t.detach().clone() for t in self.live]
        if self.raw:
            log.info("nodeox: integer and boolean tensors, equal on every host from each round on (the values of "
                     "the host with the first id among those the round took): %s", ", ".join(self.raw_names))
        self.residual = ([torch.zeros(n, dtype=RESIDUAL_DTYPE, device=self.device) for n in self._coded]
                         if settings.error_feedback else None)

    @property
    def raw_names(self) -> list[str]:
        """The integer and boolean tensors (listed at join)."""
        return [self.names[i] for i in self.raw]

    def named(self, tensors: list[torch.Tensor] | None = None) -> list[tuple[str, torch.Tensor]]:
        return list(zip(self.names, self.live if tensors is None else tensors))

    def model_hash(self, tensors: list[torch.Tensor] | None = None) -> str:
        """Hash of ``tensors`` (default: the live model)."""
        return model_hash(self.named(tensors), self.pool)

    def after_fetch(self, into_live: bool) -> None:
        """The run's model was just read into the live model (then θ_r := it) or into ``base`` (overlap: the
        live model is training); either way the residual starts over."""
        with torch.no_grad():
            if into_live:
                for b, t in zip(self.base, self.live):
                    b.copy_(t)
            for r in self.residual or []:
                r.zero_()

    def restore_live(self) -> None:
        """The live model := θ_r (``base``): local progress that no round took is dropped."""
        with torch.no_grad():
            for t, b in zip(self.live, self.base):
                t.copy_(b)

    # -- tensors on the codec's device -------------------------------------------------------------------------
    def _region(self, message: Q4Message, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Where the codec reads and writes tensor ``i``'s codes and scales: the message, or device staging."""
        if self._staging is None:
            return message.codes(i), message.scales(i)
        region = self.layout.regions[i]
        (ca, cb), (sa, sb) = region.codes, region.scales
        return self._staging[ca:cb], self._staging[sa:sb].view(self.layout.codec.scale_dtype)

    # -- encoding --------------------------------------------------------------------------------------------------
    def take_snapshot(self, restart_from_base: bool) -> None:
        """Copy the live model aside: what this round sends while training goes on. ``restart_from_base``
        (the delayed variant of overlap): the live model then goes back to θ_r and trains on from there."""
        with torch.no_grad():
            if self.snapshot is None:
                self.snapshot = [t.detach().clone() for t in self.live]
            else:
                for s, t in zip(self.snapshot, self.live):
                    s.copy_(t)
            if restart_from_base:
                for t, b in zip(self.live, self.base):
                    t.copy_(b)

    def snapshot_base(self) -> None:
        """The snapshot becomes θ_r (delayed overlap, once the delta is encoded): the fold then adds the progress
        made since the live model went back to θ_r."""
        with torch.no_grad():
            for s, b in zip(self.snapshot, self.base):
                s.copy_(b)

    def estimate_error(self, source: list[torch.Tensor]) -> float:
        """Relative q4 error of a sample of the delta (for the ``q4_rel_error`` metric)."""
        i = max(range(len(source)), key=lambda j: self._coded[j])
        k = self.pool.kernels()
        m = min(source[i].numel(), ERROR_SAMPLE, k.chunk)
        res = None if self.residual is None else self.residual[i][:m]
        load_delta(k, source[i].view(-1)[:m], self.base[i].view(-1)[:m], res, m)
        x = k.x[:m].clone()
        mp = k.padded(m)
        codec = self.layout.codec
        codes = torch.empty(codec.code_bytes(m), dtype=torch.uint8, device=self.device)
        scales = torch.empty(codec.scale_count(m), dtype=codec.scale_dtype, device=self.device)
        k.quantize(m, codes, scales)
        return relative_error(x, k.dequantize(codes, scales, mp)[:m])

    def encode(self, source: list[torch.Tensor], meta: Q4Meta, seed: int | None) -> Q4Message:
        """q4 of (source - base + residual) into the delta message; the residual keeps what q4 could not carry."""
        message = self._delta

        def work(k, i: int, start: int, stop: int) -> None:
            res = None if self.residual is None else self.residual[i]
            encode_delta(k, source[i].view(-1), self.base[i].view(-1), res, *self._region(message, i),
                         start=start, stop=stop, seed=None if seed is None else seed + i)

        with torch.no_grad():
            self.pool.over_ranges(self._coded, work)
            for i in self.raw:  # raw tensors: their values as they are
                self._region(message, i)[0][: self.specs[i].nbytes].copy_(_bytes(source[i]))
        if self._staging is not None:
            cuda = self.device.type == "cuda"
            message.data.copy_(self._staging, non_blocking=cuda)
            if cuda:
                torch.cuda.current_stream(self.device).synchronize()
        self._check_finite(message, source, meta)
        message.write_header(meta)
        return message

    def _check_finite(self, message: Q4Message, source: list[torch.Tensor], meta: Q4Meta) -> None:
        for i, (name, peak) in enumerate(zip(self.names, message.scale_maxima())):
            if math.isfinite(peak):
                continue
            finite = bool(torch.isfinite(source[i]).all())
            too_large = self.layout.codec.too_large(name, meta.round) if finite else None
            if too_large:
                raise NonFiniteDeltaError(too_large)
            raise NonFiniteDeltaError(
                f"the delta of parameter {name!r} in round {meta.round} holds NaN or Inf: training diverged on "
                f"host {meta.host}. Lower the learning rate or clip gradients "
                "(Trainer(gradient_clip_val=1.0)); nothing was sent")

    # -- syncs ---------------------------------------------------------------------------------------------------
    def receive(self, body: ByteStream) -> torch.Tensor:
        """Read a sync's bytes into the reused sync buffer."""
        if self._sync_buffer is None or self._sync_buffer.numel() != body.size:
            self._sync_buffer = torch.empty(body.size, dtype=torch.uint8)
        try:
            read_fully(body, memoryview(self._sync_buffer.numpy()))
        finally:
            body.close()
        return self._sync_buffer

    def apply(self, sync: Q4Message, into_live: bool) -> list[RowHasher]:
        """θ_{r+1} = θ_r + dequantized sync, into ``base`` and (``into_live``) the live model; returns the result's
        row hashers, filled while the sync is applied where the chunks allow (:meth:`digest` finishes them)."""
        target = self.live if into_live else self.base
        if self._staging is not None:
            self._staging.copy_(sync.data)
        hashers = [RowHasher(t) for t in target]

        def work(k, i: int, start: int, stop: int) -> None:
            fused = hashers[i] if hashers[i].fusable(self.pool.chunk) else None
            apply_sync(k, *self._region(sync, i), self.base[i].view(-1), target[i].view(-1), start=start, stop=stop,
                       hasher=fused)

        with torch.no_grad():
            self.pool.over_ranges(self._coded, work)
            for i in self.raw:  # raw tensors: the sync's values, for base and the target alike
                values = self._region(sync, i)[0][: self.specs[i].nbytes]
                _bytes(self.base[i]).copy_(values)
                if target is not self.base:
                    _bytes(target[i]).copy_(values)
        return hashers

    def digest(self, hashers: list[RowHasher]) -> str:
        """The model hash from :meth:`apply`'s hashers (digesting the rows the apply could not)."""
        self.pool.run(rest_tasks(hashers, self.pool.chunk, set(self.raw)))
        return combine(self.named([h.tensor for h in hashers]), hashers)

    def fold(self) -> None:
        """Overlap: the live model becomes θ_{r+1} plus the local progress made since the snapshot
        (``live += base - snapshot``), on the training device, between two training steps. A raw tensor takes
        θ_{r+1}'s values (what it counted since the snapshot is dropped)."""
        raw = set(self.raw)
        with torch.no_grad():
            for i, (t, b, s) in enumerate(zip(self.live, self.base, self.snapshot)):
                if i in raw:
                    t.copy_(b)
                    continue
                s.sub_(b).neg_()  # the snapshot buffer is free now: reuse it for base - snapshot
                t.add_(s.to(t.dtype))

    # -- the full model --------------------------------------------------------------------------------------------
    def model_file(self, round_: int, model_hash_: str, tensors: list[torch.Tensor] | None = None) -> ModelFileReader:
        """The model file of ``tensors`` (default: the live model) for an upload."""
        return ModelFileReader(model_header(self.specs, round_, model_hash_), self.live if tensors is None else tensors)

    def read_model(self, body: ByteStream, into: list[torch.Tensor]) -> tuple[int, str]:
        """Stream a model file into ``into``; returns its round and the coordinator's hash of it."""
        try:
            with torch.no_grad():
                return read_model_into(body, self.specs, into)
        finally:
            body.close()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes, as a flat uint8 view."""
    return t.view(-1).view(torch.uint8)
