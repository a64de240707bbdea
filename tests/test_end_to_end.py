"""Real runs: `nodeox launch` starts a coordinator and host processes that train with real Trainers."""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from helpers import HOSTS, bits, launch, load, read_events
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lightning_nodeox.core.hashing import model_hash

pytestmark = pytest.mark.slow  # every test here starts processes

ROUNDS = 2  # max_steps 30, local_steps 10: rounds 0, 1 and 2, the last batch closing the final round


def tags(folder: Path) -> set[str]:
    acc = EventAccumulator(str(folder))
    acc.Reload()
    return set(acc.Tags()["scalars"])


@pytest.fixture(scope="module")
def two_host_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("two_hosts")
    run_dir, out = root / "run", root / "out"
    result = launch(run_dir, 2, [sys.executable, str(HOSTS / "digits_host.py"), "--out", str(out)])
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-5000:]
    return run_dir, out, result


def test_hosts_are_bit_identical_after_every_round(two_host_run) -> None:
    run_dir, out, _ = two_host_run
    published = {e["round"]: e["model_hash"] for e in read_events(run_dir) if e["phase"] == "sync_prepare"}
    assert sorted(published) == list(range(ROUNDS + 1))
    for name in [f"round{r}" for r in range(ROUNDS)] + ["final"]:
        t0, m0 = load(out / f"host0_{name}.safetensors")
        t1, m1 = load(out / f"host1_{name}.safetensors")
        assert set(t0) == set(t1) and "net.1.running_mean" in t0 and "net.1.running_var" in t0
        for key in t0:
            assert torch.equal(bits(t0[key]), bits(t1[key])), (name, key)
        assert m0["model_hash"] == m1["model_hash"] == published[int(m0["round"])]
        assert model_hash([(k, t0[k]) for k in json.loads(m0["order"])]) == m0["model_hash"]


def test_training_loss_falls(two_host_run) -> None:
    _, out, _ = two_host_run
    for host in (0, 1):
        losses = json.loads((out / f"host{host}_losses.json").read_text())
        assert sum(losses[-5:]) / 5 < 0.6 * sum(losses[:5]) / 5


def test_events_hold_every_phase_of_every_round(two_host_run) -> None:
    run_dir, _, _ = two_host_run
    seen = defaultdict(set)
    for e in read_events(run_dir):
        seen[(e["host"], e["phase"])].add(e["round"])
        assert e["end"] >= e["start"]
    for host in ("0", "1"):
        for phase in ("train", "encode", "upload", "wait", "download", "apply", "verify"):
            assert set(range(ROUNDS + 1)) <= seen[(host, phase)], (host, phase)
    for phase in ("aggregate", "sync_prepare"):
        assert seen[("coordinator", phase)] == set(range(ROUNDS + 1))
    uploads = [e for e in read_events(run_dir) if e["phase"] == "upload"]
    receives = [e for e in read_events(run_dir) if e["phase"] == "receive"]
    assert {u["bytes"] for u in uploads} == {r["bytes"] for r in receives}


def test_tensorboard_scalars_on_hosts_and_coordinator(two_host_run) -> None:
    run_dir, out, _ = two_host_run
    for host in (0, 1):
        host_tags = tags(next((out / f"tb_host{host}").rglob("events.out.tfevents*")).parent)
        assert {"nodeox/encode_s", "nodeox/upload_s", "nodeox/sync_s", "nodeox/upload_bytes"} <= host_tags
        run_tags = tags(run_dir / "tb" / f"host_{host}")  # per round: tags of their own, never overlaying
        assert {"nodeox_round/encode_s", "nodeox_round/sync_s"} <= run_tags and not run_tags & host_tags
        assert "nodeox/round" not in host_tags
    assert {"nodeox/aggregate_s", "nodeox/sync_prepare_s", "nodeox/coordinator_rss_bytes"} <= tags(
        run_dir / "tb" / "coordinator")


def test_host_that_missed_a_sync_recovers_by_fetching_the_model(tmp_path) -> None:
    run_dir, out = tmp_path / "run", tmp_path / "out"
    result = launch(run_dir, 2, [sys.executable, str(HOSTS / "digits_host.py"), "--out", str(out),
                                 "--skip-sync-round", "1"])
    assert result.returncode == 0, result.stdout[-5000:]
    fetches = [e for e in read_events(run_dir) if e["phase"] == "fallback_fetch" and e["host"] == "1"]
    assert any(e["round"] >= 1 for e in fetches), "host 1 must have fetched the full model after round 1"
    t0, m0 = load(out / "host0_final.safetensors")
    t1, m1 = load(out / "host1_final.safetensors")
    assert m0["model_hash"] == m1["model_hash"]
    assert all(torch.equal(t0[k], t1[k]) for k in t0)


def test_report_json_matches_the_records_and_plots_a_timeline(two_host_run, tmp_path) -> None:
    import subprocess

    from PIL import Image

    run_dir, _, _ = two_host_run
    png = tmp_path / "timeline.png"
    out = subprocess.run([sys.executable, "-m", "lightning_nodeox", "report", str(run_dir), "--json", "--plot", str(png)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    records = read_events(run_dir)
    assert [r["round"] for r in report["rounds"]] == list(range(ROUNDS + 1))
    for rnd in report["rounds"]:
        assert rnd["hosts"] == ["0", "1"]
        for phase in ("train", "encode", "upload", "wait", "download", "apply", "verify", "sync"):
            assert set(rnd["host_phases"][phase]["per_host"]) == {"0", "1"}, (rnd["round"], phase)
        for phase in ("encode", "upload", "download", "apply", "verify"):
            durations = [e["end"] - e["start"] for e in records if e["round"] == rnd["round"] and e["phase"] == phase]
            assert rnd["host_phases"][phase]["min"] == pytest.approx(min(durations), abs=1e-9)
            assert rnd["host_phases"][phase]["max"] == pytest.approx(max(durations), abs=1e-9)
        for host in ("0", "1"):
            sent = [e["bytes"] for e in records if e["round"] == rnd["round"] and e["host"] == host
                    and e["phase"] == "upload"]
            received = [e["bytes"] for e in records if e["round"] == rnd["round"] and e["phase"] == "receive"
                        and e["from_host"] == host]
            assert rnd["bytes"][host]["up"] == sum(sent) == sum(received) > 0
            assert 0 <= rnd["wait_share"][host] <= 1
        assert rnd["coordinator_phases"]["sync_prepare"] > 0
        assert set(rnd["aggregation_to_sync"]["per_host"]) == {"0", "1"}
    assert report["summary"]["coordinator_peak_rss_bytes"] > 100 << 20
    image = Image.open(png)
    assert image.size[0] >= 800 and image.size[1] >= 200
    assert len(set(image.convert("RGB").getdata())) > 5


def test_clock_alignment_keeps_causality(two_host_run) -> None:
    """Mapped onto the coordinator's clock, a host's upload starts before the coordinator receives it, and its
    download starts after the sync was published (within a loopback round trip)."""
    run_dir, _, _ = two_host_run
    records = read_events(run_dir)
    slack = 0.05
    published = {e["round"]: e["end"] for e in records if e["phase"] == "sync_prepare"}
    for e in records:
        if e["phase"] == "upload":
            received = [r for r in records if r["phase"] == "receive" and r["round"] == e["round"]
                        and r["from_host"] == e["host"]]
            assert e["start"] <= received[0]["start"] + slack
            assert abs(e["clock_offset"]) < 1.0
        if e["phase"] == "download":
            assert e["start"] >= published[e["round"]] - slack


def test_round_timeout_drops_a_stalled_host_which_rejoins(tmp_path) -> None:
    """Host 1 stalls in round 1: rounds close on their timeout without it; its late delta is refused, it fetches
    the model, takes part again, and both hosts end on the same model."""
    run_dir, out = tmp_path / "run", tmp_path / "out"
    result = launch(run_dir, 2, [sys.executable, str(HOSTS / "digits_host.py"), "--out", str(out),
                                 "--stall-round", "1", "--stall-seconds", "4"],
                    "--round-timeout", "2", "--min-hosts", "1")
    assert result.returncode == 0, result.stdout[-5000:]
    records = read_events(run_dir)
    rejected = [e for e in records if e["host"] == "1" and e["phase"] == "upload" and "rejected" in e]
    assert rejected and rejected[0]["round"] == 1
    aggregated = {e["round"]: e["hosts"] for e in records if e["phase"] == "aggregate"}
    assert aggregated[1] == ["0"]  # round 1 closed on its timeout with host 0 alone
    t0, m0 = load(out / "host0_final.safetensors")
    t1, m1 = load(out / "host1_final.safetensors")
    assert m0["model_hash"] == m1["model_hash"]
    assert all(torch.equal(t0[k], t1[k]) for k in t0)


def test_overlap_with_nesterov_ends_bit_identical_and_trains_while_exchanging(tmp_path) -> None:
    """Hosts keep training while each round's exchange is in flight (poll, then fold into the live model); the
    last round is not overlapped, so both end on the run's final model."""
    run_dir, out = tmp_path / "run", tmp_path / "out"
    result = launch(run_dir, 2, [sys.executable, str(HOSTS / "digits_host.py"), "--out", str(out), "--overlap", "eager",
                                 "--max-steps", "40"], "--outer-optimizer", "nesterov")
    assert result.returncode == 0, result.stdout[-5000:]
    t0, m0 = load(out / "host0_final.safetensors")
    t1, m1 = load(out / "host1_final.safetensors")
    published = [e["model_hash"] for e in read_events(run_dir) if e["phase"] == "sync_prepare"]
    assert m0["model_hash"] == m1["model_hash"] == published[-1]
    assert all(torch.equal(t0[k], t1[k]) for k in t0)
    seen = defaultdict(set)
    for e in read_events(run_dir):
        seen[(e["host"], e["phase"])].add(e["round"])
    for host in ("0", "1"):
        assert {1, 2} <= seen[(host, "poll")] and {1, 2} <= seen[(host, "fold")], host
        assert 0 not in seen[(host, "poll")] and 0 in seen[(host, "wait")], "the first round is not overlapped"
        assert max(seen[(host, "wait")]) > 2, "the last round is waited for"
    losses = json.loads((out / "host0_losses.json").read_text())
    assert sum(losses[-5:]) / 5 < 0.6 * sum(losses[:5]) / 5
