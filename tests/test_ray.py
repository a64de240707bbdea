"""lightning_nodeox.ray on a real local Ray cluster (one, shared by the module's tests; the coordinator and relays
bind 127.0.0.1): tiny digits hosts (tests/hosts/ray_digits.py) trained in their actors, the coordinator and relays
as actors supervising their processes. Each test checks bit-identity (hashes and bytes) and round counts."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

ray = pytest.importorskip("ray")

from helpers import HOSTS, REPO, assert_identical, bits, load, published, received, wait_for  # noqa: E402
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
    its workers' path; shut down after the module, and the environment ray.init changed (PYTHONBREAKPOINT, RAY_*)
    put back, so that later tests (the zygote's) see the session's."""
    saved = dict(os.environ)
    path = os.pathsep.join([str(REPO), str(HOSTS), os.environ.get("PYTHONPATH", "")])
    c = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 8, "resources": {"slot": 2}, "include_dashboard": False})
    ray.init(address=c.address, runtime_env={"env_vars": {"PYTHONPATH": path, "OMP_NUM_THREADS": "1"}},
             logging_level="WARNING")
    try:
        yield c
    finally:
        ray.shutdown()
        c.shutdown()
        os.environ.clear()
        os.environ.update(saved)


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


@pytest.mark.timeout(150)
def test_a_host_actor_then_the_coordinators_killed_mid_run_come_back_and_the_run_ends_bit_identical_in_as_many_rounds(
        cluster, tmp_path: Path) -> None:
    """min_hosts=2: no round closes without the killed host, so it rejoins in the round it left; the coordinator
    comes back on the address the hosts were given and resumes the run. 40 steps of 10: 4 rounds, kills or not."""
    out, run_dir = tmp_path / "out", tmp_path / "run"
    started = nodeox_ray.start(ray_digits.train, digits(out, "--max-steps", "40", "--step-seconds", "0.05"), hosts=2,
                               run_dir=run_dir, min_hosts=2, bind_host="127.0.0.1", coordinator_args=FAST, timeout=130)
    wait_for(lambda: 0 in published(run_dir), 90, "round 0")
    host_pid = (out / "host1.pid").read_text()  # the actor is busy training: its pid() call would wait
    ray.kill(started.host_actor(1), no_restart=False)
    rounds_at_host_kill = len(published(run_dir))
    wait_for(lambda: 1 in published(run_dir), 90, "round 1, which waits for host 1 to come back")
    address = (run_dir / ".ray-bind").read_text().split()[1]
    coordinator_pid = json.loads((run_dir / "coordinator.json").read_text())["pid"]
    ray.kill(started.servers.coordinator, no_restart=False)
    rounds_at_coordinator_kill = len(published(run_dir))
    result = started.wait()
    assert 1 <= rounds_at_host_kill <= rounds_at_coordinator_kill < 4  # both mid-run
    assert result.hosts[1].restarts == 1 and result.hosts[0].restarts == 0
    assert (out / "host1.pid").read_text() != host_pid  # a new process of the same actor trained again
    assert json.loads((run_dir / "coordinator.json").read_text())["pid"] != coordinator_pid  # a new coordinator ...
    assert (run_dir / ".ray-bind").read_text().split()[1] == address  # ... on the hosts' address
    assert all(r.ending is nodeox_ray.Ending.DONE for r in result.hosts.values())
    assert_final_model_is_the_hosts(result, out, ["0", "1"])
    assert sorted(published(run_dir)) == list(range(4)) and result.model.round == 4
    assert result.hosts[1].value["last_round"] == 3


@pytest.mark.timeout(150)
def test_a_host_added_when_ray_finds_resources_joins_mid_run_and_ends_bit_identical(cluster, tmp_path: Path) -> None:
    """Hosts need a "slot": the head has 2; host 2 waits in Ray's queue until a node with a third one joins."""
    out, run_dir, stop = tmp_path / "out", tmp_path / "run", tmp_path / "stop"
    started = nodeox_ray.start(ray_digits.train, digits(out, "--max-steps", "100000", "--step-seconds", "0.05",
                                                        "--stop-file", str(stop)),
                               hosts=2, max_hosts=3, host_resources={"slot": 1}, run_dir=run_dir,
                               bind_host="127.0.0.1", coordinator_args=FAST, timeout=130)
    wait_for(lambda: 0 in published(run_dir), 90, "round 0")
    assert not (out / "host2.pid").exists()
    cluster.add_node(num_cpus=2, resources={"slot": 1})

    def rounds_with_host_2() -> list[int]:
        return sorted({e["round"] for e in received(run_dir) if e["from_host"] == "2"})

    wait_for(lambda: rounds_with_host_2() and rounds_with_host_2()[0] in published(run_dir), 90, "host 2's delta")
    stop.write_text("")
    result = started.wait()
    assert [result.hosts[h].ending for h in (0, 1, 2)] == [nodeox_ray.Ending.DONE] * 3
    assert_final_model_is_the_hosts(result, out, ["0", "1", "2"])
    first = rounds_with_host_2()[0]
    assert first >= 1 and published(run_dir)[first]["model_hash"]
    assert result.model.round == max(published(run_dir)) + 1


@pytest.mark.timeout(150)
def test_two_relays_of_two_hosts_on_ray_end_bit_identical(cluster, tmp_path: Path) -> None:
    out, run_dir = tmp_path / "out", tmp_path / "run"
    result = nodeox_ray.run(ray_digits.train, digits(out), hosts=4, sites=2, run_dir=run_dir, bind_host="127.0.0.1",
                            coordinator_args=FAST, relay_args=("--threads", "1"), timeout=130)
    assert_final_model_is_the_hosts(result, out, ["0", "1", "2", "3"])
    assert sorted(published(run_dir)) == list(range(ROUNDS))
    assert {e["from_host"] for e in received(run_dir)} == {"site0", "site1"}  # the root heard the relays alone
    assert all(result.hosts[h].value["model_hash"] == result.model.model_hash for h in range(4))

