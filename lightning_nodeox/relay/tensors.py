"""A relay's θ as the tensors of one host of its upstream.

The relay holds one copy of the model: the coordinator model's tensors, which its own hosts download and whose
round it accumulates. Seen from upstream they are the host's base θ_r *and* its live model (one list), so the
root's sync, applied as any host applies it, updates the relay's θ in place and is verified against the root's
hash. What the relay sends is not ``live - base`` but its site's mean, read from the accumulator: ``acc / weight``
per tensor of the round's set, plus the relay's own error-feedback residual, re-quantized
(:func:`~lightning_nodeox.core.codec.encode_mean`); raw tensors carry the values the site's round took.

Each tensor's mean is over the site's hosts that sent it (its own sum of samples), as at a coordinator. Upstream
a delta has one sample count, the site's sum, which the root gives each of its tensors: when the site's hosts
sent different sets (frozen parameters that differ between them), a tensor only some of them sent counts there
with the whole site's samples, not its senders'. That is exact while no other site sends that tensor in the
round (or each that does sent it from the same share of its samples), and is said once per change of those
tensors (:meth:`RelayTensors.take_round`). Tensors only deltas without samples carried stay out of the site's
delta (no change to send; they would count the site's samples for a zero change).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

import torch

from ..coordinator.service import RoundMean
from ..core.codec import encode_mean
from ..core.logs import Named
from ..core.protocol import ByteStream, read_fully
from ..core.streaming import MessageReader
from ..core.wire import Message, MessageMeta
from ..host.tensors import HostTensors

log = logging.getLogger(__name__)


class RoundSet:
    """The tensors the relay's delta carries: its site round's set (a host's :class:`MovingSet` stand-in; the
    relay has no parameters of its own, frozen or written)."""

    def __init__(self, count: int) -> None:
        self.indices = tuple(range(count))
        self.parameters: list[None] = [None] * count
        self.written: set[int] = set()

    def to_watch(self) -> list[int]:
        return []

    def at_boundary(self) -> tuple[int, ...]:
        return self.indices


class RelayTensors(HostTensors):
    """The relay's θ (``model``'s tensors) as base and live model of one upstream host, and its site mean's encode."""

    def __init__(self, model: RoundMean, name: str = "nodeox relay") -> None:
        """``name``: what its lines start with (the relay's)."""
        super().__init__(model.named())
        self.model = model
        self.log = Named(log, name)
        self._partial: tuple[str, ...] = ()  # the tensors last said to be sent by only some of the site's hosts
        self.parts.moving = RoundSet(len(model.specs))
        self._site_round = False  # the next encode is the site's mean
        self.last_sync: Message | None = None  # the last sync applied (the relay passes it on once verified)
        self.before_change: Callable[[], None] = lambda: None  # called before θ changes (on the upstream thread)
        self.passing: SyncPassing | None = None  # passes a sync on to the site's hosts as it is applied

    def _new_base(self) -> list[torch.Tensor]:
        return self.live  # one copy: θ is both

    def take_round(self) -> None:
        """The site's round is accumulated: its set is the next delta's (call on the coordinator's work thread,
        before :meth:`~lightning_nodeox.host.round.HostRound.encode`)."""
        model = self.model
        self.moving.indices = tuple(sorted(i for i in model.moving if model.weights[i] or not model.weight))
        self.boundary()
        self._site_round = True
        partial = [i for i in self.moving.indices if model.weights[i] < model.weight * (1 - 1e-9) and not model.specs[i].raw]
        names = tuple(model.specs[i].name for i in partial)
        if names and names != self._partial:
            self.log.warning(
                "the site's hosts sent different tensors: %d of the %d tensors of its delta came from hosts with "
                "fewer than its %g samples (%s). Each is averaged over the hosts that sent it, but upstream a "
                "delta carries one sample count, the site's: where another site sends such a tensor too, their "
                "mean is not weighted by the samples of the hosts that sent it (see docs/design.md, The relay)",
                len(names), len(self.moving.indices), model.weight,
                ", ".join(f"{n}: {model.weights[i]:g}" for n, i in zip(names[:5], partial))
                + (f", and {len(names) - 5} more" if len(names) > 5 else ""))
        self._partial = names

    def estimate_error(self, source: list[torch.Tensor]) -> float | None:
        return None  # the site's mean is not at hand as one tensor; its hosts report their own errors

    def encode(self, source: list[torch.Tensor], meta: MessageMeta, seed: int | None) -> MessageReader:
        """The site's mean after :meth:`take_round`, piece by piece on a thread of its own as a host's delta (then
        the model's round ends); any other delta (an empty one, ``samples=0``) as a host encodes it."""
        if not self._site_round:
            return super().encode(source, meta, seed)
        self._site_round = False
        model, part = self.model, self.part
        message = part.message
        weights = [model.weights[i] for i in part.indices]
        inverse = [1.0 / w if w else 0.0 for w in weights]
        for i, w in zip(part.indices, weights):
            if w == 0:  # only deltas without samples carried it: no change
                model.acc[i].zero_()

        def work(k, j: int, start: int, stop: int) -> None:
            i = part.indices[j]
            encode_mean(k, model.acc[i], inverse[j], None if self.residual is None else self.residual[i],
                        message.codes(j), message.scales(j), start=start, stop=stop, senders=model.senders_of(i))

        def make(q: int) -> None:
            piece = message.layout.pieces[q]
            tensors = range(piece.first, piece.stop)
            with torch.no_grad():
                self.pool.over(tensors, part.coded.__getitem__, work)
                for j in part.raw:  # the values the site's round took, else θ's own
                    if piece.first <= j < piece.stop:
                        i = part.indices[j]
                        taken = model.raw_taken[i] if i in model.raw_from else self.live[i].view(-1).view(torch.uint8)
                        message.raw(j).copy_(taken)
            self.encoder.check_finite(part, message, tensors, self.live, meta)
            message.seal(q)

        message.write_head(meta)
        reader = MessageReader(message)
        reader.produce(make, message.write_trailer, after=model.end_round)  # sent upstream as it is encoded
        return reader

    def sync_buffer(self, size: int) -> torch.Tensor:
        """A buffer of its own for each sync: the relay passes it on to its hosts unchanged, so the next round
        never overwrites one that a slow host may still be downloading."""
        return torch.empty(size, dtype=torch.uint8)

    def apply_begin(self, sync: Message, into_live: bool):
        self.before_change()  # downloads of θ from the relay's hosts keep what they have not sent
        self.last_sync = sync  # what the relay publishes, once whole and its hash verified
        applying = super().apply_begin(sync, into_live)
        if self.passing is not None:
            self.passing.begin(sync)
        return applying

    def apply_piece(self, applying, k: int) -> None:
        super().apply_piece(applying, k)
        if self.passing is not None:
            self.passing.sealed(k)  # checked and applied here: the site's hosts may take it

    def apply_end(self, applying):
        if self.passing is not None:
            self.passing.finished()
        return super().apply_end(applying)

    def read_model(self, body: ByteStream, into: list[torch.Tensor]) -> tuple[int, str]:
        self.before_change()
        return super().read_model(body, into)


def read_whole(body: ByteStream) -> torch.Tensor:
    """All of ``body`` (its ``size`` bytes) in a uint8 tensor of its own; the stream is closed either way."""
    buffer = torch.empty(body.size, dtype=torch.uint8)
    try:
        read_fully(body, memoryview(buffer.numpy()))
    finally:
        body.close()
    return buffer


class SyncPassing(Protocol):
    """Where a relay passes the upstream's sync on to its hosts while it is applied (called on the upstream
    thread, in order): its header is in, piece ``k`` is checked and applied, the whole is in."""

    def begin(self, sync: Message) -> None: ...

    def sealed(self, k: int) -> None: ...

    def finished(self) -> None: ...
