"""Hosts with several devices: DDP over a host's ranks (gloo on the CPU here), one exchange per host.

A host of 2 ranks and a host of 1 rank train together, started by `nodeox launch` (Lightning starts the second
rank) and by torchrun; all three processes end on the same bytes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import HOSTS, REPO, forked, launch, load, logs_of, read_events, run_together, torchrun
from lightning.pytorch import Trainer

from lightning_nodeox import NodeoxStrategy
from lightning_nodeox.tools.environments import gpu_sets

BATCH, LOCAL_STEPS, MAX_STEPS = 32, 4, 12


def same_bytes(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8))
                                        for k in a)


def assert_all_end_identical(out: Path, published: str) -> None:
    """host0 (rank 0), host0.rank1 and host1 hold the same final tensors, hashing to the run's last model."""
    finals = [load(out / f"{name}_final.safetensors") for name in ("host0", "host0.rank1", "host1")]
    for tensors, meta in finals[1:]:
        assert same_bytes(finals[0][0], tensors)
        assert meta["model_hash"] == published
    assert finals[0][1]["model_hash"] == published


def assert_ranks_identical_after_every_round(out: Path) -> None:
    rounds = sorted(p.name.split("_")[1] for p in out.glob("host0_round*.safetensors"))
    assert len(rounds) >= 2
    for name in rounds:
        assert same_bytes(load(out / f"host0_{name}")[0], load(out / f"host0.rank1_{name}")[0]), name


def test_trainer_with_several_devices_is_a_ddp_host_and_one_device_a_world_of_one() -> None:
    several = Trainer(strategy=NodeoxStrategy(), accelerator="cpu", devices=2, logger=False)
    assert several.world_size == 2 and several.strategy.launcher is not None
    one = Trainer(strategy="nodeox", accelerator="cpu", devices=1, logger=False)
    assert one.world_size == 1 and one.strategy.launcher is None and one.strategy.is_global_zero


@pytest.mark.slow
def test_launch_a_host_of_two_ranks_and_one_of_one_rank_with_overlap(tmp_path) -> None:
    """Lightning starts host 0's second rank; rank 0 alone exchanges, folds and shares its model with rank 1."""
    run_dir, out = tmp_path / "run", tmp_path / "out"
    result = launch(run_dir, 2, [sys.executable, str(HOSTS / "digits_host.py"), "--out", str(out), "--devices", "2,1",
                                 "--max-steps", str(MAX_STEPS), "--local-steps", str(LOCAL_STEPS),
                                 "--overlap", "eager", "--epoch-value"], "--outer-optimizer", "nesterov",
                    timeout=300)
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-3000:]
    events = read_events(run_dir)
    published = [e["model_hash"] for e in events if e["phase"] == "sync_prepare"]
    assert_all_end_identical(out, published[-1])
    assert_ranks_identical_after_every_round(out)
    assert {e["host"] for e in events} == {"0", "1", "coordinator"}  # one host id per host, whatever its ranks
    # the delta of a host of 2 ranks counts the samples of both
    trained = {(e["host"], e["round"]): e for e in events if e["phase"] == "train"}
    for r in range(MAX_STEPS // LOCAL_STEPS):
        assert trained[("0", r)]["ranks"] == 2 and trained[("0", r)]["samples"] == 2 * LOCAL_STEPS * BATCH
        assert trained[("1", r)]["ranks"] == 1 and trained[("1", r)]["samples"] == LOCAL_STEPS * BATCH
    assert {e["host"] for e in events if e["phase"] == "fold"} == {"0", "1"}
    # Lightning's DistributedSampler gives each rank its own batches: the ranks' losses differ
    losses0 = json.loads((out / "host0_losses.json").read_text())
    losses1 = json.loads((out / "host0.rank1_losses.json").read_text())
    assert len(losses0) == len(losses1) == MAX_STEPS and losses0 != losses1
    # self.log(sync_dist=True) reduces across the host's ranks, as in DDP (host 0: 0.5), then across hosts weighted
    # by samples (host 0 trains on twice host 1's): every rank of every host ends with (0.5 * 2 + 0 * 1) / 3
    for name in ("host0", "host0.rank1", "host1"):
        value = json.loads((out / f"{name}_metrics.json").read_text())["rank_mean"]
        assert value == pytest.approx(1 / 3, abs=1e-6), name
    # so does an epoch value, exchanged at fit's end (the epoch's) by host 0's rank 0; its rank 1 takes the answer
    epoch = [json.loads((out / f"{name}_metrics.json").read_text())["rank_epoch"] for name in ("host0", "host0.rank1",
                                                                                              "host1")]
    assert epoch[0] == epoch[1] == epoch[2] == pytest.approx(1 / 3, abs=1e-6)
    # and a torchmetrics Accuracy: one number on every rank of every host, over the samples of all three ranks
    names = ("host0", "host0.rank1", "host1")
    counts = [c for name in names for c in json.loads((out / f"{name}_counts.json").read_text())]
    acc = [json.loads((out / f"{name}_metrics.json").read_text())["acc"] for name in names]
    assert len(counts) == 3 * MAX_STEPS
    assert acc[0] == acc[1] == acc[2] == pytest.approx(sum(c for c, _ in counts) / sum(n for _, n in counts), rel=1e-6)


@pytest.mark.slow
def test_torchrun_host_of_two_ranks_with_a_time_budget_and_delayed_overlap(coordinator, tmp_path) -> None:
    """`torchrun --nproc-per-node 2` starts host 0 (Lightning finds torchrun's environment); rank 0 decides when
    each round's time budget is spent and when a sync is folded in, so both ranks do each on the same step."""
    coord = coordinator(2)
    out = tmp_path / "out"
    host = [str(HOSTS / "digits_host.py"), "--out", str(out), "--max-steps", "20", "--step-seconds", "0.02",
            "--round-seconds", "0.1", "--overlap", "delayed"]
    env = {"NODEOX_COORDINATOR_URL": coord.url}
    codes = run_together({"host0": (torchrun("--standalone", "--nproc-per-node", "2", *host, "--devices", "2"),
                                    dict(env, NODEOX_HOST_ID="0")),
                          "host1": ([sys.executable, *host, "--devices", "1"], dict(env, NODEOX_HOST_ID="1"))},
                         tmp_path, timeout=240)
    assert codes == {"host0": 0, "host1": 0}, logs_of(tmp_path, codes)
    published = [e["model_hash"] for e in coord.events() if e["phase"] == "sync_prepare"]
    assert_all_end_identical(out, published[-1])
    assert_ranks_identical_after_every_round(out)
    # the first host to reach max_steps ends the run: both ranks of host 0 stop together, at the same step (steps
    # taken after the run completed, during an overlapped round, are not sent: the host ends on the run's model)
    steps = [e["steps"] for e in coord.events() if e["phase"] == "train" and e["host"] == "0"]
    ended = [json.loads((out / f"{name}_after_fit.json").read_text())["global_step"]
             for name in ("host0", "host0.rank1")]
    assert ended[0] == ended[1] and 0 < sum(steps) <= ended[0] <= 20
    assert all(e["ranks"] == 2 for e in coord.events() if e["phase"] == "train" and e["host"] == "0")


@pytest.mark.slow
def test_a_failure_on_rank_0_stops_every_rank_of_the_host_with_its_message(tmp_path) -> None:
    """Rank 0 cannot join (no coordinator URL): the other rank stops at once too, naming rank 0's error."""
    env = {k: v for k, v in os.environ.items() if k != "NODEOX_COORDINATOR_URL"}
    env.update(OMP_NUM_THREADS="1", NODEOX_HOST_ID="0",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run(forked([*torchrun("--standalone", "--nproc-per-node", "2"),
                                    str(HOSTS / "digits_host.py"), "--out", str(tmp_path / "out"), "--devices", "2"]),
                            env=env, cwd=REPO, capture_output=True, text=True, timeout=180, check=False)
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "ValueError: NodeoxStrategy needs the coordinator's URL" in output
    assert "rank 0 of this host stopped (ValueError: NodeoxStrategy needs the coordinator's URL" in output


def test_launch_gives_each_host_its_own_gpus() -> None:
    assert gpu_sets(8, 2, 4) == ["0,1,2,3", "4,5,6,7"]
    assert gpu_sets(8, 8, 1) == [str(i) for i in range(8)]
    assert gpu_sets(4, 2, 4) == [None, None]  # too few: every host sees every GPU
