"""The data ledger on a host of several devices (host/ledger_data.py's ``lease_for_ranks``): rank 0 leases, the
other ranks take its answer over the host's control group (:class:`~lightning_nodeox.host.ranks.HostRanks`), and
each reads its place in rows of K. Two ranks in two processes (gloo), over a real ledger in rank 0."""

from __future__ import annotations

import os
import socket
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_nodeox.coordinator.ledger import DataLedger
from lightning_nodeox.core.ledger_order import DataOrder
from lightning_nodeox.host.ledger_data import lease_for_ranks
from lightning_nodeox.host.ledger_sampler import LedgerSampler
from lightning_nodeox.host.ranks import HostRanks

SAMPLES, UNIT = 1005, 100  # ten whole units and a short last one (5 positions: rows of 2 leave one over)


class Ledger:
    """Rank 0's client: leases of one unit for host ``a`` from a ledger in this process, counted."""

    def __init__(self) -> None:
        self.ledger = DataLedger(DataOrder(SAMPLES, seed=3, shuffle=True), unit_size=UNIT)
        self.calls = 0

    def lease(self, epoch, units):
        self.calls += 1
        return self.ledger.lease("a", units, epoch=epoch)


def _rank(rank: int, port: int, queue) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    ranks = HostRanks([], per_step=False)
    client = Ledger() if rank == 0 else None
    link = SimpleNamespace(lease=client.lease) if client else None  # rank 0 alone is linked
    session = SimpleNamespace(ranks=ranks, link=link)
    order = DataOrder(SAMPLES, seed=3, shuffle=True)
    sampler = LedgerSampler(lambda epoch: lease_for_ranks(session, epoch), order, rank=rank, ranks=2,
                            pause=lambda: True)
    first = list(sampler)  # the whole epoch: after the last unit a Wait (the host holds it all) ends the pass
    middle = sampler.take_covered(200)  # 200 rows trained: the stream's first 400 positions
    rest = sampler.take_covered(0, pass_ended=True)
    published = None
    if rank == 0:
        for delta, covered in enumerate((middle, rest)):  # two rounds' deltas
            client.ledger.covered("a", covered, delta=delta)
        published = client.ledger.publish([("a", 0), ("a", 1)]).epoch_ended
    ranks.lead(lambda: None, model=False)  # rank 1 waits for rank 0's publish
    second = next(iter(sampler))  # an EpochEnd, then epoch 1's first lease: every rank moves on together
    queue.put((rank, first, middle.to_dict(), rest.to_dict(), published, second, sampler.epoch,
               client.calls if client else None))
    ranks.close()
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_two_ranks_read_rank_0s_leases_in_rows_and_report_alike() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    queue = mp.get_context("spawn").Queue()
    procs = mp.start_processes(_rank, args=(port, queue), nprocs=2, join=False, start_method="spawn")
    while not procs.join(timeout=90):  # raises a rank's error
        pass
    got = {r[0]: r[1:] for r in (queue.get(timeout=10) for _ in range(2))}
    (first0, middle0, rest0, published, second0, epoch0, calls), (first1, middle1, rest1, _, second1, epoch1, _) = (
        got[0], got[1])
    order = DataOrder(SAMPLES, seed=3, shuffle=True).epoch(0)
    rows = order.indices(0, SAMPLES).tolist()
    assert first0 == rows[0::2] and first1 == rows[1::2] + [rows[-1]]  # the short last row filled, as DDP pads
    assert len(first0) == len(first1) == 503
    assert middle0 == middle1 and rest0 == rest1  # every rank reports the same; rank 0's goes with the delta
    assert sum(s[2] - s[1] for s in middle0["spans"]) == 400 and sum(s[2] - s[1] for s in rest0["spans"]) == 605
    assert calls == 14  # 11 units, the Wait that ended the pass, the EpochEnd and lease of the next: once each
    assert published == 0 and epoch0 == epoch1 == 1
    assert [second0, second1] == DataOrder(SAMPLES, seed=3, shuffle=True).epoch(1).indices(0, 2).tolist()
