"""The model hash: exact, sensitive to every byte, the same however it is computed."""

from __future__ import annotations

import torch

from lightning_nodeox.core.hashing import ROW_WORDS, model_hash
from lightning_nodeox.core.pool import WorkerPool
from lightning_nodeox.core.codecs.settings import Q4Settings


def named(*tensors):
    return [(f"t{i}", t) for i, t in enumerate(tensors)]


def test_equal_models_equal_hashes() -> None:
    a = [torch.randn(ROW_WORDS * 3 + 17), torch.randn(5, 3), torch.randn(7).to(torch.bfloat16)]
    b = [t.clone() for t in a]
    assert model_hash(named(*a)) == model_hash(named(*b))


def test_every_single_bit_flip_changes_the_hash() -> None:
    t = torch.randn(ROW_WORDS * 2 + 3)  # full rows, a partial row and trailing bytes (odd count of fp32)
    reference = model_hash(named(t))
    raw = t.view(torch.uint8)
    gen = torch.Generator().manual_seed(0)
    for position in torch.randint(0, raw.numel(), (64,), generator=gen).tolist() + [0, raw.numel() - 1]:
        flipped = t.clone()
        flipped.view(torch.uint8)[position] ^= 1 << (position % 8)
        assert model_hash(named(flipped)) != reference, position


def test_names_shapes_and_dtypes_count() -> None:
    t = torch.zeros(12)
    base = model_hash([("w", t)])
    assert model_hash([("v", t)]) != base
    assert model_hash([("w", t.view(3, 4))]) != base
    assert model_hash([("w", t.to(torch.float64))]) != base


def test_swapping_elements_changes_the_hash() -> None:
    t = torch.arange(100, dtype=torch.float32)
    swapped = t.clone()
    swapped[[3, 70]] = swapped[[70, 3]]
    assert model_hash(named(t)) != model_hash(named(swapped))


def test_parallel_pool_gives_the_same_hash() -> None:
    tensors = named(torch.randn(ROW_WORDS * 40 + 5), torch.randn(3))
    pool = WorkerPool(Q4Settings(), "cpu", threads=2)
    try:
        assert model_hash(tensors, pool) == model_hash(tensors)
    finally:
        pool.close()


def test_hash_digested_while_applying_equals_the_plain_hash() -> None:
    """The fused path (rows digested chunk by chunk inside apply) gives the same hash as hashing afterwards."""
    from lightning_nodeox.core.codec import apply_sync, encode_tensor
    from lightning_nodeox.core.codecs.blockwise import block_count
    from lightning_nodeox.core.codecs.q4 import code_bytes
    from lightning_nodeox.core.hashing import RowHasher, combine

    settings = Q4Settings()
    pool = WorkerPool(settings, "cpu", threads=2)
    try:
        named = named_ = [("w", torch.randn(ROW_WORDS * 9 + 5)), ("b", torch.randn(1001).to(torch.bfloat16))]
        hashers = [RowHasher(t) for _, t in named]
        tasks = []
        for (_, t), hasher in zip(named, hashers):
            flat = t.view(-1)
            codes = torch.empty(code_bytes(flat.numel(), 64), dtype=torch.uint8)
            scales = torch.empty(block_count(flat.numel(), 64), dtype=torch.float16)
            encode_tensor(pool.kernels(), torch.randn(flat.numel()) * 1e-2, codes, scales)
            assert hasher.fusable(pool.chunk)
            for a, b in pool.split(flat.numel()):
                tasks.append(lambda k, f=flat, c=codes, s=scales, a=a, b=b, h=hasher:
                             apply_sync(k, c, s, f.clone(), f, start=a, stop=b, hasher=h))
        pool.run(tasks)
        assert combine(named_, hashers) == model_hash(named_)
    finally:
        pool.close()


def test_misaligned_tensors_are_hashed_as_they_are_when_digested() -> None:
    from lightning_nodeox.core.hashing import RowHasher, combine

    storage = torch.zeros(1 + ROW_WORDS * 2 + 7)
    t = storage[1:]  # 4-byte offset: not 8-byte aligned, so digested from a copy
    hasher = RowHasher(t)
    assert not hasher.fusable(1 << 17)
    t.add_(1.0)  # changed after the hasher was made, before it digests
    for task in hasher.tasks():
        task(None)
    assert combine([("t", t)], [hasher]) == model_hash([("t", t.clone())])
