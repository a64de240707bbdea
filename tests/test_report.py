"""`nodeox report`'s host columns, found by name: every host phase, the sync (its parts summed), the fallback fetch
last, whatever the order of the phases; a run with relays grouped by site (no runs: records built here)."""

from __future__ import annotations

import pytest

from lightning_nodeox.core import phases as P
from lightning_nodeox.tools.report import HOST_COLUMNS, build, host_columns, render


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


def test_a_run_with_relays_is_grouped_by_site_and_its_far_link_bytes_stand_apart() -> None:
    """The root sees relays A and B (and host 9 straight to it); the relays forwarded their sites' records, B's
    with a relay C under it: each site is a report of its own, the bytes into the root apart from those inside."""
    records = [rec(P.RECEIVE, 1.0, 1.1, host="coordinator", from_host="A"),
               rec(P.AGGREGATE, 1.2, 1.3, host="coordinator"),
               rec(P.UPLOAD, 0.9, 1.0, host="A", bytes=100), rec(P.WAIT, 1.0, 1.5, host="A"),
               rec(P.DOWNLOAD, 1.5, 1.6, host="A", bytes=100),
               rec(P.UPLOAD, 0.9, 1.0, host="B", bytes=100), rec(P.DOWNLOAD, 1.5, 1.6, host="B", bytes=100),
               rec(P.UPLOAD, 0.9, 1.0, host="9", bytes=100), rec(P.DOWNLOAD, 1.5, 1.6, host="9", bytes=100),
               rec(P.TRAIN, 0.0, 0.5, host="A/0"), rec(P.UPLOAD, 0.5, 0.6, host="A/0", bytes=10),
               rec(P.DOWNLOAD, 1.7, 1.8, host="A/0", bytes=10),
               rec(P.TRAIN, 0.0, 0.7, host="A/1"), rec(P.UPLOAD, 0.7, 0.8, host="A/1", bytes=10),
               rec(P.AGGREGATE, 0.8, 0.85, host="A/coordinator", samples=64),
               rec(P.UPLOAD, 0.5, 0.6, host="B/2", bytes=10),
               rec(P.UPLOAD, 0.5, 0.6, host="B/C/3", bytes=1), rec(P.UPLOAD, 0.4, 0.5, host="B/C", bytes=10),
               rec(P.RSS, 2.0, 2.0, host="A/coordinator", rss_bytes=7),
               rec(P.RSS, 2.0, 2.0, host="coordinator", rss_bytes=5)]
    report = build(records)
    (rnd,) = report["rounds"]
    assert rnd["hosts"] == ["9", "A", "B"]  # the root's own senders: relays are hosts to it
    assert rnd["host_phases"]["wait"]["per_host"] == {"A": 0.5}
    assert rnd["far_bytes"] == {"up": 300, "down": 300}
    assert rnd["site_bytes"] == {"up": 10 + 10 + 10 + 10 + 1, "down": 10}
    assert list(rnd["sites"]) == ["A", "B"]
    a, b = rnd["sites"]["A"], rnd["sites"]["B"]
    assert a["hosts"] == ["0", "1"] and a["bytes"] == {"0": {"up": 10, "down": 10}, "1": {"up": 10, "down": 0}}
    assert a["coordinator_phases"][P.AGGREGATE] == pytest.approx(0.05)
    assert a["host_phases"]["train"] == {"per_host": {"0": 0.5, "1": 0.7}, "min": 0.5, "max": 0.7}
    assert b["hosts"] == ["2", "C"] and b["sites"]["C"]["hosts"] == ["3"]  # a relay under a relay: nested alike
    assert b["far_bytes"] == {"up": 20, "down": 0} and b["site_bytes"] == {"up": 1, "down": 0}
    summary = report["summary"]
    assert summary["far_bytes"] == {"up": 300, "down": 300} and summary["site_bytes"] == {"up": 41, "down": 10}
    assert summary["coordinator_peak_rss_bytes"] == 5 and summary["sites"]["A"]["coordinator_peak_rss_bytes"] == 7
    assert summary["bytes_up"] == 300 and summary["wall_s"] == pytest.approx(1.8)  # every site's records
    text = render(report)
    assert "site A (relay A; hosts 0, 1)" in text and "inside the sites" in text
    assert "3 hosts at the root (2 relays), 4 in the sites" in text  # A: 0, 1; B: 2, C (a relay of its own)


def test_a_run_without_relays_reports_as_before() -> None:
    report = build([rec(P.UPLOAD, 0.0, 1.0, bytes=5), rec(P.UPLOAD, 0.0, 1.0, host="1", bytes=6)])
    assert "sites" not in report["rounds"][0] and "far_bytes" not in report["summary"]
    assert report["rounds"][0]["bytes"] == {"0": {"up": 5, "down": 0}, "1": {"up": 6, "down": 0}}
