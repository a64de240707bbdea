"""The chaos soak, short: one fault of each kind (two of them at once) in a run of digits hosts behind a relay and
straight to the root, and nothing lost (benchmarks/soak.py is the long one); and what the long soak found."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from helpers import FORKED, exchange, hosts, train_on_model
from local_transport import LocalCoordinator
from urllib3.exceptions import IncompleteRead, ProtocolError

from lightning_nodeox.core.protocol import TransferBroken
from lightning_nodeox.host.client import ResponseStream

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # as `python benchmarks/x.py` has it
from soak_cluster import Settings, Topology
from soak_run import run
from soak_schedule import Fault

FAULTS = [Fault("host_kill", "host0", 3, 3.0), Fault("host_pause", "host2", 3, 4.0),  # at once
          Fault("root_kill", "root", 6, 0.5), Fault("relay_kill", "relay0", 8, 3.0),
          Fault("link_cut", "host2", 10, 4.0), Fault("disk_full", "root", 12, 4.0)]


@pytest.mark.slow  # it starts processes
@pytest.mark.timeout(240)
def test_a_run_under_every_kind_of_fault_loses_and_redoes_no_round_and_ends_on_one_model(tmp_path) -> None:
    """Host kill -9 and restart, host paused past its lease, root and relay kill -9 and restart, a link down past
    the lease, the root's disk full (where a tmpfs can be mounted): every round published once, in order; every host
    ends on the root's last model, bit for bit; goodput is measured and most training reached the model."""
    lines: list[dict] = []
    result = run(tmp_path / "soak", Topology(relays=1, hosts_per_relay=2, direct=1),
                 Settings(lease=2.0, step_seconds=0.01), FAULTS, 16, [sys.executable, str(FORKED)], lines.append,
                 timeout=150)
    assert result["problems"] == []
    kinds = {f.kind for f in FAULTS} - ({"disk_full"} if result["faults_skipped"] else set())
    assert result["faults"] == {kind: 1 for kind in kinds}
    assert len(lines) == len(FAULTS) and all(line["fault"]["end"] >= line["fault"]["start"] for line in lines)
    assert result["overlapping"] >= 1
    rounds = result["rounds"]
    assert rounds["published"] == rounds["last"] + 1 >= 16
    assert rounds["lost"] == rounds["redone"] == []
    assert result["identical"] and set(result["hosts_final"]) == {"0", "1", "2"}
    assert {f["model_hash"] for f in result["hosts_final"].values()} == {result["final_hash"]}
    assert 0.3 < result["goodput"] <= 1.0
    assert result["useful_s"] + sum(result["lost_s"].values()) == pytest.approx(result["train_s"])
    assert result["accuracy"] > 0.85


def test_a_host_ahead_of_a_coordinator_that_went_behind_fetches_its_model_instead_of_failing(tmp_path) -> None:
    """A coordinator restarted from an older state (its saves failed on a full disk, then kill -9) is at a round
    before the one a host waits for: the host's wait for that sync is refused as not started, and the host takes
    the coordinator's model and round (found by benchmarks/soak.py --seed 1: host 0 died on the refusal)."""
    c = LocalCoordinator(tmp_path, 2)
    try:
        a, b = hosts(c, "a", "b")
        for k, h in enumerate((a, b), 1):
            train_on_model(h, k, 0)
        exchange((a, 8), (b, 8))
        a.round = 4  # as if it had taken rounds 1-3, which the coordinator no longer has
        a.synchronize()
        assert (a.round, a.model_hash) == (c.state.round, c.rounds.model.hash) == (1, b.model_hash)
    finally:
        c.close()


def test_a_sync_cut_short_by_its_coordinators_death_is_a_broken_transfer_not_the_hosts_end() -> None:
    """A relay killed -9 while its hosts read a sync: urllib3 raises its own ProtocolError (IncompleteRead), which
    the host must take as a download that broke off (asked again, or the model fetched), not die of (found by
    benchmarks/soak.py --seed 2: both hosts of the relay died)."""

    class Cut:
        headers = {"Content-Length": "9248"}

        class raw:  # noqa: N801 - requests' attribute
            @staticmethod
            def read(n: int) -> bytes:
                raise ProtocolError("Connection broken: IncompleteRead", IncompleteRead(6472, 2776))

    stream = ResponseStream(Cut())
    with pytest.raises(TransferBroken, match="broke off: .*IncompleteRead"):
        stream.readinto(memoryview(bytearray(9248)))
