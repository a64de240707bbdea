"""The coordinator's tensors: its copy of the model, the round's accumulator, the sync it publishes, and the
full-model downloads in flight.

Tensor work here runs on the coordinator's work thread, never on the event loop; a :class:`ModelStream` is read
on the loop, a chunk at a time.

A delta carries the tensors that moved on its host (frozen parameters stay out); the round's set is the union of
its deltas' sets. Each tensor's change is the sample-weighted mean over the deltas that carried it (its own sum
of weights; under a sparse codec of ``mean="senders"``, each value's mean over the deltas that sent it), the outer
optimizer steps only the tensors of the round's set (the others' state is untouched), and the sync carries that set
alone. θ's hash digests only the tensors a round changed; the others' row digests are
kept from the round that last changed them.

Raw tensors (integer and boolean: BatchNorm's ``num_batches_tracked``, counters) are not averaged: each round
takes each of them from one host, the one whose id sorts first (:func:`raw_source_key`) among the hosts whose
delta carried it and was taken with samples; a round that took none keeps the model's values. The choice does
not depend on the order in which deltas arrive, so a restarted round chooses the same host.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..core.codec import accumulate_tensor, apply_sync, chunk_ranges, encode_sync, mean_of
from ..core.hashing import RowHasher, combine
from ..core.modelfile import model_header
from ..core.pool import WorkerPool
from ..core.recent import Recent
from ..core.codecs.settings import CodecSettings
from ..core.specs import TensorSpec, positions_in
from ..core.wire import MessageLayout, Message, MessageMeta
from .outer import OuterSettings, make_outer


@dataclass
class ClosedRound:
    """A round's sync; ``not_finite`` names the tensors that would have become NaN or Inf (their pieces were
    refused: the sync changes nothing there)."""

    sync: Message
    not_finite: list[str] = field(default_factory=list)


@dataclass
class SyncClosing:
    """A round's sync while its pieces are made (:meth:`CoordinatorModel.open_sync`)."""

    round: int
    indices: tuple[int, ...]  # the round's set: the model's index of each tensor the sync carries
    sync: Message
    base_hash: str
    digests: list  # θ's row digests before the round (a refused piece keeps its tensors')
    not_finite: list[str] = field(default_factory=list)  # tensors of refused pieces


def raw_source_key(host: str) -> tuple:
    """The order in which hosts are preferred as the source of a round's raw tensors: numeric ids by number
    (``"2"`` before ``"10"``), before other ids, which go by text."""
    return (0, int(host), host) if host.isdecimal() else (1, 0, host)


CACHED_SETS = 8  # message layouts kept, one per set of tensors


class CoordinatorModel:
    """θ (in the hosts' dtypes), the fp32 accumulator of weighted deltas, and double-buffered sync messages."""

    def __init__(self, specs: tuple[TensorSpec, ...], tensors: list[torch.Tensor], settings: CodecSettings,
                 pool: WorkerPool, outer: OuterSettings = OuterSettings()) -> None:
        self.specs = specs
        self.tensors = [t.detach().contiguous() for t in tensors]  # views of the received file, kept alive here
        self.settings = settings
        self.pool = pool
        self.layout = MessageLayout.of(specs, settings)  # of the whole model: the largest delta
        self._index = {s.name: i for i, s in enumerate(specs)}
        self._positions: Recent[tuple[TensorSpec, ...], tuple[int, ...]] = Recent(CACHED_SETS)
        self._layouts: Recent[tuple, MessageLayout] = Recent(CACHED_SETS)
        self._layouts.get((tuple(range(len(specs))), None), lambda: self.layout)
        self.acc = [torch.empty(s.coded, dtype=torch.float32) for s in specs]
        self.senders = ([torch.empty(s.coded, dtype=torch.float32) for s in specs]  # each value's senders' samples
                        if self.layout.codec.mean_over_senders else None)
        self.raw = [i for i, s in enumerate(specs) if s.raw]
        self.raw_taken = {i: torch.empty(specs[i].nbytes, dtype=torch.uint8) for i in self.raw}  # the round's choice
        self.raw_from: dict[int, str] = {}  # raw tensor -> the host its values were taken from
        self.outer = make_outer(outer, specs)
        self.weight = 0.0  # the round's weight: its deltas' samples (a late one's discounted: coordinator/merging)
        self.deltas = 0  # the round's deltas begun (a sparse sync's capacity follows it)
        self.weights = [0.0] * len(specs)  # the round's weight, per tensor
        self.moving: set[int] = set()  # the round's set so far
        self._digests: list[RowHasher | None] = [None] * len(specs)  # θ's row digests (None: not known)
        self.hash = self._hash_all()
        self.latest_sync: Message | None = None
        self._spare_sync: Message | None = None
        self._readers: dict[int, int] = {}

    def named(self) -> list[tuple[str, torch.Tensor]]:
        return [(s.name, t) for s, t in zip(self.specs, self.tensors)]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def positions(self, specs: tuple[TensorSpec, ...], what: str = "delta") -> tuple[int, ...]:
        """The model's index of each tensor a message carries (a ModelMismatchError naming the first that is not
        the model's); kept for the sets seen last."""
        return self._positions.get(specs, lambda: positions_in(self.specs, specs, what, self._index))

    def layout_of(self, indices: tuple[int, ...], capacity: int | None = None) -> MessageLayout:
        """The message layout of the tensors ``indices`` (a sync of ``capacity``, for a codec of varying size; kept
        for the sets seen last)."""
        return self._layouts.get((indices, capacity), lambda: MessageLayout.of(tuple(self.specs[i] for i in indices),
                                                                           self.settings, capacity=capacity))

    # -- one round ------------------------------------------------------------------------------------------
    def accumulate(self, message: Message, samples: float) -> None:
        """A whole delta at once: :meth:`begin_delta`, then :meth:`accumulate_piece` for each of its pieces."""
        indices = self.begin_delta(message, samples)
        for k in range(len(message.layout.pieces)):
            self.accumulate_piece(message, k, samples, indices)

    def begin_delta(self, message: Message, samples: float) -> tuple[int, ...]:
        """A delta's header is in: its tensors join the round's set (also with no samples), its weight
        (``samples``: its samples, or less for a late delta) the round's; returns the model's index of each tensor
        it carries."""
        indices = self.positions(message.meta.tensors)
        self.moving.update(indices)
        self.weight += max(samples, 0)
        self.deltas += 1
        return indices

    def accumulate_piece(self, message: Message, k: int, samples: float, indices: tuple[int, ...]) -> None:
        """Add ``samples * delta`` to the accumulator of each tensor of the delta's piece ``k`` (a tensor's first
        delta of the round overwrites it), which then counts ``samples`` more in its mean."""
        if samples <= 0:
            return
        host = message.meta.host
        piece = message.layout.pieces[k]
        tensors = range(piece.first, piece.stop)
        for j in tensors:
            i = indices[j]
            taken_from = self.raw_from.get(i)
            if self.specs[i].raw and (taken_from is None or raw_source_key(host) < raw_source_key(taken_from)):
                self.raw_taken[i].copy_(message.raw(j))
                self.raw_from[i] = host
        assign = {j: self.weights[indices[j]] == 0 for j in tensors}

        def work(kn, j: int, start: int, stop: int) -> None:
            accumulate_tensor(kn, message.codes(j), message.scales(j), self.acc[indices[j]], float(samples),
                              start=start, stop=stop, assign=assign[j], senders=self.senders_of(indices[j]))

        self.pool.over(tensors, lambda j: self.specs[indices[j]].coded, work)
        for j in tensors:
            self.weights[indices[j]] += samples

    def senders_of(self, i: int) -> torch.Tensor | None:
        """Tensor ``i``'s count of each value's senders (their samples), where the codec's sync is the mean over
        them (None: over all of the round's deltas)."""
        return None if self.senders is None else self.senders[i]

    def end_round(self) -> None:
        """The round's accumulation is done with: its weights, set and raw choices start over."""
        self.weight, self.deltas = 0.0, 0
        for i in self.moving:
            self.weights[i] = 0.0
        self.moving = set()
        self.raw_from = {}

    def close_round(self, round_: int, metrics: dict[str, list] | None = None) -> ClosedRound:
        """The whole round's sync at once: :meth:`open_sync`, :meth:`close_piece` for each piece, then
        :meth:`finish_sync`."""
        closing = self.open_sync(round_, metrics)
        for q in range(len(closing.sync.layout.pieces)):
            self.close_piece(closing, q)
        return self.finish_sync(closing)

    def open_sync(self, round_: int, metrics: dict[str, list] | None = None) -> SyncClosing:
        """Start round ``round_``'s sync: its header (the round's set of tensors, the base model's hash, the
        round's samples and ``metrics``: its sync_dist values, reduced across hosts) is written and may be sent;
        its pieces follow (:meth:`close_piece`), each once the deltas' tensors in it are all accumulated."""
        indices = tuple(sorted(self.moving))
        message = self._free_sync_buffer(self.layout_of(indices, self.layout.codec.sync_capacity(self.deltas)))
        message.write_head(MessageMeta("sync", round_, "coordinator", self.hash, samples=round(self.weight),
                                  metrics=metrics or {}))
        closing = SyncClosing(round_, indices, message, self.hash, list(self._digests))
        self._digests = [None if i in self.moving else d for i, d in enumerate(self._digests)]
        return closing

    def close_piece(self, closing: SyncClosing, q: int) -> list[str]:
        """Piece ``q`` of the sync: for each of its tensors the outer step of its mean (its own sum of weights; a
        tensor only deltas without samples carried has a zero change and no outer step), quantized, checked that
        θ + sync stays finite, and only then applied to θ as hosts will (with the outer step's state) and
        digested for θ's hash; the piece is then sealed (it may be sent). A piece whose result would not be
        finite is refused alone: θ and the outer state of its tensors stay as they were and its sync adds -0.0
        (which leaves every value's bits as they are), so hosts keep the same values too; returns the names of
        its tensors that would have become NaN or Inf.

        A failure half-way through applying leaves θ partly changed; the hash is then recomputed (model and
        hash always agree; hosts find the next sync's base differs and fetch the model)."""
        message, indices = closing.sync, closing.indices
        piece = message.layout.pieces[q]
        tensors = range(piece.first, piece.stop)
        weights = {j: self.weights[indices[j]] for j in tensors}
        for j, w in weights.items():
            if w == 0:
                self.acc[indices[j]].zero_()
        inverse = {j: 1.0 / w if w > 0 else 1.0 for j, w in weights.items()}
        stepping = {j: w > 0 and self.outer.has_step for j, w in weights.items()}
        not_finite: set[int] = set()

        def quantize(k, j: int, start: int, stop: int) -> None:
            i = indices[j]
            if not encode_sync(k, self.acc[i], inverse[j], self.tensors[i].view(-1), message.codes(j),
                               message.scales(j), start=start, stop=stop, senders=self.senders_of(i),
                               outer_step=(lambda x, a, b: self.outer.step(i, x, a, b)) if stepping[j] else None):
                not_finite.add(i)

        self.pool.over(tensors, lambda j: self.specs[indices[j]].coded, quantize)
        self._raw_sync(message, indices, tensors, taken=not not_finite)
        if not_finite:
            for j in tensors:
                if not self.specs[indices[j]].raw:
                    message.layout.codec.fill_noop(message.codes(j), message.scales(j))
            for j in tensors:  # unchanged: their digests are θ's as it was
                self._digests[indices[j]] = closing.digests[indices[j]]
            names = sorted(self.specs[i].name for i in not_finite)
            closing.not_finite += names
        else:
            try:
                self._apply(message, indices, tensors, inverse, {j: s and self.outer.has_state
                                                                 for j, s in stepping.items()})
            except BaseException:
                self._digests = [None] * len(self.specs)
                self.hash = self._hash_all()
                self.end_round()
                raise
            names = []
        message.seal(q)
        return names

    def finish_sync(self, closing: SyncClosing) -> ClosedRound:
        """The sync's trailer: θ's new hash (digesting what the pieces left), also the model's at once (θ changed
        already, and a host that reads the trailer may be back before the round is published); the round's
        accumulation ends."""
        new_hash = self.hash = self._hash_all()
        closing.sync.write_trailer(new_hash)
        self.end_round()
        return ClosedRound(closing.sync, closing.not_finite)

    def _raw_sync(self, message: Message, indices: tuple[int, ...], tensors: range, taken: bool) -> None:
        """The sync's raw tensors of ``tensors``: the values taken this round (``taken``, where a delta with
        samples carried them), else θ's own (a no-op)."""
        for j in tensors:
            i = indices[j]
            if self.specs[i].raw:
                message.raw(j).copy_(self.raw_taken[i] if taken and i in self.raw_from else _bytes(self.tensors[i]))

    def _apply(self, message: Message, indices: tuple[int, ...], tensors: range, inverse: dict[int, float],
               committing: dict[int, bool]) -> None:
        """θ += the dequantized sync (and the outer step's state update), θ's raw tensors := the sync's, for the
        sync's ``tensors``; their row digests are filled (where the chunks allow, while applying)."""
        fresh = {j: RowHasher(self.tensors[indices[j]]) for j in tensors}
        chunk = self.pool.chunk
        for j in tensors:
            if self.specs[indices[j]].raw:
                _bytes(self.tensors[indices[j]]).copy_(message.raw(j))

        def work(k, j: int, start: int, stop: int) -> None:
            i = indices[j]
            if committing[j]:
                senders = self.senders_of(i)
                for s, e in chunk_ranges(self.acc[i].numel(), k.chunk, start, stop):
                    mean = mean_of(self.acc[i][s:e], inverse[j], None if senders is None else senders[s:e],
                                   k.x[: e - s])
                    self.outer.commit(i, mean, s, e)
            fused = fresh[j] if fresh[j].fusable(chunk) else None
            theta = self.tensors[i].view(-1)
            apply_sync(k, message.codes(j), message.scales(j), theta, theta, start=start, stop=stop, hasher=fused)

        self.pool.over(tensors, lambda j: self.specs[indices[j]].coded, work)
        pending = [h for j, h in fresh.items() if self.specs[indices[j]].raw or not h.fusable(chunk)]
        self.pool.run([t for h in pending for t in h.tasks()])
        for j, h in fresh.items():
            self._digests[indices[j]] = h

    def _hash_all(self) -> str:
        """θ's hash, digesting the tensors whose row digests are not kept."""
        missing = [i for i, d in enumerate(self._digests) if d is None]
        for i in missing:
            self._digests[i] = RowHasher(self.tensors[i])
        self.pool.run([t for i in missing for t in self._digests[i].tasks()])
        return combine(self.named(), self._digests)

    def publish(self, message: Message) -> None:
        """Make ``message`` the latest sync and its resulting model hash the model's (on the event loop)."""
        self._spare_sync, self.latest_sync = self.latest_sync, message
        self.hash = message.meta.model_hash

    def adopt(self, model_hash: str) -> None:
        """θ's tensors were set from elsewhere (a relay's upstream) and hash to ``model_hash``: no sync leads to it."""
        self.latest_sync = None
        self.hash = model_hash

    def adopt_sync(self, message: Message) -> None:
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
    def _free_sync_buffer(self, layout: MessageLayout | None = None) -> Message:
        """The buffer for the next sync of ``layout`` (default: the whole model's): never the published one, nor
        one a download still reads, nor one of another layout (another set, or a sync read back from saved
        state)."""
        layout = self.layout if layout is None else layout
        spare = self._spare_sync
        if spare is None or spare.layout is not layout or self._readers.get(id(spare), 0):
            self._spare_sync = Message.allocate(layout)
        return self._spare_sync

    def reading(self, message: Message, delta: int) -> None:
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
    θ). Before a round changes θ, :meth:`unsent` and :meth:`keep` copy aside the tensors of the round's set not
    sent yet (copy-on-publish), so the download stays consistent and the round never waits for it; the copies (at
    most the model's size, usually far less; none of a frozen tensor) die with the download.
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

    def unsent(self, changing: set[int] | None = None) -> list[tuple[int, torch.Tensor]]:
        """Copies of the parts not sent yet (work thread, before θ changes), of the tensors ``changing`` (by index;
        default: all): the others stay as they are."""
        return [(i, self.parts[i].clone()) for i in range(max(self.next_part, 1), len(self.parts))
                if changing is None or i - 1 in changing]

    def keep(self, copies: list[tuple[int, torch.Tensor]]) -> None:
        """Read the remaining parts from ``copies`` from now on (on the loop, before θ changes)."""
        for i, copy in copies:
            self.parts[i] = copy
            self.kept_bytes += copy.numel()


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(-1).view(torch.uint8)
