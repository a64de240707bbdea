"""A sync applied piece by piece (host/applying.py): base += the dequantized sync, the target takes base's
values, raw tensors take the sync's, and the rows the apply could not digest are named."""

from __future__ import annotations

import torch
from helpers import encoded
from reference_q4 import kernels

from lightning_nodeox.core.codec import decode_tensor, encode_tensor
from lightning_nodeox.core.hashing import RowHasher
from lightning_nodeox.core.pool import WorkerPool
from lightning_nodeox.core.codecs.settings import Q4Settings
from lightning_nodeox.core.specs import spec_of
from lightning_nodeox.core.wire import Message, MessageLayout
from lightning_nodeox.host.applying import Applying, PieceApply
from lightning_nodeox.host.parts import Part
from lightning_nodeox.host.staging import Staging

SETTINGS = Q4Settings()


def test_each_piece_moves_base_by_the_sync_and_the_target_takes_base() -> None:
    gen = torch.Generator().manual_seed(1)
    named = [("w", torch.randn(900, generator=gen)), ("n", torch.tensor([1, 2])), ("v", torch.randn(40, generator=gen))]
    specs = spec_of(named)
    base = [t.clone() for _, t in named]
    live = [t.clone() + 1 for _, t in named]
    before = [t.clone() for t in base]
    change = [torch.randn(900, generator=gen) * 0.01, torch.randn(40, generator=gen) * 0.01]
    sync = encoded(change, [specs[0], specs[2]])
    part = Part((0, 2), specs)
    pool = WorkerPool(SETTINGS, "cpu", 1)
    apply = PieceApply(specs, base, pool, Staging(torch.device("cpu"), MessageLayout.of(specs, SETTINGS), 64))
    fresh = [RowHasher(base[i]) for i in part.indices]
    applying = Applying(sync, part, live, fresh)
    for k in range(len(sync.layout.pieces)):
        apply.piece(applying, k)
    assert applying.applied == len(sync.layout.pieces)
    for j, i in enumerate(part.indices):
        step = torch.empty(specs[i].numel)
        decode_tensor(kernels(SETTINGS), sync.codes(j), sync.scales(j), step)
        assert torch.equal(base[i], before[i] + step) and torch.equal(live[i], base[i])
    assert torch.equal(base[1], before[1]) and torch.equal(live[1], before[1] + 1)  # not in the sync
    assert applying.unfused(pool.chunk) == {j for j, h in enumerate(fresh) if not h.fusable(pool.chunk)}
    pool.close()


def test_a_raw_tensor_takes_the_syncs_values_in_base_and_the_target() -> None:
    named = [("w", torch.zeros(64)), ("n", torch.tensor([1, 2]))]
    specs = spec_of(named)
    base = [t.clone() for _, t in named]
    live = [t.clone() for _, t in named]
    sync = Message.allocate(MessageLayout.of(specs, SETTINGS))
    encode_tensor(kernels(SETTINGS), torch.zeros(64), sync.codes(0), sync.scales(0))
    sync.raw(1).copy_(torch.tensor([8, 9]).view(torch.uint8))
    part = Part((0, 1), specs)
    pool = WorkerPool(SETTINGS, "cpu", 1)
    apply = PieceApply(specs, base, pool, Staging(torch.device("cpu"), MessageLayout.of(specs, SETTINGS), 64))
    applying = Applying(sync, part, live, [RowHasher(base[i]) for i in part.indices])
    for k in range(len(sync.layout.pieces)):
        apply.piece(applying, k)
    assert torch.equal(base[1], torch.tensor([8, 9])) and torch.equal(live[1], torch.tensor([8, 9]))
    assert 1 in applying.unfused(pool.chunk)  # a raw tensor's rows are digested after the apply
    pool.close()
