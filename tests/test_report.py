"""`nodeox report`'s host columns, found by name: every host phase, the sync (its parts summed), the fallback fetch
last, whatever the order of the phases; a run with relays grouped by site; the summary (per-host totals, what
waiting cost, quantiles, the slowest rounds and why), one screen at any length; the timeline's colours, one per
phase, read back from the PNG (no runs: records built here)."""

from __future__ import annotations

import json

import pytest

from lightning_nodeox.core import phases as P
from lightning_nodeox.tools import timeline
from lightning_nodeox.tools.report import HOST_COLUMNS, build, host_columns, main, parse_window, render_rounds
from lightning_nodeox.tools.summary import SLOWEST, extend, round_times


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


def relay_records() -> list[dict]:
    """Relays A and B and host 9 at the root; A's hosts 0 and 1 (they train), B's host 2 and relay C (host 3)."""
    return [rec(P.RECEIVE, 1.0, 1.1, host="coordinator", from_host="A"),
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


def test_a_run_with_relays_is_grouped_by_site_and_its_far_link_bytes_stand_apart() -> None:
    """The root sees relays A and B (and host 9 straight to it); the relays forwarded their sites' records, B's
    with a relay C under it: each site is a report of its own, the bytes into the root apart from those inside."""
    records = relay_records()
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
    text = render_rounds(report)
    assert "site A (relay A; hosts 0, 1)" in text and "inside the sites" in text
    assert "3 hosts at the root (2 relays), 4 in the sites" in text  # A: 0, 1; B: 2, C (a relay of its own)
    hosts = extend(report, records)["per_host"]
    assert list(hosts) == ["9", "A/0", "A/1", "B/2", "B/C/3"]  # the hosts that train: relays are not among them
    assert hosts["A/1"]["train_s"] == pytest.approx(0.7)
    assert hosts["A/1"]["mean_wait_share"] == pytest.approx(1 - 0.7 / 0.8)  # from its site's report


def test_the_summary_of_a_run_with_relays_has_every_hosts_train_row_above_the_relays_phases() -> None:
    records = relay_records()
    report = build(records)
    extend(report, records)
    lines = report_text(report).splitlines()
    table = lines.index("seconds, over rounds and hosts         n       p50       p90       p99       max")
    assert lines[table + 1:table + 5] == [
        "  train (every host)                   2     0.600     0.680     0.698     0.700",  # A/0 0.5 s, A/1 0.7 s
        "  upload                               3     0.100     0.100     0.100     0.100",  # relays A, B and host 9
        "  wait                                 1     0.500     0.500     0.500     0.500",
        "  download                             3     0.100     0.100     0.100     0.100"]


def test_a_run_without_relays_reports_as_before() -> None:
    report = build([rec(P.UPLOAD, 0.0, 1.0, bytes=5), rec(P.UPLOAD, 0.0, 1.0, host="1", bytes=6)])
    assert "sites" not in report["rounds"][0] and "far_bytes" not in report["summary"]
    assert report["rounds"][0]["bytes"] == {"0": {"up": 5, "down": 0}, "1": {"up": 6, "down": 0}}


def run_records(rounds: int, hosts: int = 2, slow: dict[tuple[int, str], float] | None = None) -> list[dict]:
    """A run without overlap: each host trains 1 s (plus ``slow[(round, host)]``), encodes 0.1 s, uploads 0.1 s
    (100 bytes), waits for the slowest, downloads 0.05 s (50 bytes), applies and verifies 0.025 s each; the
    coordinator aggregates 0.01 s and prepares the sync 0.04 s once the last upload is in."""
    slow = slow or {}
    records, t = [], 0.0
    for r in range(rounds):
        ups = {}
        for h in map(str, range(hosts)):
            end = t + 1.0 + slow.get((r, h), 0.0)
            records += [rec(P.TRAIN, t, end, h, r, ranks=2 if h == "1" else 1), rec(P.ENCODE, end, end + 0.1, h, r),
                        rec(P.UPLOAD, end + 0.1, end + 0.2, h, r, bytes=100)]
            ups[h] = end + 0.2
        close = max(ups.values())
        records += [rec(P.RECEIVE, ups[h] - 0.1, ups[h], P.COORDINATOR, r, from_host=h) for h in ups]
        records += [rec(P.AGGREGATE, close, close + 0.01, P.COORDINATOR, r),
                    rec(P.SYNC_PREPARE, close + 0.01, close + 0.05, P.COORDINATOR, r),
                    rec(P.PERSIST, close + 0.05, close + 0.08, P.COORDINATOR, r)]
        for h, up in ups.items():
            s = close + 0.05
            records += [rec(P.WAIT, up, s, h, r), rec(P.DOWNLOAD, s, s + 0.05, h, r, bytes=50),
                        rec(P.APPLY, s + 0.05, s + 0.075, h, r), rec(P.VERIFY, s + 0.075, s + 0.1, h, r)]
        t = close + 0.15
    return records


def test_the_summary_gives_each_hosts_gpu_hours_what_waiting_cost_and_why_the_slowest_round_was_slow() -> None:
    records = run_records(4, slow={(2, "1"): 3.0})  # host 1 (2 GPUs) trains 3 s longer in round 2
    report = build(records)
    s = extend(report, records, price=3.6)
    h0, h1 = s["per_host"]["0"], s["per_host"]["1"]
    assert h0["train_s"] == pytest.approx(4.0) and h1["train_s"] == pytest.approx(7.0)
    assert h0["wait_s"] == pytest.approx(4 * 0.05 + 3.0) and h1["wait_s"] == pytest.approx(4 * 0.05)
    span0 = records[-1]["end"] - 0.0  # host 0: from its first train to its last verify
    assert h0["span_s"] == pytest.approx(span0)
    assert h0["exchange_s"] == pytest.approx(span0 - 4.0 - 3.2)
    assert (h0["gpus"], h1["gpus"], h0["up_bytes"], h1["down_bytes"], h0["rounds"]) == (1, 2, 400, 200, 4)
    cost = s["cost"]
    assert cost["per_host"]["1"]["wait_gpu_hours"] == pytest.approx(0.2 * 2 / 3600)
    assert cost["per_host"]["0"]["wait_cost"] == pytest.approx(3.2 / 3600 * 3.6)
    assert cost["wait_cost"] == pytest.approx((3.2 + 0.4) / 3600 * 3.6)
    assert cost["gpu_hours"] == pytest.approx((h0["span_s"] + 2 * h1["span_s"]) / 3600)
    times = round_times(records)
    assert times[2] == pytest.approx(0.1 + 1.0 + 3.0 + 0.2 + 0.05)  # from round 1's sync published to round 2's
    slowest = s["slowest_rounds"][0]
    assert slowest["round"] == 2 and slowest["seconds"] == pytest.approx(times[2])
    assert slowest["causes"][0]["what"] == "train on host 1"  # not host 0's wait: that is its effect
    assert slowest["causes"][0]["above_median_s"] == pytest.approx(3.0)
    assert s["quantiles_s"]["train"]["n"] == 8 and s["quantiles_s"]["train"]["max"] == pytest.approx(4.0)
    assert s["quantiles_s"]["coordinator aggregate"]["p50"] == pytest.approx(0.01)
    assert list(s["quantiles_s"])[:3] == ["train", "encode", "upload"]
    text = report_text(report)
    assert text.splitlines()[0].startswith("cost at 3.6 per GPU-hour:") and "train on host 1 +3.000 s" in text


def report_text(report: dict) -> str:
    from lightning_nodeox.tools.report import render_summary

    return render_summary(report)


def test_the_summary_of_a_long_run_is_one_screen(tmp_path, capsys) -> None:
    records = run_records(600, hosts=8, slow={(r, str(r % 8)): 2.0 for r in range(0, 600, 97)})
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert main(tmp_path, price=2.0) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) <= 60 and lines[0].startswith("cost at 2 per GPU-hour")
    slowest = [int(line.split()[1]) for line in lines if line.startswith("  round ") and line.split()[1].isdigit()]
    assert len(slowest) == SLOWEST and set(slowest) <= set(range(0, 600, 97))
    assert main(tmp_path, rounds="10:12") == 0  # the per-round tables of rounds 10 to 12, both included
    out = capsys.readouterr().out
    assert [line.split()[1] for line in out.splitlines() if line.startswith("round ")] == ["10", "11", "12"]
    assert main(tmp_path, as_json=True, rounds="598:") == 0
    assert [r["round"] for r in json.loads(capsys.readouterr().out)["rounds"]] == [598, 599]


def test_the_gpu_time_table_is_in_one_unit_named_in_its_header() -> None:
    short = run_records(2)  # host 1 has 2 GPUs: its GPU time is twice its seconds
    lines = report_text(extended(short)).splitlines()
    assert lines[:4] == ["GPU time per host, in GPU-seconds (its GPUs x the time of each):",
                         "host       GPUs   training    waiting exchanging wait share  up / down",
                         "0             1        2.0        0.1        0.6        26%  200 B / 100 B",
                         "1             2        4.0        0.2        1.2        26%  200 B / 100 B"]
    long = run_records(2, slow={(0, "1"): 7200.0})  # host 1 trains 2 h longer: every cell in GPU-hours
    lines = report_text(extended(long, price=2.0)).splitlines()
    assert lines[1:5] == [
        "GPU time per host, in GPU-hours (its GPUs x the time of each):",
        "host       GPUs   training    waiting exchanging wait share waiting cost  up / down",
        "0             1      0.001      2.000      0.000        63%         4.00  200 B / 100 B",
        "1             2      4.001      0.000      0.000        13%       0.0001  200 B / 100 B"]


OVERLAP = ("  (aggregation-to-sync below 0: the round was streamed, the hosts' sync downloads started before its "
           "aggregation ended; the seconds below 0 are that overlap)")


def test_an_aggregation_to_sync_below_0_is_said_to_be_a_streamed_rounds_overlap() -> None:
    records = run_records(2)
    plain_summary, plain_rounds = report_text(extended(records)), render_rounds(extended(records))
    assert OVERLAP not in plain_summary.splitlines() and OVERLAP not in plain_rounds.splitlines()
    for r in records:
        if r["phase"] == P.DOWNLOAD:
            r["start"] -= 0.08  # 0.04 s before the aggregation's end: the sync was streamed
    lines = report_text(extended(records)).splitlines()
    row = lines.index("  aggregation-to-sync                  4    -0.040    -0.040    -0.040    -0.040")
    assert lines[row + 1:row + 3] == ["  round time                           2     1.300     1.340     1.349     1.350",
                                      OVERLAP]
    lines = render_rounds(extended(records)).splitlines()
    assert lines[-3:-1] == ["aggregation-to-sync, median of the slowest host: -0.040 s", OVERLAP]


def extended(records: list[dict], price: float | None = None) -> dict:
    report = build(records)
    extend(report, records, price)
    return report


def test_a_rounds_range_reads_as_both_ends_included_and_a_bad_one_names_the_form() -> None:
    assert parse_window("10:20") == (10, 20) and parse_window(":5") == (None, 5) and parse_window("7") == (7, 7)
    assert parse_window("") == (None, None)
    with pytest.raises(ValueError, match="A:B"):
        parse_window("ten")


def test_every_phase_has_a_colour_of_its_own() -> None:
    phases = (*P.HOST_PHASES, *P.COORDINATOR_PHASES)
    assert set(timeline.PHASE_COLOURS) == set(phases)
    assert len(set(timeline.PHASE_COLOURS.values())) == len(phases)
    assert timeline.PHASE_COLOURS[P.PERSIST] != timeline.PHASE_COLOURS[P.WAIT]


def _colours(path) -> dict[tuple[int, int, int], int]:
    from PIL import Image

    counts: dict = {}
    for colour in Image.open(path).convert("RGB").getdata():
        counts[colour] = counts.get(colour, 0) + 1
    return counts


def _rgb(hex_colour: str) -> tuple[int, int, int]:
    return tuple(int(hex_colour[i:i + 2], 16) for i in (1, 3, 5))


@pytest.mark.parametrize("rounds", [3, timeline.WINDOW + 20], ids=["timeline", "aggregate-and-window"])
def test_the_timeline_draws_each_phase_in_its_colour_with_a_legend_entry(tmp_path, rounds: int) -> None:
    """Every phase of the records, host and coordinator, is drawn (bars read back from the PNG by their exact
    colour) and named in the legend; a run longer than the window gets the aggregate above its last rounds."""
    records = run_records(rounds)
    last = rounds - 1
    t = 50.0 * rounds  # after the rounds' records
    records += [rec(P.POLL, t, t + 1, "0", last), rec(P.FOLD, t + 1, t + 2, "0", last),
                rec(P.PROVIDE_MODEL, -2.0, -1.0, "1", 0), rec(P.FALLBACK_FETCH, t, t + 2, "1", last),
                rec(P.MODEL_MATERIALIZE, t, t + 2, P.COORDINATOR, last), rec(P.STORE, t + 2, t + 3, P.COORDINATOR, last)]
    png = tmp_path / "t.png"
    legend = timeline.plot(records, png)
    phases = (*P.HOST_PHASES, *P.COORDINATOR_PHASES)
    assert legend == [ph for ph in timeline.PHASE_COLOURS if ph in phases]
    counts = _colours(png)
    for phase in phases:
        assert counts.get(_rgb(timeline.PHASE_COLOURS[phase]), 0) >= 20, phase  # its bars (and legend patch)
    from PIL import Image

    lanes = 3  # the coordinator's and two hosts'
    inches = 1.2 + 0.55 * lanes + (2.6 if rounds > timeline.WINDOW else 0.0)  # the aggregate panel above
    assert Image.open(png).size[1] == pytest.approx(110 * inches, abs=1)
