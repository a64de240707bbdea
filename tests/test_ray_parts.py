"""lightning_nodeox.ray's parts that need no cluster: its settings' refusals and the variables a rank of a host of
several GPUs gets (the DDP path, which tests/test_ray.py cannot run without GPUs)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("ray")

from lightning_nodeox.ray.hosts import RankInfo, group_variables  # noqa: E402
from lightning_nodeox.ray.settings import RaySettings  # noqa: E402


def test_each_rank_of_a_host_sees_all_its_gpus_and_its_own_place_among_them() -> None:
    infos = (RankInfo("10.0.0.5", 29500, ("3",)), RankInfo("10.0.0.5", 41000, ("1",)), RankInfo("10.0.0.5", 1, ("10",)))
    envs = [group_variables(rank, infos) for rank in range(3)]
    assert {e["CUDA_VISIBLE_DEVICES"] for e in envs} == {"1,3,10"}
    assert [e["LOCAL_RANK"] for e in envs] == ["1", "0", "2"]  # rank 0 holds GPU 3, the second of 1,3,10
    assert [e["RANK"] for e in envs] == ["0", "1", "2"]
    assert {(e["MASTER_ADDR"], e["MASTER_PORT"], e["WORLD_SIZE"], e["NODE_RANK"]) for e in envs} == {
        ("10.0.0.5", "29500", "3", "0")}


def test_ranks_on_cpus_are_placed_by_rank_and_leave_cuda_alone() -> None:
    infos = (RankInfo("127.0.0.1", 5000, ()), RankInfo("127.0.0.1", 5001, ()))
    envs = [group_variables(rank, infos) for rank in range(2)]
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1"] and all("CUDA_VISIBLE_DEVICES" not in e for e in envs)


@pytest.mark.parametrize(("settings", "names"), [
    ({"hosts": 0}, "hosts=0"), ({"hosts": 2, "max_hosts": 1}, "max_hosts=1"),
    ({"hosts": 2, "min_hosts": 3}, "min_hosts=3"), ({"hosts": 4, "sites": 2, "max_hosts": 6}, "sites"),
    ({"hosts": 1, "gpus_per_host": -1}, "gpus_per_host=-1"), ({"hosts": 1, "max_restarts": -1}, "max_restarts=-1"),
])
def test_settings_that_cannot_be_are_refused_naming_the_setting(settings: dict, names: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=names):
        RaySettings(run_dir=tmp_path, **settings)


def test_a_run_that_grows_or_has_a_minimum_passes_it_to_the_coordinator(tmp_path: Path) -> None:
    assert RaySettings(hosts=2, run_dir=tmp_path).root_flags() == []
    assert RaySettings(hosts=2, max_hosts=4, min_hosts=3, store="file:///s", run_dir=tmp_path).root_flags() == [
        "--elastic", "--min-hosts", "3", "--store", "file:///s"]
    assert RaySettings(hosts=2, max_hosts=4, min_hosts=4, run_dir=tmp_path).min_hosts == 4  # up to max_hosts
