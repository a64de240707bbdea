"""What the run says of its data ledger: `nodeox status`'s lines and the status page (in headless Chromium) from a
``GET /v1/status`` answer, and `nodeox report`'s part from the coordinator's ``data`` records. (A real run's
records: tests/test_ledger_uneven.py.)"""

from __future__ import annotations

import json
import re
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from test_status import CHROMIUM, HEADLESS, NO_CHROMIUM

from lightning_nodeox.coordinator import statuspage
from lightning_nodeox.tools import report, status, summary

DATA = {"epoch": 2, "epoch_committed_samples": 448, "epoch_committed_fraction": 448 / 1797,
        "units_committed": 14, "units_held": 3, "samples": 1797, "unit_size": 32, "units": 57, "units_free": 40,
        "hosts": {"0": {"present": True, "generation": 0, "units_held": 2, "leased": 3900, "committed": 3860,
                        "in_flight": 40, "returned": 0, "undecided_deltas": 1},
                  "1": {"present": False, "generation": 1, "units_held": 0, "leased": 1400, "committed": 1370,
                        "in_flight": 0, "returned": 30, "undecided_deltas": 0},
                  "2": {"present": True, "generation": 0, "units_held": 1, "leased": 620, "committed": 612,
                        "in_flight": 8, "returned": 0, "undecided_deltas": 0}}}
LIVE = {"name": "nodeox coordinator", "state": "running", "round": 9, "published_round": 8, "model_hash": "ab12",
        "coordinator": {"rss_bytes": 5e8, "peak_rss_bytes": 6e8}, "link_bytes_per_s": None, "gpu_hour_price": None,
        "now": 1.7e9, "hosts": [], "timeline": {"rounds": [], "lanes": []}}


def test_nodeox_status_shows_the_epoch_its_progress_and_each_hosts_samples() -> None:
    lines = status.render({"live": LIVE, "data": DATA}).splitlines()
    at = lines.index("data: epoch 2, 448 of 1797 samples committed (25%); units of 32: 14 committed, 3 held, 40 free "
                     "of 57")
    assert re.match(r"data host +leased +committed +in flight +returned +units held$", lines[at + 1])
    assert re.match(r"0 +3900 +3860 +40 +0 +2$", lines[at + 2])
    assert re.match(r"1 \(gone\) +1400 +1370 +0 +30 +0$", lines[at + 3])
    assert re.match(r"2 +620 +612 +8 +0 +1$", lines[at + 4])
    assert not any(line.startswith("data") for line in status.render({"live": LIVE}).splitlines())  # no ledger


def _data_record(round_: int, epoch: int, committed: int, ended: int | None, hosts: dict) -> dict:
    return {"round": round_, "host": "coordinator", "phase": "data", "start": 100.0 + round_, "end": 100.0 + round_,
            "epoch": epoch, "epoch_committed_samples": committed, "epoch_committed_fraction": committed / 100,
            "units_committed": committed // 10, "units_held": 2, "published_samples": 0, "epoch_ended": ended,
            "hosts": {h: {"leased": c[0], "committed": c[1], "returned": c[2]} for h, c in hosts.items()}}


RECORDS = [  # 100 samples in units of 10: epoch 0 ends at round 1, epoch 1 at round 3 (host b gone in it)
    {"round": 0, "host": "a", "phase": "train", "start": 99.0, "end": 100.0},
    _data_record(0, 0, 60, None, {"a": (70, 40, 0), "b": (30, 20, 0)}),
    _data_record(1, 1, 0, 0, {"a": (90, 75, 0), "b": (40, 25, 0)}),
    _data_record(2, 1, 50, None, {"a": (120, 110, 0), "b": (60, 40, 10), "c": (10, 0, 0)}),
    _data_record(3, 2, 0, 1, {"a": (150, 145, 0), "b": (60, 50, 10), "c": (20, 5, 0)}),
    _data_record(4, 2, 30, None, {"a": (170, 165, 0), "b": (60, 50, 10), "c": (40, 15, 0)}),
]


def test_nodeox_report_says_where_each_epoch_ended_and_what_each_host_committed_in_it() -> None:
    built = _summarized(RECORDS)
    data = built["summary"]["data"]
    assert data["epochs"] == [{"epoch": 0, "ended_round": 1, "committed": {"a": 75, "b": 25}},
                              {"epoch": 1, "ended_round": 3, "committed": {"a": 70, "b": 25, "c": 5}}]
    assert data["current"] == {"epoch": 2, "committed_samples": 30, "committed_fraction": 0.3, "units_committed": 3,
                               "units_held": 2, "committed": {"a": 20, "b": 0, "c": 10}}
    assert data["hosts"]["b"] == {"leased": 60, "committed": 50, "returned": 10, "in_flight": 0}
    assert data["hosts"]["c"]["in_flight"] == 25
    assert "data" not in {ph for rnd in built["rounds"] for ph in rnd["coordinator_phases"]}  # a mark, not a phase
    lines = report.render_summary(built).splitlines()
    at = lines.index("data ledger: epoch 2 in progress, 30 samples committed (30%; units 3 committed, 2 held); "
                     "2 epochs ended")
    assert lines[at + 1] == "  epoch 0    ended at round 1      samples committed: host a 75, host b 25"
    assert lines[at + 2] == "  epoch 1    ended at round 3      samples committed: host a 70, host b 25, host c 5"
    assert lines[at + 3] == "  epoch 2    so far                samples committed: host a 20, host c 10"
    assert re.match(r" +host +leased +committed +returned +in flight$", lines[at + 5])
    assert re.match(r" +b +60 +50 +10 +0$", lines[at + 7])
    assert lines[at + 1] in report.render_rounds(built).splitlines()  # --rounds ends with it too
    assert "data ledger" not in report.render_summary(_summarized(RECORDS[:1]))  # a run without a ledger


def _summarized(records: list[dict]) -> dict:
    """The report `nodeox report` prints (its summary extended)."""
    built = report.build(records)
    summary.extend(built, records)
    return built


class _Page(BaseHTTPRequestHandler):
    """The status page's files, and one fixed ``GET /v1/status`` answer."""

    answer: bytes = b""

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        path = self.path.split("?")[0]
        name = "index.html" if path == "/" else path.removeprefix(statuspage.FILES)
        if path == "/v1/status":
            body, kind = self.answer, "application/json"
        elif name in statuspage.ASSETS:
            body, kind = statuspage.asset(name), statuspage.ASSETS[name]
        else:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.mark.slow  # starts a browser
@pytest.mark.skipif(CHROMIUM is None, reason=NO_CHROMIUM)
def test_the_status_page_shows_the_epoch_its_progress_and_each_hosts_samples(tmp_path: Path) -> None:
    _Page.answer = json.dumps({"live": LIVE, "data": DATA}).encode()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Page)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        dom = subprocess.run([CHROMIUM, *HEADLESS, f"--user-data-dir={tmp_path / 'profile'}",
                              "--virtual-time-budget=5000", "--dump-dom", f"http://127.0.0.1:{server.server_port}/"],
                             capture_output=True, text=True, timeout=90, check=True).stdout
    finally:
        server.shutdown()
        server.server_close()
    assert re.search(r'<section id="data">', dom), "the data section stayed hidden"  # shown: no hidden attribute

    def text(id_: str) -> str:
        return re.search(rf'id="{id_}"[^>]*>([^<]*)<', dom).group(1)

    assert [text(i) for i in ("data-epoch", "data-committed", "data-samples", "data-fraction", "data-unit",
                              "data-units-committed", "data-units-held", "data-units-free", "data-units")] == \
        ["2", "448", "1797", "25%", "32", "14", "3", "40", "57"]
    rows = re.findall(r'<tr class="(host[^"]*)" data-host="(\w+)">(.*?)</tr>', dom.split('id="data-hosts"')[1])
    cells = {host: (cls, re.findall(r"<td[^>]*>([^<]*)</td>", row)) for cls, host, row in rows}
    assert cells == {"0": ("host", ["0", "3900", "3860", "40", "0", "2"]),
                     "1": ("host gone", ["1 (gone)", "1400", "1370", "0", "30", "0"]),
                     "2": ("host", ["2", "620", "612", "8", "0", "1"])}
