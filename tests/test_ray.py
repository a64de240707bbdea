"""lightning_nodeox.ray on a real local Ray cluster (one, shared by the module's tests; the coordinator and relays bind 127.0.0.1): tiny
digits hosts (tests/hosts/ray_digits.py) trained in their actors, the coordinator and relays as actors supervising
their processes. Each test checks bit-identity (hashes and bytes) and round counts."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

ray = pytest.importorskip("ray")

from helpers import HOSTS, REPO, assert_identical, bits, load, published, read_events, wait_for  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

import lightning_nodeox.ray as nodeox_ray  # noqa: E402

sys.path.insert(0, str(HOSTS))
import ray_digits  # noqa: E402

pytestmark = pytest.mark.slow

ROUNDS = 3  # --max-steps 30 --local-steps 10
FAST = ("--threads", "1", "--lease", "4")  # a killed host's lease ends soon


@pytest.fixture(scope="module")
def cluster():
    """A Ray cluster of one node (8 logical CPUs, 2 "slot"s for the growth test's hosts), the test hosts' folder on
    its workers' path; shut down after the module."""
    path = os.pathsep.join([str(REPO), str(HOSTS), os.environ.get("PYTHONPATH", "")])
    c = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 8, "resources": {"slot": 2}, "include_dashboard": False})
    ray.init(address=c.address, runtime_env={"env_vars": {"PYTHONPATH": path, "OMP_NUM_THREADS": "1"}},
             logging_level="WARNING")
    yield c
    ray.shutdown()
    c.shutdown()


def digits(out: Path, *args: str) -> list[str]:
    return ["--out", str(out), "--max-steps", "30", "--local-steps", "10", *args]


def assert_final_model_is_the_hosts(result, out: Path, hosts: list[str]) -> None:
    """The hosts end bit-identical, and the model the driver got back is theirs, bytes and hash."""
    digest = assert_identical(out, hosts)
    assert result.model.model_hash == digest
    tensors, _ = load(out / f"host{hosts[0]}_final.safetensors")
    assert set(tensors) == set(result.model.tensors)
    assert all(torch.equal(bits(tensors[k]), bits(result.model.tensors[k])) for k in tensors)


@pytest.mark.timeout(120)
def test_two_hosts_end_bit_identical_and_the_driver_gets_their_final_model(cluster, tmp_path: Path) -> None:
    out, run_dir = tmp_path / "out", tmp_path / "run"
    result = nodeox_ray.run(ray_digits.train, digits(out), hosts=2, run_dir=run_dir, bind_host="127.0.0.1",
                            coordinator_args=FAST, timeout=100)
    assert_final_model_is_the_hosts(result, out, ["0", "1"])
    assert sorted(published(run_dir)) == list(range(ROUNDS))
    assert result.model.round == ROUNDS
    for h in (0, 1):
        assert result.hosts[h].ending is nodeox_ray.Ending.DONE and result.hosts[h].restarts == 0
        assert result.hosts[h].value["model_hash"] == result.model.model_hash
        assert result.hosts[h].value["last_round"] == ROUNDS - 1
