"""The change log of rank 0's live tensors (host/changes.py): every tensor is written out as all the indices."""

from __future__ import annotations

from lightning_nodeox.host.changes import ChangeLog


def test_the_log_starts_with_every_tensor_and_starts_over_at_each_take() -> None:
    log = ChangeLog(4)
    assert log.take() == (0, 1, 2, 3)
    assert log.take() == ()


def test_written_tensors_come_back_once_ascending_and_every_tensor_is_all_indices() -> None:
    log = ChangeLog(5)
    log.take()
    log.wrote([3, 1])
    log.wrote((1, 0))
    assert log.take() == (0, 1, 3)
    log.wrote([2])
    log.wrote_all()
    log.wrote([4])
    assert log.take() == (0, 1, 2, 3, 4)
    assert log.take() == ()
