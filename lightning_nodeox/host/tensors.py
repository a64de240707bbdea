"""A host's tensors for the exchange: the live model, the shared model θ_r (``base``), the error-feedback
residual, the snapshot a round sends while training goes on, and the reusable message buffers.

Everything here is tensor work on the training device; none of it knows about rounds, retries or the
transport (that is :mod:`lightning_nodeox.host.round`).

Integer and boolean tensors (BatchNorm's ``num_batches_tracked``, counters, masks) are *raw*: a delta carries
their values as they are and a sync the values every host takes (one host's, chosen by the coordinator), so they
are equal on every host after each round and covered by the model hash; no codec or residual touches them.

Frozen parameters do not travel: a round's delta carries the tensors that moved (:mod:`~lightning_nodeox.host.moving`),
and a sync the round's set; each set has its own message layout, cached, so a fixed set allocates nothing per round.
The model hash of a sync's result digests only the tensors the sync changed; the others' row digests are kept
from the round that last changed them (they are ``base``'s, which nothing else writes).

The live tensors each call writes are recorded (:meth:`HostTensors.take_changed`): on a host of several devices
rank 0's other ranks take those alone (:mod:`~lightning_nodeox.host.ranks`), so a frozen backbone stays put there
too.

Memory beyond the model: the base (1x the exchanged tensors), the residual (bf16, 0.5x), two q4 messages
(about 0.14x each, of the tensors that move), on a GPU two device staging areas of one message (a delta's and a
sync's: a sync is applied while the delta is still encoded), and with overlap the
snapshot (1x the tensors the round sends: with fragments, one fragment).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from ..core.codec import RESIDUAL_DTYPE, NonFiniteDeltaError, apply_sync, encode_delta, load_delta, relative_error
from ..core.hashing import RowHasher, combine, model_hash
from ..core.modelfile import ModelFileReader, model_header, read_model_into
from ..core.pool import WorkerPool
from ..core.protocol import ByteStream, read_fully
from ..core.recent import Recent
from ..core.codecs.settings import CodecSettings
from ..core.specs import positions_in, spec_of
from ..core.streaming import MessageReader
from ..core.wire import MessageLayout, Message, MessageMeta
from .fragments import Fragments
from .moving import MovingSet, SetNotice

log = logging.getLogger(__name__)

ERROR_SAMPLE = 1 << 15  # values per round used to estimate the q4 error metric
CACHED_SETS = 4  # message layouts kept, one per set of tensors (a set that changes back finds its own)


@dataclass
class Applying:
    """A sync being applied piece by piece (:meth:`HostTensors.apply_begin`)."""

    sync: Message
    part: Part
    target: list[torch.Tensor]
    fresh: list[RowHasher]
    applied: int = 0  # pieces applied


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


class Part:
    """Some of a host's tensors (indices, ascending), as one message carries them: the codec's values per
    position, the positions of raw tensors, and (a delta's set) the reused message."""

    def __init__(self, indices: tuple[int, ...], specs, layout: MessageLayout | None = None,
                 message: Message | None = None) -> None:
        self.indices = indices
        self.coded = [specs[i].coded for i in indices]
        self.raw = [j for j, i in enumerate(indices) if specs[i].raw]
        self.layout = layout
        self.message = message


class HostTensors:
    """The exchanged tensors of one host and the tensor work of a round (encode, apply, hash, read the model)."""

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
        self._coded = [s.coded for s in self.specs]  # values the codec works on, per tensor
        self.device = self.live[0].device
        if any(t.device != self.device for t in self.live):
            raise ValueError("all parameters and buffers must be on one device")
        self.moving = MovingSet(parameters if parameters is not None else [None] * len(named))
        self.fragments = Fragments(fragments, [s.nbytes for s in self.specs])
        self._moves: tuple[int, ...] = ()  # the tensors that move, as of the last boundary
        self.notice = SetNotice(self.names)
        self._index = {n: i for i, n in enumerate(self.names)}
        self.settings: CodecSettings | None = None
        self.pool: WorkerPool | None = None
        self.layout: MessageLayout | None = None  # of the whole model
        self.part: Part | None = None  # the tensors this host's delta carries (set at each round boundary)
        self._cached = CACHED_SETS + fragments  # each fragment's set, and the final round's whole one
        self._parts: Recent[tuple[int, ...], Part] = Recent(self._cached)  # by this host's indices
        self._sync_parts: Recent[tuple, Part] = Recent(self._cached)  # by the specs a sync names
        self.base: list[torch.Tensor] = []
        self.residual: list[torch.Tensor] | None = None
        self.snapshot: list[torch.Tensor | None] | None = None
        self._snapped: set[int] = set()  # the snapshot's tensors of the round in flight
        self._fold_all = False  # overlap: base was replaced by a fetched model since the snapshot
        self._changed: set[int] | None = None  # live tensors written since take_changed (None: all of them)
        self._digests: list[RowHasher | None] = []  # base's row digests, per tensor (None: not known)
        self._undigested: list[RowHasher] = []
        self._sync_buffer: torch.Tensor | None = None
        self._staging: torch.Tensor | None = None
        self._sync_staging: torch.Tensor | None = None

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
        cuda = self.device.type == "cuda"
        self.settings = settings
        self.pool = WorkerPool(settings, self.device, codec_threads)
        self.layout = MessageLayout.of(self.specs, settings)
        self._parts = Recent(self._cached)
        self.boundary()
        self._sync_buffer = torch.empty(self.part.layout.total, dtype=torch.uint8, pin_memory=cuda)
        if self.device.type != "cpu":  # the codec works on the device; only packed bytes cross to host memory
            self._staging = torch.empty(self.layout.total - self.layout.data_start, dtype=torch.uint8,
                                        device=self.device)
            self._sync_staging = torch.empty_like(self._staging)  # a sync is applied while a delta is encoded
        self.base = self._new_base()
        self._digests = [None] * len(self.live)
        if self.fragments.count > 1:
            cut = self.fragments.cut(self._moves)
            log.info("nodeox: %d fragments of %s MB, one exchanged a round (the final round exchanges them all)",
                     len(cut), "/".join(f"{sum(self.specs[i].nbytes for i in f) / 1e6:.3g}" for f in cut))
            if len(cut) < self.fragments.count:
                log.warning("nodeox: fragments=%d asked, but this model's tensors make %d (a tensor holds more than a "
                            "fragment's share of the bytes): each fragment is exchanged every %d rounds, more often "
                            "than local_steps asks; lower fragments to %d to keep local_steps", self.fragments.count,
                            len(cut), len(cut), len(cut))
        if self.raw:
            log.info("nodeox: integer and boolean tensors, equal on every host from each round on (the values of "
                     "the host with the first id among those the round took): %s", ", ".join(self.raw_names))
        self.residual = ([torch.zeros(n, dtype=RESIDUAL_DTYPE, device=self.device) for n in self._coded]
                         if error_feedback else None)

    def _new_base(self) -> list[torch.Tensor]:
        """θ_r's tensors at :meth:`allocate`: a copy of the live model."""
        return [t.detach().clone() for t in self.live]

    def boundary(self, round_: int | None = None, *, final: bool = False) -> Part:
        """The boundary of round ``round_``: the tensors that move in the round closing now become the delta's, all
        of them or (with fragments, unless ``final`` or no round is given) the round's fragment of them (a set not
        seen before gets its message layout, kept for later rounds)."""
        if self.base:
            self._watch_frozen()
        self._moves = self.moving.at_boundary()
        return self.take_part(None if final else round_)

    @property
    def fragment_count(self) -> int:
        """The fragments the tensors that move make (1 without fragments)."""
        return len(self.fragments.cut(self._moves)) if self.fragments.count > 1 and self._moves else 1

    def take_part(self, round_: int | None) -> Part:
        """The delta's tensors become round ``round_``'s fragment of those that moved at the last boundary (None:
        all of them), e.g. for an empty delta sent into another round than the boundary's."""
        indices = self._moves if round_ is None else self.fragments.of_round(self._moves, round_)
        self.part = self._parts.get(indices, lambda: self._delta_part(indices))
        return self.part

    def _watch_frozen(self) -> None:
        """At the first boundary and where the set changed: frozen parameters that code wrote since the base (an
        EMA teacher) move from now on, as they did before frozen parameters stayed home."""
        written = [i for i in self.moving.to_watch() if not torch.equal(self.live[i], self.base[i])]
        if written:
            self.moving.written.update(written)
            log.warning("nodeox: %d frozen parameter(s) (requires_grad=False) changed during the round, e.g. %r (an "
                        "EMA teacher?): they are exchanged every round from now on, averaged like the rest. To say "
                        "so up front, keep such weights as buffers (register_buffer)", len(written),
                        self.names[written[0]])

    def _delta_part(self, indices: tuple[int, ...]) -> Part:
        layout = MessageLayout.of(tuple(self.specs[i] for i in indices), self.settings)
        if self.fragments.count == 1 and (self.part is not None or len(indices) < len(self.specs)):
            log.info("nodeox: this host's delta now carries %d of the model's %d tensors (%.3g MB a round)%s",
                     len(indices), len(self.specs), layout.total / 1e6,
                     "" if len(indices) == len(self.specs) else ": frozen parameters do not travel")
        return Part(indices, self.specs, layout, Message.allocate(layout, pin_memory=self.device.type == "cuda"))

    def sync_part(self, sync: Message) -> Part:
        """The tensors a sync carries, as this host's indices; a PayloadError when they are not this model's."""
        specs = sync.meta.tensors
        return self._sync_parts.get(specs, lambda: Part(positions_in(self.specs, specs, "sync", self._index),
                                                        self.specs))

    def take_changed(self) -> tuple[int, ...] | None:
        """The live tensors written since the last call (ascending), or None for all of them (none taken yet, a
        fetched model, the live model reset to θ_r); the record starts over. Only the training thread writes live
        tensors (an overlapped exchange writes ``base``), so this needs no lock."""
        changed, self._changed = self._changed, set()
        return None if changed is None else tuple(sorted(changed))

    def _wrote(self, indices) -> None:
        if self._changed is not None:
            self._changed.update(indices)

    @property
    def raw_names(self) -> list[str]:
        """The integer and boolean tensors (listed at join)."""
        return [self.names[i] for i in self.raw]

    def named(self, tensors: list[torch.Tensor] | None = None) -> list[tuple[str, torch.Tensor]]:
        return list(zip(self.names, self.live if tensors is None else tensors))

    def model_hash(self, tensors: list[torch.Tensor] | None = None) -> str:
        """Hash of ``tensors`` (default: the live model)."""
        return model_hash(self.named(tensors), self.pool)

    def base_hash(self) -> str:
        """The hash of ``base`` (θ_r), digesting only the tensors whose digests are not kept."""
        missing = [i for i, d in enumerate(self._digests) if d is None]
        for i in missing:
            self._digests[i] = RowHasher(self.base[i])
        self.pool.run([t for i in missing for t in self._digests[i].tasks()])
        return combine(self.named(self.base), self._digests)

    def frozen_changed(self) -> list[str]:
        """The frozen parameters whose live value is not ``base``'s (θ of the last round): code wrote them, and no
        round sent it."""
        return [self.names[i] for i, p in enumerate(self.moving.parameters)
                if p is not None and not p.requires_grad and i not in self.moving.written
                and not torch.equal(self.live[i], self.base[i])]

    def after_fetch(self, into_live: bool) -> None:
        """The run's model was just read into the live model (then θ_r := it) or into ``base`` (overlap: the
        live model is training); either way the residual starts over."""
        with torch.no_grad():
            if into_live:
                for b, t in zip(self.base, self.live):
                    b.copy_(t)
            for r in self.residual or []:
                r.zero_()
        self._digests = [None] * len(self.live)
        self._fold_all = not into_live

    def restore_live(self) -> None:
        """The live model := θ_r (``base``): local progress that no round took is dropped."""
        self._changed = None
        with torch.no_grad():
            for t, b in zip(self.live, self.base):
                t.copy_(b)

    # -- tensors on the codec's device -------------------------------------------------------------------------
    def _region(self, message: Message, j: int,
                staging: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Where the codec reads and writes the codes and scales of the message's tensor ``j``: the message, or
        device staging (the delta's, or ``staging``: the sync's, which is applied while the delta is encoded)."""
        staging = self._staging if staging is None else staging
        if staging is None:
            return message.codes(j), message.scales(j)
        region = message.layout.regions[j]
        (ca, cb), (sa, sb) = region.codes, region.scales
        return message.layout.codes_of(j, staging[ca:cb]), staging[sa:sb].view(self.layout.codec.scale_dtype)

    # -- encoding --------------------------------------------------------------------------------------------------
    def take_snapshot(self, restart_from_base: bool, round_: int | None = None) -> None:
        """Round ``round_``'s boundary (:meth:`boundary`), then copy the tensors it sends aside: what this round
        sends while training goes on (the snapshot holds those alone: with fragments, one fragment).
        ``restart_from_base`` (the delayed variant of overlap): the live model then goes back to θ_r and trains on
        from there."""
        part = self.boundary(round_)
        if self.snapshot is None:
            self.snapshot = [None] * len(self.live)
        sent = set(part.indices)
        for i, kept in enumerate(self.snapshot):
            if kept is not None and i not in sent:
                self.snapshot[i] = None
        self._snapped, self._fold_all = set(part.indices), False
        if restart_from_base:
            self._wrote(part.indices)
        with torch.no_grad():
            for i in part.indices:
                self._snap(i, self.live[i])
                if restart_from_base:
                    self.live[i].copy_(self.base[i])

    def _snap(self, i: int, source: torch.Tensor) -> None:
        if self.snapshot[i] is None:
            self.snapshot[i] = source.detach().clone()
        else:
            self.snapshot[i].copy_(source)

    def snapshot_base(self) -> None:
        """The snapshot becomes θ_r (delayed overlap, once the delta is encoded): the fold then adds the progress
        made since the live model went back to θ_r."""
        with torch.no_grad():
            for i in self._snapped:
                self.snapshot[i].copy_(self.base[i])

    def estimate_error(self, source: list[torch.Tensor]) -> float | None:
        """Relative q4 error of a sample of the delta (for the ``q4_rel_error`` metric); None when the delta has no
        floating-point tensor."""
        coded = [i for i in self.part.indices if self._coded[i]]
        if not coded:
            return None
        i = max(coded, key=lambda j: self._coded[j])
        k = self.pool.kernels()
        m = min(source[i].numel(), ERROR_SAMPLE, k.chunk)
        res = None if self.residual is None else self.residual[i][:m]
        load_delta(k, source[i].view(-1)[:m], self.base[i].view(-1)[:m], res, m)
        x = k.x[:m].clone()
        mp = k.padded(m)
        codec = self.layout.codec
        codes = codec.codes_view(torch.empty(codec.code_bytes(m), dtype=torch.uint8, device=self.device), m)
        scales = torch.empty(codec.scale_count(m), dtype=codec.scale_dtype, device=self.device)
        k.quantize(m, codes, scales)
        return relative_error(x, k.dequantize(codes, scales, mp)[:m])

    def encode(self, source: list[torch.Tensor], meta: MessageMeta, seed: int | None) -> MessageReader:
        """q4 of (source - base + residual) of the tensors that move (:attr:`part`) into their delta message, piece
        by piece on a thread of its own: the returned reader gives each piece once it is sealed (an upload sends
        it while the next is encoded; :meth:`MessageReader.join` waits for the whole). The residual keeps what q4
        could not carry (a tensor that does not move keeps its residual for when it does)."""
        part = self.part
        message = part.message
        message.write_head(meta)
        reader = MessageReader(message)

        def work(k, j: int, start: int, stop: int) -> None:
            i = part.indices[j]
            res = None if self.residual is None else self.residual[i]
            encode_delta(k, source[i].view(-1), self.base[i].view(-1), res, *self._region(message, j),
                         start=start, stop=stop, seed=None if seed is None else seed + i)

        def make(k: int) -> None:
            piece = message.layout.pieces[k]
            tensors = range(piece.first, piece.stop)
            with torch.no_grad():
                self.pool.over(tensors, part.coded.__getitem__, work)
                for j in part.raw:  # raw tensors: their values as they are
                    if piece.first <= j < piece.stop:
                        i = part.indices[j]
                        self._region(message, j)[0][: self.specs[i].nbytes].copy_(_bytes(source[i]))
            if self._staging is not None:
                cuda = self.device.type == "cuda"
                a, b = piece.data
                message.data[a:b].copy_(self._staging[a:b], non_blocking=cuda)
                if cuda:
                    torch.cuda.current_stream(self.device).synchronize()
            self._check_finite(message, tensors, source, meta)
            message.seal(k)

        reader.produce(make, message.write_trailer)
        return reader

    def _check_finite(self, message: Message, tensors: range, source: list[torch.Tensor], meta: MessageMeta) -> None:
        codec = self.layout.codec
        for j in tensors:
            i = self.part.indices[j]
            if self.specs[i].raw or math.isfinite(codec.magnitude(message.codes(j), message.scales(j))):
                continue
            name = self.names[i]
            finite = bool(torch.isfinite(source[i]).all())
            too_large = codec.too_large(name, meta.round) if finite else None
            if too_large:
                raise NonFiniteDeltaError(too_large)
            raise NonFiniteDeltaError(
                f"the delta of parameter {name!r} in round {meta.round} holds NaN or Inf: training diverged on "
                f"host {meta.host}. Lower the learning rate or clip gradients "
                "(Trainer(gradient_clip_val=1.0)); the upload was cut before it")

    # -- syncs ---------------------------------------------------------------------------------------------------
    def sync_buffer(self, size: int) -> torch.Tensor:
        """The buffer a sync of ``size`` bytes is read into: the reused one (pinned on a GPU; it grows to the
        largest sync, and a sync of fewer tensors takes its start)."""
        if self._sync_buffer is None or self._sync_buffer.numel() < size:
            self._sync_buffer = torch.empty(size, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
        return self._sync_buffer[:size]

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
        self.notice.compare(own, part.indices, sync.meta.round, moves=self._moves)
        target = self.live if into_live else self.base
        if into_live:
            self._wrote(part.indices)
            self._wrote(own)  # those the round did not take go back to θ_r
        for i in part.indices:
            self._digests[i] = None  # until digest(): an apply cut short leaves no stale digest behind
        with torch.no_grad():
            if part.indices != own:
                self._differing(part.indices, own, into_live)
        staging = self._sync_staging
        if staging is not None and staging.numel() < sync.layout.trailer:  # a sparse sync outgrows the delta's
            self._sync_staging = torch.empty(sync.layout.trailer, dtype=torch.uint8, device=self.device)
        fresh = [RowHasher(self.base[i]) for i in part.indices]  # base: target's bytes once applied, and kept
        return Applying(sync, part, target, fresh)

    def apply_piece(self, applying: Applying, k: int) -> None:
        """Apply piece ``k`` of the sync (in place in its buffer, checked), digesting its rows while they are in
        cache where the chunks allow."""
        sync, part, target, fresh = applying.sync, applying.part, applying.target, applying.fresh
        piece = sync.layout.pieces[k]
        if self._sync_staging is not None:
            a, b = piece.data
            self._sync_staging[a:b].copy_(sync.data[a:b])
        chunk = self.pool.chunk

        def work(kn, j: int, start: int, stop: int) -> None:
            i = part.indices[j]
            fused = fresh[j] if fresh[j].fusable(chunk) else None
            apply_sync(kn, *self._region(sync, j, self._sync_staging), self.base[i].view(-1), target[i].view(-1),
                       start=start, stop=stop, hasher=fused)

        tensors = range(piece.first, piece.stop)
        with torch.no_grad():
            self.pool.over(tensors, part.coded.__getitem__, work)
            for j in part.raw:  # raw tensors: the sync's values, for base and the target alike
                if piece.first <= j < piece.stop:
                    i = part.indices[j]
                    values = self._region(sync, j, self._sync_staging)[0][: self.specs[i].nbytes]
                    _bytes(self.base[i]).copy_(values)
                    if target is not self.base:
                        _bytes(target[i]).copy_(values)
        applying.applied = k + 1

    def apply_end(self, applying: Applying) -> list[RowHasher]:
        """The row hashers of θ_{r+1}: of the tensors the sync changed (:meth:`digest` finishes what the apply
        could not digest), and the kept ones of the others."""
        part, fresh = applying.part, applying.fresh
        raw = set(part.raw)
        chunk = self.pool.chunk
        self._undigested = [h for j, h in enumerate(fresh) if j in raw or not h.fusable(chunk)]
        hashers = list(self._digests)
        for i, h in zip(part.indices, fresh):
            hashers[i] = h
        for i, d in enumerate(hashers):
            if d is None:
                hashers[i] = d = RowHasher(self.base[i])
                self._undigested.append(d)
        return hashers

    def _differing(self, synced: tuple[int, ...], own: tuple[int, ...], into_live: bool) -> None:
        """Before a sync of another set than this host's delta is applied (see :meth:`apply`)."""
        theirs = set(synced)
        if into_live:
            for i in own:
                if i not in theirs:
                    self.live[i].copy_(self.base[i])
        elif not self._fold_all and self.snapshot is not None:
            for i in synced:
                if i not in self._snapped:
                    self._snap(i, self.base[i])
                    self._snapped.add(i)

    def digest(self, hashers: list[RowHasher]) -> str:
        """The model hash from :meth:`apply`'s hashers (digesting the rows the apply could not); they are kept as
        base's digests."""
        pending, self._undigested = self._undigested, []
        self.pool.run([t for h in pending for t in h.tasks()])
        self._digests = list(hashers)
        return combine(self.named(self.base), hashers)

    def fold(self) -> None:
        """Overlap: the live model becomes θ_{r+1} plus the local progress made since the snapshot
        (``live += base - snapshot``), on the training device, between two training steps, for the tensors set
        aside at the snapshot (the others did not move: they take θ_{r+1}, which only a fetched model changes).
        A raw tensor takes θ_{r+1}'s values (what it counted since the snapshot is dropped)."""
        raw = set(self.raw)
        folding = range(len(self.live)) if self._fold_all else sorted(self._snapped)
        self._wrote(folding)
        with torch.no_grad():
            for i in folding:
                t, b = self.live[i], self.base[i]
                if i in raw or i not in self._snapped:
                    t.copy_(b)
                    continue
                s = self.snapshot[i]
                s.sub_(b).neg_()  # the snapshot buffer is free now: reuse it for base - snapshot
                t.add_(s.to(t.dtype))
        self._snapped, self._fold_all = set(), False

    # -- the full model --------------------------------------------------------------------------------------------
    def model_file(self, round_: int, model_hash_: str, tensors: list[torch.Tensor] | None = None) -> ModelFileReader:
        """The model file of ``tensors`` (default: the live model) for an upload."""
        return ModelFileReader(model_header(self.specs, round_, model_hash_), self.live if tensors is None else tensors)

    def read_model(self, body: ByteStream, into: list[torch.Tensor]) -> tuple[int, str]:
        """Stream a model file into ``into``; returns its round and the coordinator's hash of it."""
        if into is self.live:
            self._changed = None
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
