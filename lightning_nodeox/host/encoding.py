"""A host's delta: q4 of (source - base + β residual) of the tensors the delta carries (β: the codec's error decay,
1 but under the sparse codec's recipe), encoded piece by piece on a thread of its own, each piece checked for NaN
and Inf before it is sealed; and the q4 error of a sample of it (the ``q4_rel_error`` metric).

Raw tensors (integer and boolean) carry their values as they are. The error-feedback residual keeps what q4 could
not carry (a tensor that does not move keeps its residual for when it does).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..core.codec import NonFiniteDeltaError, encode_delta, load_delta, relative_error
from ..core.codecs.base import Codec
from ..core.pool import WorkerPool
from ..core.specs import TensorSpec
from ..core.streaming import MessageReader
from ..core.wire import Message, MessageMeta
from .parts import Part
from .staging import Staging, as_bytes

ERROR_SAMPLE = 1 << 15  # values per round used to estimate the q4 error metric


class DeltaEncoder:
    """Encodes a host's deltas against ``base`` (with ``residual``, or None without error feedback)."""

    def __init__(self, names: list[str], specs: Sequence[TensorSpec], base: list[torch.Tensor],
                 residual: list[torch.Tensor] | None, pool: WorkerPool, staging: Staging, codec: Codec) -> None:
        self.codec = codec
        self.names = names
        self.specs = specs
        self.base = base
        self.residual = residual
        self.pool = pool
        self.staging = staging

    def encode(self, part: Part, source: list[torch.Tensor], meta: MessageMeta, seed: int | None) -> MessageReader:
        """The delta of ``source``'s tensors ``part`` into ``part``'s message; the returned reader gives each
        piece once it is sealed (an upload sends it while the next is encoded; :meth:`MessageReader.join` waits
        for the whole)."""
        message = part.message
        message.write_head(meta)
        reader = MessageReader(message)
        staging = self.staging

        def work(k, j: int, start: int, stop: int) -> None:
            i = part.indices[j]
            res = None if self.residual is None else self.residual[i]
            encode_delta(k, source[i].view(-1), self.base[i].view(-1), res,
                         *staging.region(message, j, staging.delta), start=start, stop=stop,
                         seed=None if seed is None else seed + i)

        def make(k: int) -> None:
            piece = message.layout.pieces[k]
            tensors = range(piece.first, piece.stop)
            with torch.no_grad():
                self.pool.over(tensors, part.coded.__getitem__, work)
                for j in part.raw:  # raw tensors: their values as they are
                    if piece.first <= j < piece.stop:
                        i = part.indices[j]
                        codes = staging.region(message, j, staging.delta)[0]
                        codes[: self.specs[i].nbytes].copy_(as_bytes(source[i]))
            staging.unstage_delta(message, piece)
            self.check_finite(part, message, tensors, source, meta)
            message.seal(k)

        reader.produce(make, message.write_trailer)
        return reader

    def check_finite(self, part: Part, message: Message, tensors: range, source: list[torch.Tensor],
                     meta: MessageMeta) -> None:
        """A NonFiniteDeltaError naming the parameter and the fix when the delta's ``tensors`` (positions in
        ``part``) hold NaN or Inf."""
        codec = self.codec
        for j in tensors:
            i = part.indices[j]
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

    def estimate_error(self, part: Part, source: list[torch.Tensor]) -> float | None:
        """Relative q4 error of a sample of the delta of ``part``; None when it has no floating-point tensor."""
        coded = [i for i in part.indices if self.specs[i].coded]
        if not coded:
            return None
        i = max(coded, key=lambda j: self.specs[j].coded)
        k = self.pool.kernels()
        m = min(source[i].numel(), ERROR_SAMPLE, k.chunk)
        res = None if self.residual is None else self.residual[i][:m]
        load_delta(k, source[i].view(-1)[:m], self.base[i].view(-1)[:m], res, m)
        x = k.x[:m].clone()
        mp = k.padded(m)
        codec = self.codec
        device = self.base[i].device
        codes = codec.codes_view(torch.empty(codec.code_bytes(m), dtype=torch.uint8, device=device), m)
        scales = torch.empty(codec.scale_count(m), dtype=codec.scale_dtype, device=device)
        k.quantize(m, codes, scales)
        return relative_error(x, k.dequantize(codes, scales, mp)[:m])
