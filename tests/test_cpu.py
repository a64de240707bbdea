"""CPU threads come from the quota granted, never from os.cpu_count()."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from lightning_nodeox.core import cpu


def test_cgroup_v2_quota(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))
    (tmp_path / "cpu.max").write_text("250000 100000\n")
    assert cpu.granted_cpus(tmp_path) == 2
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cpu.granted_cpus(tmp_path) == 64
    (tmp_path / "cpu.max").write_text("50000 100000\n")  # half a CPU still gets one thread
    assert cpu.granted_cpus(tmp_path) == 1


def test_cgroup_v1_quota(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    folder = tmp_path / "cpu,cpuacct"
    folder.mkdir()
    (folder / "cpu.cfs_quota_us").write_text("400000\n")
    (folder / "cpu.cfs_period_us").write_text("100000\n")
    assert cpu.granted_cpus(tmp_path) == 4
    (folder / "cpu.cfs_quota_us").write_text("-1\n")
    assert cpu.granted_cpus(tmp_path) == 16


def test_affinity_limits_more_than_quota(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2})
    (tmp_path / "cpu.max").write_text("800000 100000\n")
    assert cpu.granted_cpus(tmp_path) == 3


def test_choice_is_logged_and_overridable(caplog) -> None:
    with caplog.at_level(logging.INFO):
        assert cpu.choose_threads(3, purpose="test codec") == 3
    assert "test codec uses 3 threads (set explicitly" in caplog.text
    with pytest.raises(ValueError, match="at least 1"):
        cpu.choose_threads(0, purpose="test codec")
