"""A round's sync (host/downloads.py): applied as it arrives and verified; a download that breaks off is asked
for again without applying a piece twice; a sync that is not this host's to apply makes it fetch the model; a run
that completed leaves the host on its base."""

from __future__ import annotations

from helpers import assert_on_the_run_model, both, join, train, upload

from lightning_nodeox.core import phases as P
from lightning_nodeox.core.protocol import RunComplete
from lightning_nodeox.host.standing import Into


def test_a_broken_download_is_asked_for_again_and_the_host_ends_on_the_runs_model(local_coordinator,
                                                                                   keep_records) -> None:
    c = local_coordinator(2)
    a, b = join(c, "a", "b")
    train(a, 0), train(b, 0)
    a.client.break_next_sync = True
    upload(a), upload(b)
    ra, rb = both(a.downloads.synchronize, b.downloads.synchronize)
    assert ra.contributed and rb.contributed
    downloads = [r for r in a.phases.records if r.phase == P.DOWNLOAD]
    assert len(downloads) == 2 and not any(r.phase == P.FALLBACK_FETCH for r in a.phases.records)
    assert_on_the_run_model(c, a, b)


def test_a_sync_of_another_base_makes_the_host_fetch_the_model(local_coordinator, keep_records) -> None:
    c = local_coordinator(2)
    a, b = join(c, "a", "b")
    train(a, 0), train(b, 0)
    upload(a), upload(b)
    a.model_hash = "a model the round was not computed on"
    assert a.downloads.download(Into.LIVE) is None
    assert [r.phase for r in a.phases.records][-1] == P.FALLBACK_FETCH
    b.downloads.synchronize()
    assert_on_the_run_model(c, a, b)


def test_a_run_that_completed_leaves_the_live_model_on_base(local_coordinator, keep_records) -> None:
    c = local_coordinator(1)
    (a,) = join(c, "a")
    train(a, 0)

    class Completed:
        host = "a"

        def wait_sync(self, round_, **_):
            return RunComplete()

    a.standing.client = Completed()
    assert a.downloads.download(Into.LIVE) is None and a.complete
    assert_on_the_run_model(c, a)
