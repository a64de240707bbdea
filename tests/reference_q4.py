"""A plain, whole-tensor q4 implementation: the specification the chunked kernels are tested against."""

from __future__ import annotations

import torch

from lightning_nodeox.core.codec import chunk_ranges, stochastic_seed
from lightning_nodeox.core.codecs import Kernels, codec_for
from lightning_nodeox.core.codecs.q4 import CODE_OFFSET, LEVELS
from lightning_nodeox.core.codecs.settings import CodecSettings


def chunk_noise(n: int, block_size: int, seed: int, chunk: int) -> torch.Tensor:
    """The noise of stochastic rounding over ``n`` values padded to whole blocks, as the kernels draw it:
    ``uniform(-0.5, 0.5)`` from a generator seeded per chunk of ``chunk`` values (the kernels' chunk size)."""
    noise = torch.empty(-(-n // block_size) * block_size)
    for s, e in chunk_ranges(n, chunk):
        mp = -(-(e - s) // block_size) * block_size
        noise[s : s + mp].uniform_(-0.5, 0.5, generator=torch.Generator().manual_seed(stochastic_seed(seed, s)))
    return noise


def encode_reference(x: torch.Tensor, settings: CodecSettings, *, seed: int | None = None, chunk: int = 0):
    """(codes as uint8 packed bytes, scales) of flat ``x`` by the q4 definition.

    Stochastic rounding draws the kernels' own noise (:func:`chunk_noise`).
    """
    bs = settings.block_size
    n = x.numel()
    nb = -(-n // bs)
    padded = torch.zeros(nb * bs, dtype=torch.float32)
    padded[:n] = x.float()
    blocks = padded.view(nb, bs)
    scale = blocks.abs().amax(dim=1) / LEVELS
    if settings.scale_dtype == "fp16":
        scale = scale.to(torch.float16).float()
    inv = 1.0 / scale.clamp_min(1e-30)
    y = blocks * inv[:, None]
    if seed is not None:  # stochastic rounding
        y = (y + chunk_noise(n, bs, seed, chunk).view(nb, bs)).clamp(-LEVELS, LEVELS)
    elif settings.scale_dtype == "fp16":
        y = y.clamp(-LEVELS, LEVELS)
    q = torch.round(y).to(torch.int64).view(-1) + CODE_OFFSET
    packed = (q[0::2] | (q[1::2] << 4)).to(torch.uint8)
    return packed, scale.to(codec_for(settings).scale_dtype)


def decode_reference(packed: torch.Tensor, scales: torch.Tensor, n: int, block_size: int) -> torch.Tensor:
    p = packed.to(torch.int64)
    q = torch.stack([p & 15, p >> 4], dim=1).view(-1) - CODE_OFFSET
    values = q.float().view(-1, block_size) * scales.float()[:, None]
    return values.view(-1)[:n]


def kernels(settings: CodecSettings, chunk: int = 256) -> Kernels:
    """The kernels of the codec of ``settings`` with a small chunk, so that tests cross many chunk boundaries."""
    return codec_for(settings).kernels("cpu", chunk)
