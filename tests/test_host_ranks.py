"""What rank 0 of a host of several devices sends its other ranks (host/ranks.py): the live tensors its call wrote
(a round's set as the sync applied it, an overlap fold's, the delayed snapshot's), all of them after the join, a
fetched model or the run's end; a frozen backbone stays put. Rounds in this process (one host of a world of one
in a gloo group, beside a second host), and two ranks in two processes (one slow test)."""

from __future__ import annotations

import hashlib
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import both
from local_transport import LocalClient
from torch import nn

from lightning_nodeox.core.phases import PhaseLog
from lightning_nodeox.host.ranks import HostRanks
from lightning_nodeox.host.round import HostRound, Into
from lightning_nodeox.host.tensors import HostTensors


def finetune(seed: int = 0) -> nn.Module:
    """A frozen backbone under a trained head, with BatchNorm statistics (buffers always move)."""
    torch.manual_seed(seed)
    module = nn.Sequential(nn.Linear(32, 256), nn.Linear(256, 64), nn.BatchNorm1d(64), nn.Linear(64, 4))
    module[0].requires_grad_(False), module[1].requires_grad_(False)
    return module


def train(module: nn.Module, seed: int) -> None:
    """Stand-in training: the tensors that move change, the frozen ones do not."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in module.state_dict(keep_vars=True).values():
            if t.is_floating_point() and (not isinstance(t, nn.Parameter) or t.requires_grad):
                t.add_(torch.randn(t.shape, generator=gen) * 0.01)


def hosts(local_coordinator) -> tuple[list[nn.Module], list[HostRound]]:
    c = local_coordinator()
    modules = [finetune(), finetune()]
    rounds = [HostRound(HostTensors.of_module(m), LocalClient(c, h), PhaseLog(h)) for m, h in zip(modules, "ab")]
    return modules, rounds


def moving(tensors: HostTensors) -> tuple[int, ...]:
    return tuple(i for i, n in enumerate(tensors.names) if not n.startswith(("0.", "1.")))


def nbytes(tensors: HostTensors, indices) -> int:
    return sum(tensors.live[i].numel() * tensors.live[i].element_size() for i in indices)


def test_each_path_that_writes_rank_0s_live_model_records_the_tensors_it_wrote(local_coordinator) -> None:
    (ma, mb), (a, b) = hosts(local_coordinator)
    both(a.join, b.join)
    ta = a.tensors
    assert ta.take_changed() == tuple(range(len(ta.live)))  # joined: the other ranks take everything once
    assert ta.take_changed() == ()
    train(ma, 1), train(mb, 2)
    both(lambda: a.run_round(8, False), lambda: b.run_round(8, False))
    assert ta.take_changed() == moving(ta) == ta.part.indices  # the round's set, applied to the live model
    # overlapped: the exchange writes base alone; the fold writes what the snapshot set aside
    train(ma, 3), train(mb, 4)
    ta.take_snapshot(restart_from_base=False), b.tensors.take_snapshot(restart_from_base=False)
    both(lambda: a.run_overlapped(8, False), lambda: b.run_overlapped(8, False))
    assert ta.take_changed() == ()
    ta.fold(), b.tensors.fold()
    assert ta.take_changed() == moving(ta)
    ta.take_snapshot(restart_from_base=True)  # delayed: the moving tensors go back to θ_r
    assert ta.take_changed() == moving(ta)
    a.fetch_model(Into.BASE)  # overlapped fetch: base alone, until the fold takes all of it
    assert ta.take_changed() == ()
    ta.fold()
    assert ta.take_changed() == tuple(range(len(ta.live)))
    a.fetch_model(Into.LIVE)
    assert ta.take_changed() == tuple(range(len(ta.live)))
    ta.restore_live()  # the run completed: the live model is θ_r again, whole
    assert ta.take_changed() == tuple(range(len(ta.live)))
    for h in (a, b):
        h.close()


@pytest.fixture
def world_of_one(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_host_of_several_ranks_sends_them_the_rounds_set_and_not_its_frozen_backbone(local_coordinator, world_of_one,
                                                                                      monkeypatch) -> None:
    """Rank 0 leads a round for real; the tensors broadcast to the other ranks are counted."""
    (ma, mb), (a, b) = hosts(local_coordinator)
    ranks = HostRanks(list(a.tensors.live), per_step=False)
    sent: list[int] = []
    real = dist.broadcast
    monkeypatch.setattr(dist, "broadcast", lambda t, src, **kw: (sent.append(t.data_ptr()), real(t, src, **kw))[1])
    ptrs = [t.data_ptr() for t in a.tensors.live]

    def join() -> None:
        a.join()
        ranks.changed = a.tensors.take_changed  # as HostSession._join does

    both(lambda: ranks.lead(join), b.join)
    assert sent == ptrs  # the join: every tensor
    whole = nbytes(a.tensors, range(len(ptrs)))
    per_round = []
    for r in range(2):
        sent.clear()
        train(ma, 10 + r), train(mb, 20 + r)
        both(lambda: ranks.lead(lambda: a.run_round(8, False)), lambda: b.run_round(8, False))
        assert sent == [ptrs[i] for i in moving(a.tensors)]
        per_round.append(nbytes(a.tensors, moving(a.tensors)))
    sent.clear()
    assert ranks.lead(lambda: a.round, model=False) == 2 and sent == []  # an outcome alone
    ranks.lead(lambda: a.fetch_model(Into.LIVE))
    assert sent == ptrs
    # the head and the BatchNorm layer (fp32 weights and statistics, an int64 counter): 2% of the model here
    head = (64 * 4 + 4 + 4 * 64) * 4 + 8
    assert per_round == [head, head] and whole == head + (32 * 256 + 256 + 256 * 64 + 64) * 4
    ranks.close()
    for h in (a, b):
        h.close()


# -- two ranks in two processes ---------------------------------------------------------------------------------

def _digests(tensors: list[torch.Tensor]) -> list[str]:
    return [hashlib.sha256(t.numpy().tobytes()).hexdigest() for t in tensors]


def _rank(rank: int, port: int, queue) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    gen = torch.Generator().manual_seed(rank)  # each rank starts on its own values
    tensors = [torch.randn(512, 64, generator=gen), torch.randn(4, 64, generator=gen), torch.randn(64, generator=gen)]
    ranks = HostRanks(tensors, per_step=False)
    writes = iter([(0, 1, 2), (1, 2), (2,)])  # rank 0's: joined (all), a round's head and buffer, a buffer
    ranks.changed = lambda: next(writes)
    received = []
    real = dist.broadcast

    def counted(t, src, **kw):
        received.append(t.numel() * t.element_size())
        return real(t, src, **kw)

    dist.broadcast = counted
    ranks.lead(lambda: "joined")
    same_after_join = [t.clone() for t in tensors]
    for step in range(2):  # rank 0 writes what its calls name; tensor 0 (a frozen backbone) stays as joined
        if rank == 0:
            with torch.no_grad():
                for i in ((1, 2), (2,))[step]:
                    tensors[i].add_(1.0)
        ranks.lead(lambda s=step: s)
    try:
        ranks.lead(lambda: 1 / 0)
        failed = ""
    except (ZeroDivisionError, RuntimeError) as e:
        failed = str(e)
    dist.broadcast = real
    queue.put((rank, _digests(tensors), received, failed, _digests(same_after_join)))  # the process ends now
    ranks.close()
    dist.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_end_bit_identical_and_only_what_rank_0_wrote_travels() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    ranks = mp.start_processes(_rank, args=(port, queue), nprocs=2, join=False, start_method="spawn")
    got = {r[0]: r[1:] for r in (queue.get(timeout=120) for _ in range(2))}
    while not ranks.join(timeout=60):
        pass
    (final0, received0, failed0, joined0), (final1, received1, failed1, joined1) = got[0], got[1]
    assert final0 == final1
    assert joined0 == joined1  # the join gave rank 1 rank 0's values
    sizes = [512 * 64 * 4, 4 * 64 * 4, 64 * 4]
    assert received1 == received0 == [*sizes, sizes[1], sizes[2], sizes[2]]  # the backbone travels once
    assert failed0 == "division by zero"
    assert failed1 == "rank 0 of this host stopped (ZeroDivisionError: division by zero); rank 1 stops with it"
