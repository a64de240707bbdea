"""A host's standing (host/standing.py), shared by the parts of its round: what HostRound says of it is the
standing's, and the coordinator is told the host trains on only while an overlapped round is open."""

from __future__ import annotations

from helpers import model
from local_transport import LocalClient

from lightning_nodeox.core.phases import PhaseLog
from lightning_nodeox.host.round import HostRound
from lightning_nodeox.host.standing import Into
from lightning_nodeox.host.tensors import HostTensors


def test_the_round_and_its_parts_share_one_standing(local_coordinator) -> None:
    host = HostRound(HostTensors(model(0)), LocalClient(local_coordinator(1), "a"), PhaseLog("a"))
    s = host.standing
    assert host.joining.standing is host.uploads.standing is host.downloads.standing is s
    host.round, host.model_hash, host.complete = 4, "abc", True
    assert (s.round, s.model_hash, s.complete, s.host) == (4, "abc", True, "a") == (host.round, host.model_hash,
                                                                                    host.complete, host.host)


def test_the_host_trains_on_only_while_its_overlapped_round_is_open(local_coordinator) -> None:
    host = HostRound(HostTensors(model(0)), LocalClient(local_coordinator(1), "a"), PhaseLog("a"))
    s = host.standing
    assert not s.training(Into.BASE) and not s.training(Into.LIVE)
    host.trains_on = True
    assert s.trains_on and s.training(Into.BASE) and not s.training(Into.LIVE)
