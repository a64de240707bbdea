"""Base's row digests (host/digests.py): the model hash of base, kept per tensor until base changes there."""

from __future__ import annotations

import torch

from lightning_nodeox.core.hashing import model_hash
from lightning_nodeox.core.pool import WorkerPool
from lightning_nodeox.core.codecs.settings import Q4Settings
from lightning_nodeox.host.digests import BaseDigests

NAMES = ["a", "b", "c"]


def base() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(300, generator=gen), torch.randn(20, 7, generator=gen), torch.arange(5)]


def test_the_base_hash_is_the_model_hash_and_its_digests_are_kept_until_forgotten() -> None:
    tensors, pool = base(), WorkerPool(Q4Settings(), "cpu", 1)
    digests = BaseDigests(NAMES, tensors, pool)
    assert digests.base_hash() == model_hash(list(zip(NAMES, tensors)), pool)
    tensors[0].add_(1.0)
    stale = digests.base_hash()  # kept: base changed behind its back, the hash does not see it
    assert stale != model_hash(list(zip(NAMES, tensors)), pool)
    digests.forget([0])
    assert digests.base_hash() == model_hash(list(zip(NAMES, tensors)), pool)
    tensors[1].mul_(2.0)
    digests.forget_all()
    assert digests.base_hash() == model_hash(list(zip(NAMES, tensors)), pool)
    pool.close()


def test_an_applys_fresh_hashers_and_the_kept_ones_make_the_hash_of_the_new_base() -> None:
    tensors, pool = base(), WorkerPool(Q4Settings(), "cpu", 1)
    digests = BaseDigests(NAMES, tensors, pool)
    digests.base_hash()
    changed = (0, 2)
    digests.forget(changed)
    tensors[0].sub_(0.5)
    tensors[2].add_(3)
    fresh = digests.fresh(changed)
    hashers = digests.after_apply(changed, fresh, unfused={0, 1})  # nothing fused during the apply: all digested now
    assert [hashers[i] for i in changed] == fresh
    assert digests.digest(hashers) == model_hash(list(zip(NAMES, tensors)), pool)
    assert digests.base_hash() == model_hash(list(zip(NAMES, tensors)), pool)  # the digests are kept
    pool.close()
