"""``--merge async`` end to end, with real host processes (digits under NodeoxStrategy): a host stopped (SIGSTOP)
for several rounds is not waited for, its delta is merged when it resumes with the staleness the records give,
and every host ends bit-identical with the coordinator's final model."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from helpers import DIGITS, Coordinator, assert_identical, launch, published, read_events, start_host, stop, wait_for

ROUNDS_STOPPED = 3


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_host_stopped_for_three_rounds_is_not_waited_for_and_its_late_delta_is_merged(tmp_path: Path) -> None:
    coord = Coordinator(tmp_path / "run", 3, "--merge", "async", "--min-quorum", "2", "--grace", "0.5",
                        "--max-staleness", "8")
    out = tmp_path / "out"
    procs = [start_host(h, coord.url, out, "--max-steps", "150", "--local-steps", "10", "--step-seconds", "0.03")
             for h in "012"]
    try:
        wait_for(lambda: 1 in published(coord.run_dir), 180, "round 1")
        pid = int((out / "host2.pid").read_text())
        os.kill(pid, signal.SIGSTOP)
        stopped_at = max(published(coord.run_dir))
        try:  # the two others go on: rounds close without it
            wait_for(lambda: max(published(coord.run_dir)) >= stopped_at + ROUNDS_STOPPED + 1, 120,
                     f"{ROUNDS_STOPPED + 1} rounds while host 2 is stopped")
        finally:
            os.kill(pid, signal.SIGCONT)
        for p in procs:
            assert p.wait(180) == 0, [f.read_text()[-4000:] for f in sorted(out.glob("host*.log"))]
        assert coord.wait(30) == 0, coord.log_path.read_text()[-4000:]
    finally:
        stop(procs)
        coord.stop()
    merged = {e["round"]: e for e in coord.events() if e["phase"] == "aggregate" and e["host"] == "coordinator"}
    for r in range(stopped_at + 2, stopped_at + ROUNDS_STOPPED + 1):  # (the first may have held its delta)
        assert merged[r]["hosts"] == ["0", "1"] and merged[r]["late"] == ["2"] and merged[r]["quorum"] == 2, merged[r]
    late = {r: e["stale"]["2"] for r, e in merged.items() if "2" in e["stale"]}
    assert late and max(late.values()) >= ROUNDS_STOPPED, late  # its delta, of a round before the stop, merged late
    assert all(r - s >= 0 for r, s in late.items())
    final = assert_identical(out, ["0", "1", "2"])
    last = max(published(coord.run_dir))
    assert published(coord.run_dir)[last]["model_hash"] == final


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_through_relays_the_root_merges_a_slow_sites_deltas_late_and_every_host_ends_on_its_model(
        tmp_path: Path) -> None:
    """`nodeox launch --sites 2`: the root (--merge async, a quorum of one site) closes rounds without the slow site
    (its hosts 6x slower a step) and merges its deltas late; its hosts, behind their relay, end on the root's
    model too."""
    run_dir, out = tmp_path / "run", tmp_path / "out"
    result = launch(run_dir, 4, [*DIGITS, "--out", str(out), "--max-steps", "60", "--local-steps", "10",
                                 "--step-seconds", "0.005,0.005,0.03,0.03"],
                    "--sites", "2", "--merge", "async", "--min-quorum", "1", "--grace", "0", timeout=240)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    merged = [e for e in read_events(run_dir) if e["phase"] == "aggregate" and e["host"] == "coordinator"]
    late = [s for e in merged for h, s in e["stale"].items()]
    assert late and all(1 <= s <= 4 for s in late), merged  # the slow site's deltas, merged late
    assert any(e["hosts"] == ["site0"] and e["late"] == ["site1"] for e in merged), merged
    final = assert_identical(out, ["0", "1", "2", "3"])
    assert published(run_dir)[max(published(run_dir))]["model_hash"] == final
