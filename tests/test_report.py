"""`nodeox report`'s host columns, found by name: every host phase, the sync (its parts summed), the fallback fetch
last, whatever the order of the phases (no runs: records built here)."""

from __future__ import annotations

from lightning_nodeox.core import phases as P
from lightning_nodeox.tools.report import HOST_COLUMNS, build, host_columns


def rec(phase: str, start: float, end: float, host: str = "0", round_: int = 0, **extra) -> dict:
    return {"round": round_, "host": host, "phase": phase, "start": start, "end": end, **extra}


def test_the_host_columns_are_the_phases_then_the_sync_then_the_fallback_fetch() -> None:
    assert HOST_COLUMNS == ("train", "encode", "upload", "wait", "poll", "download", "apply", "verify", "fold",
                            "provide_model", "sync", "fallback_fetch")


def test_a_phase_added_after_the_fallback_fetch_still_comes_before_the_sync() -> None:
    assert host_columns((P.TRAIN, P.FALLBACK_FETCH, "stream")) == ("train", "stream", "sync", "fallback_fetch")


def test_a_round_reports_its_sync_as_the_sum_of_its_parts_and_a_fallback_fetch_by_name() -> None:
    records = [rec(P.TRAIN, 0.0, 1.0), rec(P.DOWNLOAD, 1.0, 1.5, bytes=100), rec(P.APPLY, 1.5, 1.75),
               rec(P.VERIFY, 1.75, 2.0), rec(P.FALLBACK_FETCH, 2.0, 4.0, bytes=1000),
               rec(P.TRAIN, 0.0, 3.0, host="1")]
    report = build(records)
    phases = report["rounds"][0]["host_phases"]
    assert list(phases) == ["train", "download", "apply", "verify", "sync", "fallback_fetch"]
    assert phases["sync"]["per_host"] == {"0": 1.0}
    assert phases["fallback_fetch"]["per_host"] == {"0": 2.0}
    assert phases["train"] == {"per_host": {"0": 1.0, "1": 3.0}, "min": 1.0, "max": 3.0}
    assert report["rounds"][0]["bytes"]["0"] == {"up": 0, "down": 1100}
    assert report["summary"]["median_of_slowest_host_s"]["fallback_fetch"] == 2.0
