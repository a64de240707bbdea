"""Hosts that share a folder keep their loggers apart: a TensorBoardLogger or CSVLogger the user passes, whose
version was not given, logs into its own ``host<id>`` sub-folder, so no two hosts race for a version folder."""

from __future__ import annotations

import csv
import sys
from types import SimpleNamespace

import pytest
from helpers import HOSTS, launch
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

from lightning_nodeox.host.machine import keep_loggers_apart


def test_a_users_logger_without_a_version_logs_into_its_hosts_own_sub_folder(tmp_path) -> None:
    csv_logger, unnamed = CSVLogger(tmp_path / "logs"), TensorBoardLogger(tmp_path / "tb", name="")
    given = CSVLogger(tmp_path / "logs", version="mine")
    own = TensorBoardLogger(tmp_path / "run" / "hosts", name="hosta_b")  # the run folder's default logger
    keep_loggers_apart(SimpleNamespace(loggers=[csv_logger, unnamed, given, own]), "a/b")
    assert csv_logger.log_dir == str(tmp_path / "logs" / "lightning_logs" / "hosta_b" / "version_0")
    assert unnamed.log_dir == str(tmp_path / "tb" / "hosta_b" / "version_0")
    assert given.log_dir == str(tmp_path / "logs" / "lightning_logs" / "mine")  # a version you give is yours
    assert own.root_dir == str(tmp_path / "run" / "hosts" / "hosta_b")


@pytest.mark.slow
def test_two_hosts_with_one_csv_logger_folder_end_with_separate_complete_metrics_files(tmp_path) -> None:
    logs = tmp_path / "logs"
    result = launch(tmp_path / "run", 2, [sys.executable, str(HOSTS / "agree_host.py"), "--out",
                                          str(tmp_path / "out"), "--csv-logs", str(logs)])
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-5000:]
    assert sorted(p.relative_to(logs).as_posix() for p in logs.rglob("metrics.csv")) == [
        "lightning_logs/host0/version_0/metrics.csv", "lightning_logs/host1/version_0/metrics.csv"]
    for host in (0, 1):
        with open(logs / "lightning_logs" / f"host{host}" / "version_0" / "metrics.csv") as f:
            rows = [r for r in csv.DictReader(f) if r.get("train_loss")]
        assert [int(r["step"]) for r in rows] == list(range(20)), host  # every step of the host's 20, once
