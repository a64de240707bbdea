"""A host's delta on its way (host/uploads.py): its weight with fragments, and each outcome of its upload:
taken, sent again when the coordinator lost it, empty when there is none to send again."""

from __future__ import annotations

from helpers import both, frozen, join, model, train
from local_transport import LocalClient

from lightning_nodeox.core import phases as P
from lightning_nodeox.core.phases import PhaseLog
from lightning_nodeox.core.protocol import Upload
from lightning_nodeox.host.round import HostRound
from lightning_nodeox.host.standing import Into


def test_with_fragments_a_delta_weighs_the_samples_its_fragment_trained_since_its_last_sync(local_coordinator) -> None:
    c = local_coordinator(1)
    host = HostRound(frozen(model(0), (), fragments=2), LocalClient(c, "a"), PhaseLog("a"))
    host.join()
    assert host.tensors.fragment_count == 2
    weights = [host.uploads.weight(s) for s in (8, 4, 2, 1)]
    assert weights == [8, 12, 6, 3]  # the samples of the last two rounds, one per fragment


def test_a_lost_delta_is_sent_again_and_without_one_an_empty_delta_takes_part(local_coordinator, keep_records) -> None:
    c = local_coordinator(2)
    a, b = join(c, "a", "b")
    a.uploads.resend(Into.LIVE)  # nothing sent yet: an empty delta, so the round can close with this host in it
    first = [r for r in a.phases.records if r.phase == P.UPLOAD]
    assert len(first) == 1 and first[0].extra.get("empty")
    train(a, 0), train(b, 0)
    a.tensors.boundary(a.round)
    assert a.upload(a.encode(a.tensors.live, 8, False)) is Upload.TAKEN  # a delta taken replaces the empty one
    a.uploads.resend(Into.LIVE)  # the same message again: taken already
    again = [r for r in a.phases.records if r.phase == P.UPLOAD][-1]
    assert again.extra.get("resent") and again.bytes == len(a.tensors.part.message)
    b.tensors.boundary(b.round)
    b.upload(b.encode(b.tensors.live, 8, False))
    ra, rb = both(a.synchronize, b.synchronize)
    assert ra.contributed and rb.contributed and a.model_hash == b.model_hash == c.rounds.model.hash
