"""What the benchmarks share for surviving a long run (benchmarks/common.py's SampleLog): each sample written as
it finishes, a failed one recorded with its reason and the next one run; and benchmarks/netns.py's link counters,
read by the namespace's name from the first sample on."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # as `python benchmarks/x.py` has it
import exchange
from common import SampleLog, interleaved
from netns import Counters, Namespaces, netns_missing
from site_figures import PlacementSkipped


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_sample_that_raises_is_recorded_and_the_next_one_still_runs(tmp_path):
    log = SampleLog("probe", tmp_path / "samples.jsonl")
    done = []
    for n in range(3):
        with log.sample({"n": n}) as taken:
            if n == 1:
                raise RuntimeError("no nxpr1 in /proc/4242/net/dev")
            taken.result = {"round_s": n + 0.5}
        done.append(taken.failed)
    assert done == [None, "RuntimeError: no nxpr1 in /proc/4242/net/dev", None]
    assert lines(log.path) == [{"n": 0, "result": {"round_s": 0.5}},
                               {"n": 1, "failed": "RuntimeError: no nxpr1 in /proc/4242/net/dev"},
                               {"n": 2, "result": {"round_s": 2.5}}]
    assert log.failures == [{"n": 1, "failed": "RuntimeError: no nxpr1 in /proc/4242/net/dev"}]


def test_the_file_holds_every_finished_sample_when_the_benchmark_is_cut_off(tmp_path):
    log = SampleLog("probe", tmp_path / "samples.jsonl")
    with pytest.raises(KeyboardInterrupt):  # not a failed sample: the benchmark itself is stopped
        for n in range(3):
            with log.sample({"n": n}) as taken:
                if n == 2:
                    raise KeyboardInterrupt
                taken.result = n
    assert lines(log.path) == [{"n": 0, "result": 0}, {"n": 1, "result": 1}]


def test_interleaved_placements_go_on_after_a_failed_run_and_skip_what_cannot_run(tmp_path):
    log = SampleLog("probe", tmp_path / "samples.jsonl")
    skipped: dict[str, str] = {}

    async def run_one(placement: str, rep: int) -> dict:
        if placement == "torchft":
            raise PlacementSkipped("torchft does not import")
        if (placement, rep) == ("nodeox", 0):
            raise RuntimeError("a counter could not be read")
        return {"round_s": float(rep)}

    runs = asyncio.run(interleaved(["nodeox", "torchft", "ddp"], 2, run_one, skipped, "200 Mbit/s", ("round_s",),
                                   log))
    assert runs == {"nodeox": [{"round_s": 1.0}], "torchft": [], "ddp": [{"round_s": 0.0}, {"round_s": 1.0}]}
    assert skipped == {"torchft": "torchft does not import"}
    assert [(s["placement"], s["repeat"], "failed" in s) for s in lines(log.path)] == [
        ("nodeox", 0, True), ("ddp", 0, False), ("nodeox", 1, False), ("ddp", 1, False)]


def rec(round_, host, phase, start, end, **extra):
    return {"round": round_, "host": host, "phase": phase, "start": start, "end": end, **extra}


def test_a_streamed_round_is_judged_by_its_wall_time_critical_path_and_duplex_floor():
    events = []
    for r, t in ((0, 0.0), (1, 10.0), (2, 20.0)):
        events += [rec(r, "0", "encode", t, t + 1), rec(r, "1", "encode", t + 0.5, t + 1.5),
                   rec(r, "0", "upload", t + 0.1, t + 2, bytes=1_000_000),
                   rec(r, "1", "upload", t + 0.6, t + 3, bytes=1_000_000),
                   rec(r, "coordinator", "aggregate", t + 0.2, t + 3.1),
                   rec(r, "coordinator", "sync_prepare", t + 0.2, t + 3.5 + r),
                   rec(r, "0", "download", t + 1, t + 4 + r, bytes=1_250_000),
                   rec(r, "1", "download", t + 1, t + 4.5 + r, bytes=1_250_000),
                   rec(r, "0", "verify", t + 4.5, t + 4.6 + r), rec(r, "1", "verify", t + 5, t + 5.25 + r)]
    judged = exchange.judge_round(events, 3, mbit=8.0)  # rounds 1 and 2: round 0 left out
    assert judged["wall_s"] == pytest.approx(6.75)  # median of 6.25 and 7.25 (encode start to verify end)
    assert judged["critical_path_s"] == pytest.approx({"delta_in": 3.0, "sync_made": 2.0, "sync_out": 1.0,
                                                       "verified": 0.75})
    assert sum(judged["critical_path_s"].values()) == pytest.approx(judged["wall_s"])
    assert judged["payload_bytes"] == 1_250_000 and judged["floor_s"] == pytest.approx(1.25)  # 10 Mbit at 8 Mbit/s
    assert judged["round_over_floor"] == pytest.approx(6.75 / 1.25)
    assert exchange.judge_round(events, 3, mbit=None)["floor_s"] is None  # loopback: no link rate


@pytest.mark.skipif(netns_missing() is not None, reason=f"network namespaces: {netns_missing()}")
def test_link_counters_are_read_by_the_namespace_s_name_from_the_first_sample():
    with Namespaces(2, None, prefix="nxct", subnet="10.75.0") as net:
        counters = Counters(net)  # samples at once: no process has to enter the namespace first
        send = ("import socket; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); "
                f"[s.sendto(b'x' * 1000, ('{net.hub_ip}', 9)) for _ in range(100)]")
        subprocess.run([*net.exec(0), sys.executable, "-c", send], check=True, timeout=60)
        counters.sample()
    assert [len(t) for t in counters.up] == [2, 2]
    sent = counters.up[0][1][1] - counters.up[0][0][1]
    assert 100 * 1042 <= sent < 100 * 1042 + 2000  # 100 frames of 1000 bytes + UDP, IP and Ethernet headers
    assert subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.count("nxct") == 0
