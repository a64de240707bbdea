"""A host that spans machines: ``Trainer(num_nodes=M, devices=K)`` started by ``torchrun --nnodes M`` is one DDP
world and one host to the coordinator (its global rank 0 exchanges; every rank of every machine follows it).

The two "machines" here are two torchrun processes on this machine (gloo on the CPU), beside a host of one rank.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch.distributed as dist
from helpers import HOSTS, assert_identical, free_port, logs_of, run_together, torchrun
from lightning.fabric.plugins.environments import TorchElasticEnvironment
from lightning.pytorch import Trainer

from lightning_nodeox import NodeoxStrategy
from lightning_nodeox.host.devices import SEVERAL_DEVICES
from lightning_nodeox.host.ranks import check_one_host_id, host_id_problem

BATCH, LOCAL_STEPS, MAX_STEPS = 32, 4, 12


def torchelastic(monkeypatch, *, world: int, rank: int, local_rank: int, node: int) -> None:
    """The environment torchrun gives one of its ranks."""
    for name, value in {"TORCHELASTIC_RUN_ID": "test", "WORLD_SIZE": world, "RANK": rank, "LOCAL_RANK": local_rank,
                        "GROUP_RANK": node, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": 29400}.items():
        monkeypatch.setenv(name, str(value))


def test_machines_of_one_device_each_are_one_ddp_world_not_hosts_of_their_own() -> None:
    """Trainer(num_nodes=2, devices=1) was silently a world of one on each machine: now it is the host's DDP."""
    trainer = Trainer(strategy=NodeoxStrategy(), accelerator="cpu", devices=1, num_nodes=2, logger=False)
    assert trainer.world_size == 2 and trainer.num_nodes == 2
    assert trainer.strategy._devices is SEVERAL_DEVICES and trainer.strategy.launcher is not None


def test_under_torchrun_a_rank_of_the_second_machine_is_its_local_rank_0(monkeypatch) -> None:
    """Machine 1's first rank: global rank 2 of 4, local rank 0 (so Lightning runs prepare_data there, once per
    machine), not rank zero (it writes no logs or checkpoints); its CPU share is its machine's 2 ranks'."""
    torchelastic(monkeypatch, world=4, rank=2, local_rank=0, node=1)
    trainer = Trainer(strategy=NodeoxStrategy(), accelerator="cpu", devices=2, num_nodes=2, logger=False)
    assert (trainer.world_size, trainer.global_rank, trainer.local_rank, trainer.node_rank) == (4, 2, 0, 1)
    assert not trainer.is_global_zero and type(trainer.strategy.cluster_environment) is TorchElasticEnvironment
    assert len(trainer.strategy.parallel_devices) == 2  # what size_threads divides the quota by: ranks per machine


def test_a_launcher_that_started_other_ranks_than_the_trainer_expects_is_refused_with_the_fix(monkeypatch) -> None:
    torchelastic(monkeypatch, world=4, rank=0, local_rank=0, node=0)  # torchrun --nnodes 2 --nproc-per-node 2
    with pytest.raises(ValueError, match=r"num_nodes=2, devices=1\) is 2 machine\(s\) of 1 rank\(s\).*world size "
                                         r"\(4\).*torchrun --nnodes 2 --nproc-per-node 1"):
        Trainer(strategy=NodeoxStrategy(), accelerator="cpu", devices=1, num_nodes=2, logger=False)


def test_every_rank_of_a_host_carries_its_one_id() -> None:
    assert host_id_problem(["a", "a", "a"], spans_machines=True) is None
    assert host_id_problem([None, None], spans_machines=False) is None  # one machine: rank 0's default id
    assert host_id_problem(["a", None], spans_machines=False) is None  # a rank given none follows rank 0
    missing = host_id_problem([None, "a"], spans_machines=True)
    assert "rank 0 was given no host id" in missing and "NODEOX_HOST_ID to the same value on every machine" in missing
    other = host_id_problem(["a", "a", "b", None], spans_machines=True)
    assert "rank 0: 'a'; rank 2: 'b', rank 3: None" in other and "same value on every machine" in other
    assert "rank 1: 'b'" in host_id_problem(["a", "b"], spans_machines=False)
    many = host_id_problem(["a", *"bcdefg"], spans_machines=True)
    assert "rank 4: 'e', ...)" in many and "'f'" not in many


def test_the_host_id_check_gathers_every_ranks_id(tmp_path) -> None:
    """In a process group (of one rank here): the id given is compared with rank 0's, the same on every rank."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        check_one_host_id("a", spans_machines=True)
        with pytest.raises(ValueError, match="rank 0 was given no host id"):
            check_one_host_id(None, spans_machines=True)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_a_host_of_two_machines_beside_a_host_of_one_rank(coordinator, tmp_path) -> None:
    """Two torchrun nodes (--nnodes 2 --nproc-per-node 1) with one NODEOX_HOST_ID are host 0; host 1 is one
    process. The coordinator sees two hosts; all three processes end on the run's last model, bit for bit."""
    coord = coordinator(2)
    out = tmp_path / "out"
    host = [str(HOSTS / "digits_host.py"), "--out", str(out), "--max-steps", str(MAX_STEPS), "--local-steps",
            str(LOCAL_STEPS), "--epoch-value"]
    port = free_port()
    env = {"NODEOX_COORDINATOR_URL": coord.url}
    commands = {f"host0.node{n}": (torchrun("--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(n),
                                            "--master-addr", "127.0.0.1", "--master-port", str(port), *host,
                                            "--num-nodes", "2"), dict(env, NODEOX_HOST_ID="0"))
                for n in (0, 1)}
    commands["host1"] = ([sys.executable, *host], dict(env, NODEOX_HOST_ID="1"))
    codes = run_together(commands, tmp_path, timeout=180)
    assert set(codes.values()) == {0}, logs_of(tmp_path, codes)
    events = coord.events()
    published = [e["model_hash"] for e in events if e["phase"] == "sync_prepare"]
    assert len(published) == MAX_STEPS // LOCAL_STEPS
    # rank 0 (machine 0), rank 1 (machine 1) and host 1 hold the same bytes, hashing to the last published model
    assert assert_identical(out, ["0", "0.rank1", "1"]) == published[-1]
    after = {n: json.loads((out / f"host{n}_after_fit.json").read_text()) for n in ("0", "0.rank1", "1")}
    assert {a["model_hash"] for a in after.values()} == {published[-1]}
    assert [a["global_step"] for a in after.values()] == [MAX_STEPS] * 3  # the machines stopped together
    # one host at the coordinator: two ids in the records, two hosts in every round, host 0 counting both ranks
    assert {e["host"] for e in events} == {"0", "1", "coordinator"}
    assert [sorted(e["hosts"]) for e in events if e["phase"] == "aggregate"] == [["0", "1"]] * len(published)
    train_records = [e for e in events if e["phase"] == "train"]
    assert len(train_records) == 2 * len(published)  # one per host and round: host 0's rank 1 sends none
    trained = {(e["host"], e["round"]): e for e in train_records}
    for r in range(len(published)):
        assert (trained[("0", r)]["ranks"], trained[("0", r)]["samples"]) == (2, 2 * LOCAL_STEPS * BATCH)
        assert (trained[("1", r)]["ranks"], trained[("1", r)]["samples"]) == (1, LOCAL_STEPS * BATCH)
    # a DistributedSampler over both machines: each rank trains on its own batches
    losses = [json.loads((out / f"host{n}_losses.json").read_text()) for n in ("0", "0.rank1")]
    assert len(losses[0]) == len(losses[1]) == MAX_STEPS and losses[0] != losses[1]
    # sync_dist: reduced across the host's machines first (ranks 0 and 1: 0.5), then across hosts by samples
    # (host 0 trains on twice host 1's): (0.5 * 2 + 0 * 1) / 3 on every rank of every host
    names = ("0", "0.rank1", "1")
    metrics = [json.loads((out / f"host{n}_metrics.json").read_text()) for n in names]
    for m in metrics:
        assert m["rank_mean"] == pytest.approx(1 / 3, abs=1e-6)
        assert m["rank_epoch"] == pytest.approx(1 / 3, abs=1e-6)  # an epoch value, exchanged at fit's end
    # a torchmetrics Accuracy: one number everywhere, over the samples of all three ranks
    counts = [c for n in names for c in json.loads((out / f"host{n}_counts.json").read_text())]
    assert len(counts) == 3 * MAX_STEPS
    assert metrics[0]["acc"] == metrics[1]["acc"] == metrics[2]["acc"] == pytest.approx(
        sum(c for c, _ in counts) / sum(k for _, k in counts), rel=1e-6)
    # only the host's global rank 0 writes its logs (Lightning's rank zero)
    assert (out / "tb_host0").is_dir() and len(list((out / "tb_host0").rglob("events.out.tfevents.*"))) == 1
