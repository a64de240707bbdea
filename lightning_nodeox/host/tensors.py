"""A host's tensors for the exchange: the live model, the shared model θ_r (``base``), the error-feedback
residual, and the tensor work of a round, one part per idea, composed by :class:`HostTensors`:
- which tensors travel: the delta's set and each sync's (:mod:`~lightning_nodeox.host.parts`);
- the message buffers and device staging (:mod:`~lightning_nodeox.host.staging`), the delta's encode
  (:mod:`~lightning_nodeox.host.encoding`) and the sync's piecewise apply (:mod:`~lightning_nodeox.host.applying`);
- base's row digests and the model hash (:mod:`~lightning_nodeox.host.digests`);
- overlap's snapshot and fold (:mod:`~lightning_nodeox.host.snapshot`);
- the live tensors each call writes (:mod:`~lightning_nodeox.host.changes`): on a host of several devices rank 0's
  other ranks take those alone (:mod:`~lightning_nodeox.host.ranks`), so a frozen backbone stays put there too.

Everything here is tensor work on the training device; none of it knows about rounds, retries or the
transport (that is :mod:`lightning_nodeox.host.round`).

Integer and boolean tensors (BatchNorm's ``num_batches_tracked``, counters, masks) are *raw*: a delta carries
their values as they are and a sync the values every host takes (one host's, chosen by the coordinator), so they
are equal on every host after each round and covered by the model hash; no codec or residual touches them.

Frozen parameters do not travel: a round's delta carries the tensors that moved (:mod:`~lightning_nodeox.host.moving`),
and a sync the round's set.

Memory beyond the model: the base (1x the exchanged tensors), the residual (bf16, 0.5x), two q4 messages
(about 0.14x each, of the tensors that move), on a GPU two device staging areas of one message (a delta's and a
sync's: a sync is applied while the delta is still encoded), and with overlap the
snapshot (1x the tensors the round sends: with fragments, one fragment).
"""

from __future__ import annotations

import logging

import torch

from ..core.codec import RESIDUAL_DTYPE
from ..core.hashing import RowHasher, model_hash
from ..core.modelfile import ModelFileReader, model_header, read_model_into
from ..core.pool import WorkerPool
from ..core.protocol import ByteStream, read_fully
from ..core.codecs.settings import CodecSettings
from ..core.specs import spec_of
from ..core.streaming import MessageReader
from ..core.wire import Message, MessageLayout, MessageMeta
from .applying import Applying, PieceApply
from .changes import ChangeLog
from .digests import BaseDigests
from .encoding import DeltaEncoder
from .fragments import Fragments
from .moving import MovingSet
from .parts import Part, Parts
from .snapshot import Snapshot
from .staging import Staging

log = logging.getLogger(__name__)


def _state(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    out, seen = [], set()
    for name, tensor in module.state_dict(keep_vars=True).items():
        if not isinstance(tensor, torch.Tensor):
            continue
        key = (tensor.data_ptr(), tensor.dtype, tuple(tensor.shape))
        if key in seen:
            continue
        seen.add(key)
        out.append((name, tensor))
    return out


def shared_tensors(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The tensors the run keeps equal: parameters and persistent buffers (floating-point ones averaged, integer
    and boolean ones raw), in state_dict order, each storage once (tied weights travel under their first name)."""
    return [(name, tensor.detach()) for name, tensor in _state(module)]


def shared_parameters(module: torch.nn.Module) -> list[torch.nn.Parameter | None]:
    """For each of :func:`shared_tensors`, its parameter (whose ``requires_grad`` says whether it moves), or None
    for a buffer."""
    return [t if isinstance(t, torch.nn.Parameter) else None for _, t in _state(module)]


class HostTensors:
    """The exchanged tensors of one host and the tensor work of a round, composed of one object per idea: which
    tensors travel (:attr:`parts`), the change log (:attr:`changes`) and, once allocated, the message buffers
    (:attr:`staging`), the delta's encode (:attr:`encoder`), the sync's apply (:attr:`applier`), base's digests
    (:attr:`digests`) and overlap's snapshot (:attr:`overlap`)."""

    def __init__(self, named: list[tuple[str, torch.Tensor]],
                 parameters: list[torch.nn.Parameter | None] | None = None, *, fragments: int = 1) -> None:
        """``parameters``: each tensor's parameter (its ``requires_grad`` says whether it moves) or None (a buffer,
        or a tensor that always moves); default: every tensor moves. ``fragments``: a round exchanges one of that
        many fragments of the tensors that move (:mod:`~lightning_nodeox.host.fragments`)."""
        for name, t in named:
            if not t.is_contiguous():
                raise ValueError(f"tensor {name!r} is not contiguous; nodeox updates tensors in place")
        self.names = [n for n, _ in named]
        self.live = [t for _, t in named]
        self.specs = spec_of(named)
        self.raw = [i for i, s in enumerate(self.specs) if s.raw]  # integer and boolean tensors: their own bytes
        if len(self.raw) == len(self.specs):
            raise ValueError("the model has no floating-point parameters or buffers to exchange")
        self.device = self.live[0].device
        if any(t.device != self.device for t in self.live):
            raise ValueError("all parameters and buffers must be on one device")
        self.parts = Parts(self.names, self.specs, parameters if parameters is not None else [None] * len(named),
                           fragments)
        self.changes = ChangeLog(len(self.live))
        self.settings: CodecSettings | None = None
        self.pool: WorkerPool | None = None
        self.layout: MessageLayout | None = None  # of the whole model
        self.base: list[torch.Tensor] = []
        self.residual: list[torch.Tensor] | None = None
        self.staging: Staging | None = None  # the parts below are made by allocate()
        self.encoder: DeltaEncoder | None = None
        self.applier: PieceApply | None = None
        self.digests: BaseDigests | None = None
        self.overlap: Snapshot | None = None

    @classmethod
    def of_module(cls, module: torch.nn.Module, *, fragments: int = 1) -> HostTensors:
        """The exchanged tensors of a LightningModule (or any module): frozen parameters do not travel."""
        return cls(shared_tensors(module), shared_parameters(module), fragments=fragments)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.live)

    def allocate(self, settings: CodecSettings, codec_threads: int, *, error_feedback: bool = True) -> None:
        """Buffers for the run's codec; ``base`` starts as a copy of the live model; ``error_feedback``: keep each
        round's quantization residual for the next."""
        self.settings = settings
        self.pool = WorkerPool(settings, self.device, codec_threads)
        self.layout = MessageLayout.of(self.specs, settings)
        self.parts.allocate(settings, pin_memory=self.device.type == "cuda")
        self.boundary()
        self.staging = Staging(self.device, self.layout, self.part.layout.total)
        self.base = self._new_base()
        self.residual = ([torch.zeros(s.coded, dtype=RESIDUAL_DTYPE, device=self.device) for s in self.specs]
                         if error_feedback else None)
        self.encoder = DeltaEncoder(self.names, self.specs, self.base, self.residual, self.pool, self.staging,
                                    self.layout.codec)
        self.applier = PieceApply(self.specs, self.base, self.pool, self.staging)
        self.digests = BaseDigests(self.names, self.base, self.pool)
        self.overlap = Snapshot(self.live, self.base, self.raw)
        self.parts.log_fragments()
        if self.raw:
            log.info("nodeox: integer and boolean tensors, equal on every host from each round on (the values of "
                     "the host with the first id among those the round took): %s", ", ".join(self.raw_names))

    def _new_base(self) -> list[torch.Tensor]:
        """θ_r's tensors at :meth:`allocate`: a copy of the live model."""
        return [t.detach().clone() for t in self.live]

    # -- which tensors travel ------------------------------------------------------------------------------------
    @property
    def part(self) -> Part | None:
        """The tensors this host's delta carries (set at each round boundary)."""
        return self.parts.part

    @property
    def moving(self) -> MovingSet:
        return self.parts.moving

    @property
    def fragments(self) -> Fragments:
        return self.parts.fragments

    @property
    def fragment_count(self) -> int:
        """The fragments the tensors that move make (1 without fragments)."""
        return self.parts.fragment_count

    def boundary(self, round_: int | None = None, *, final: bool = False) -> Part:
        """The boundary of round ``round_``: the tensors that move in the round closing now become the delta's, all
        of them or (with fragments, unless ``final`` or no round is given) the round's fragment of them (a set not
        seen before gets its message layout, kept for later rounds)."""
        if self.base:
            self.parts.watch_frozen(self.live, self.base)
        return self.parts.boundary(None if final else round_)

    def take_part(self, round_: int | None) -> Part:
        """See :meth:`Parts.take_part`."""
        return self.parts.take_part(round_)

    def sync_part(self, sync: Message) -> Part:
        """The tensors a sync carries, as this host's indices; a PayloadError when they are not this model's."""
        return self.parts.sync_part(sync)

    def frozen_changed(self) -> list[str]:
        """The frozen parameters whose live value is not ``base``'s: code wrote them, and no round sent it."""
        return self.parts.frozen_changed(self.live, self.base)

    def take_changed(self) -> tuple[int, ...]:
        """The live tensors written since the last call (:meth:`ChangeLog.take`): all of them before the first."""
        return self.changes.take()

    @property
    def raw_names(self) -> list[str]:
        """The integer and boolean tensors (listed at join)."""
        return [self.names[i] for i in self.raw]

    # -- hashes ----------------------------------------------------------------------------------------------------
    def named(self, tensors: list[torch.Tensor] | None = None) -> list[tuple[str, torch.Tensor]]:
        return list(zip(self.names, self.live if tensors is None else tensors))

    def model_hash(self, tensors: list[torch.Tensor] | None = None) -> str:
        """Hash of ``tensors`` (default: the live model)."""
        return model_hash(self.named(tensors), self.pool)

    def base_hash(self) -> str:
        """The hash of ``base`` (θ_r), digesting only the tensors whose digests are not kept."""
        return self.digests.base_hash()

    def digest(self, hashers: list[RowHasher]) -> str:
        """The model hash from :meth:`apply_end`'s hashers (:meth:`BaseDigests.digest`)."""
        return self.digests.digest(hashers)

    # -- overlap ---------------------------------------------------------------------------------------------------
    @property
    def snapshot(self) -> list[torch.Tensor | None] | None:
        """The snapshot's tensors (None where not kept; None before the first snapshot)."""
        return None if self.overlap is None else self.overlap.tensors

    def take_snapshot(self, restart_from_base: bool, round_: int | None = None) -> None:
        """Round ``round_``'s boundary (:meth:`boundary`), then copy the tensors it sends aside: what this round
        sends while training goes on. ``restart_from_base`` (the delayed variant of overlap): the live model then
        goes back to θ_r and trains on from there."""
        part = self.boundary(round_)
        if restart_from_base:
            self.changes.wrote(part.indices)
        self.overlap.take(part.indices, restart_from_base=restart_from_base)

    def snapshot_base(self) -> None:
        """The snapshot becomes θ_r (:meth:`Snapshot.to_base`)."""
        self.overlap.to_base()

    def fold(self) -> None:
        """Overlap: the live model becomes θ_{r+1} plus the local progress made since the snapshot
        (:meth:`Snapshot.fold`)."""
        self.changes.wrote(self.overlap.folding())
        self.overlap.fold()

    def restore_live(self) -> None:
        """The live model := θ_r (``base``): local progress that no round took is dropped."""
        self.changes.wrote_all()
        with torch.no_grad():
            for t, b in zip(self.live, self.base):
                t.copy_(b)

    # -- deltas ----------------------------------------------------------------------------------------------------
    def estimate_error(self, source: list[torch.Tensor]) -> float | None:
        """Relative q4 error of a sample of the delta (for the ``q4_rel_error`` metric); None when the delta has no
        floating-point tensor."""
        return self.encoder.estimate_error(self.part, source)

    def encode(self, source: list[torch.Tensor], meta: MessageMeta, seed: int | None) -> MessageReader:
        """q4 of (source - base + residual) of the tensors that move (:attr:`part`) into their delta message, piece
        by piece on a thread of its own (:meth:`DeltaEncoder.encode`)."""
        return self.encoder.encode(self.part, source, meta, seed)

    # -- syncs -----------------------------------------------------------------------------------------------------
    def sync_buffer(self, size: int) -> torch.Tensor:
        """The buffer a sync of ``size`` bytes is read into (:meth:`Staging.sync_buffer`)."""
        return self.staging.sync_buffer(size)

    def receive(self, body: ByteStream) -> torch.Tensor:
        """Read a whole sync's bytes into :meth:`sync_buffer`."""
        buffer = self.sync_buffer(body.size)
        try:
            read_fully(body, memoryview(buffer.numpy()))
        finally:
            body.close()
        return buffer

    def apply(self, sync: Message, into_live: bool) -> list[RowHasher]:
        """A whole sync at once: :meth:`apply_begin`, :meth:`apply_piece` for each piece, :meth:`apply_end`."""
        applying = self.apply_begin(sync, into_live)
        for k in range(len(sync.layout.pieces)):
            self.apply_piece(applying, k)
        return self.apply_end(applying)

    def apply_begin(self, sync: Message, into_live: bool) -> Applying:
        """Start applying θ_{r+1} = θ_r + dequantized sync, into ``base`` and (``into_live``) the live model, for
        the tensors the sync carries (the round's set), piece by piece as they arrive (:meth:`apply_piece`). A
        tensor this host sent that the round did not take goes back to θ_r (its local work is dropped, as the sync
        drops it in the others); overlapped, a tensor the round changed that this host did not send has its θ_r
        set aside for the fold."""
        part = self.sync_part(sync)
        own = self.part.indices
        self.parts.compare(part, sync.meta.round)
        if into_live:
            self.changes.wrote(part.indices)
            self.changes.wrote(own)  # those the round did not take go back to θ_r
        self.digests.forget(part.indices)
        if part.indices != own:
            if into_live:
                self._drop_untaken(part.indices, own)
            else:
                self.overlap.set_aside(part.indices)
        self.staging.fit(sync)
        return Applying(sync, part, self.live if into_live else self.base, self.digests.fresh(part.indices))

    def _drop_untaken(self, synced: tuple[int, ...], own: tuple[int, ...]) -> None:
        """The tensors this host sent that the round did not take go back to θ_r."""
        theirs = set(synced)
        with torch.no_grad():
            for i in own:
                if i not in theirs:
                    self.live[i].copy_(self.base[i])

    def apply_piece(self, applying: Applying, k: int) -> None:
        """Apply piece ``k`` of the sync (:meth:`PieceApply.piece`)."""
        self.applier.piece(applying, k)

    def apply_end(self, applying: Applying) -> list[RowHasher]:
        """The row hashers of θ_{r+1}: of the tensors the sync changed (:meth:`digest` finishes what the apply
        could not digest), and the kept ones of the others."""
        return self.digests.after_apply(applying.part.indices, applying.fresh, applying.unfused(self.pool.chunk))

    # -- the full model --------------------------------------------------------------------------------------------
    def model_file(self, round_: int, model_hash_: str, tensors: list[torch.Tensor] | None = None) -> ModelFileReader:
        """The model file of ``tensors`` (default: the live model) for an upload."""
        return ModelFileReader(model_header(self.specs, round_, model_hash_), self.live if tensors is None else tensors)

    def read_model(self, body: ByteStream, into: list[torch.Tensor]) -> tuple[int, str]:
        """Stream a model file into ``into``; returns its round and the coordinator's hash of it."""
        if into is self.live:
            self.changes.wrote_all()
        try:
            with torch.no_grad():
                return read_model_into(body, self.specs, into)
        finally:
            body.close()

    def after_fetch(self, into_live: bool) -> None:
        """The run's model was just read into the live model (then θ_r := it) or into ``base`` (overlap: the
        live model is training); either way the residual starts over."""
        with torch.no_grad():
            if into_live:
                for b, t in zip(self.base, self.live):
                    b.copy_(t)
            for r in self.residual or []:
                r.zero_()
        self.digests.forget_all()
        self.overlap.fetched(into_live=into_live)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
