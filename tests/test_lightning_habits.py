"""A Lightning user's habits under `nodeox launch --hosts 2`: stopping together, sync_dist metrics across hosts,
progress lines, preemption (SIGTERM), LightningCLI and one run folder. Real processes on loopback."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import defaultdict

import pytest
import requests
import torch
from helpers import DIGITS, HOSTS, REPO, bits, launch, load, read_events
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

pytestmark = pytest.mark.slow  # every test here starts processes

STEPS_PER_EPOCH = 56  # 1797 digits in batches of 32, the last one dropped


@pytest.fixture(scope="module")
def early_stop_run(tmp_path_factory):
    """EarlyStopping triggers on host 1 alone, at its first epoch end (step 56, inside round 5); both hosts log
    `shared_step` and `shared_epoch` with sync_dist=True: 10 on host 0, 20 on host 1."""
    root = tmp_path_factory.mktemp("early_stop")
    run_dir, out = root / "run", root / "out"
    result = launch(run_dir, 2, [sys.executable, str(HOSTS / "digits_host.py"), "--out", str(out), "--max-steps", "200",
                                 "--stop-host", "1", "--progress-bar"])
    assert result.returncode == 0, result.stdout[-5000:]
    after = {h: json.loads((out / f"host{h}_after_fit.json").read_text()) for h in (0, 1)}
    return run_dir, out, result, after


def test_early_stopping_on_one_host_stops_every_host_after_the_same_round(early_stop_run) -> None:
    run_dir, out, _, after = early_stop_run
    assert after[1]["global_step"] == STEPS_PER_EPOCH  # its own EarlyStopping
    assert after[0]["global_step"] == 60  # stopped at its next round boundary, not at max_steps=200
    assert after[0]["last_round"] == after[1]["last_round"] == 5
    published = {e["round"]: e["model_hash"] for e in read_events(run_dir) if e["phase"] == "sync_prepare"}
    assert sorted(published) == list(range(6))  # no round after the stop
    t0, m0 = load(out / "host0_final.safetensors")
    t1, m1 = load(out / "host1_final.safetensors")
    assert m0["model_hash"] == m1["model_hash"] == after[0]["model_hash"] == published[5]
    assert all(torch.equal(bits(t0[k]), bits(t1[k])) for k in t0)
    aggregated = {e["round"]: e["samples"] for e in read_events(run_dir) if e["phase"] == "aggregate"}
    assert aggregated[5] == (10 + STEPS_PER_EPOCH - 50) * 32  # host 0's full round and host 1's partial one


def test_sync_dist_values_are_the_same_on_every_host(early_stop_run) -> None:
    _, out, result, after = early_stop_run
    seen = {h: json.loads((out / f"host{h}_shared.json").read_text()) for h in (0, 1)}
    assert seen[0][:10] == [10.0] * 10 and seen[1][:10] == [20.0] * 10  # round 0: each host's own value ...
    assert result.stdout.count("until a round has shared it this host uses its own value") == 2  # ... said once
    assert seen[0][10:50] == seen[1][10:50] == [15.0] * 40  # then the mean of the last round, on both hosts
    # after fit, a step value is the last round's, weighted by samples (host 1 trained 6 batches of it, host 0 10)
    expected = (10.0 * 10 + 20.0 * 6) / 16
    assert after[0]["callback_metrics"]["shared_step"] == pytest.approx(expected, rel=1e-6)
    assert after[1]["callback_metrics"]["shared_step"] == pytest.approx(expected, rel=1e-6)
    # an epoch value is its epoch's across hosts: epoch 0, which host 1 stopped at the end of, on both hosts' batches
    assert after[1]["callback_metrics"]["shared_epoch"] == 15.0
    # host 0 went on 4 steps into epoch 1 (to its round boundary), which host 1 never trained: its own value
    assert after[0]["callback_metrics"]["shared_epoch"] == 10.0
    assert after[0]["callback_metrics"]["stop_signal"] == 1.0 and after[1]["callback_metrics"]["stop_signal"] == 0.0


def test_the_console_shows_folded_progress_lines_a_bars_last_state_and_lightnings_chatter_once(early_stop_run) -> None:
    _, _, result, _ = early_stop_run
    out = result.stdout
    lines = defaultdict(list)
    for m in re.finditer(r"^\[host (\d)\] nodeox: host \1 (?:round (\d+)|rounds (\d+)-(\d+)), step (\d+), "
                         r"train_loss [\d.e+-]+, waited [\d.]+s, model ([0-9a-f]{8})( \(the run is complete\))?$", out,
                         re.MULTILINE):
        first, last = (int(m[2]), int(m[2])) if m[2] else (int(m[3]), int(m[4]))
        lines[m[1]].append((first, last, int(m[5]), m[6], bool(m[7])))
    assert len(re.findall(r"nodeox: host \d rounds? ", out)) == sum(map(len, lines.values()))  # each a line of its own
    for h, final_step in {"0": 60, "1": STEPS_PER_EPOCH}.items():  # host 0 stops at its next boundary (epoch 1)
        shown = lines[h]
        assert shown[0][:2] == (0, 0)  # the first round has a line of its own; rounds 0-5 each once, in order
        assert [r for first, last, *_ in shown for r in range(first, last + 1)] == list(range(6))
        assert shown[-1][2] == final_step and shown[-1][4] and not any(s[4] for s in shown[:-1])
        bars = [line for line in out.splitlines() if line.startswith(f"[host {h}] Epoch ")]
        assert len(bars) == 1 and f"| {final_step % STEPS_PER_EPOCH or STEPS_PER_EPOCH}/{STEPS_PER_EPOCH} [" in bars[0]
    assert lines["0"][-1][3] == lines["1"][-1][3]  # the final model, the same on both hosts
    assert "\x1b" not in out and "\r" not in out
    assert out.count("GPU available: ") == 1 and out.count("LeafSpec") <= 1  # once per launch, not per host


def test_sigterm_while_waiting_for_a_sync_leaves_at_once(tmp_path) -> None:
    """Host 0 stalls in round 1 while host 1 waits for round 1's sync; SIGTERM to host 1 makes it stop waiting at
    once (not when the round closes, 4 s later) and exit 143; host 0 finishes alone (the round timeout closes the
    rounds host 1 no longer sends to), and launch names the host that failed and exits non-zero."""
    run_dir, out = tmp_path / "run", tmp_path / "out"
    cmd = [sys.executable, "-m", "lightning_nodeox", "launch", "--hosts", "2", "--run-dir", str(run_dir), "--threads",
           "1", "--round-timeout", "4", "--min-hosts", "1", "--", *DIGITS,
           "--out", str(out), "--stall-host", "0", "--stall-round", "1", "--stall-seconds", "6"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                            env=dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1"))
    try:
        deadline = time.monotonic() + 120
        while True:  # host 1 has sent round 1's delta: it is waiting for the sync
            assert time.monotonic() < deadline and proc.poll() is None, "host 1 never waited for round 1's sync"
            url = run_dir / ".coordinator-url"
            if url.exists() and (out / "host1.pid").exists():
                token = (run_dir / "token").read_text().strip()  # launch made the run's token
                status = requests.get(f"{url.read_text().strip()}/v1/status", timeout=5,
                                      headers={"Authorization": f"Bearer {token}"}).json()
                if status["round"] == 1 and status["received"] == ["1"]:
                    break
            time.sleep(0.05)
        pid = int((out / "host1.pid").read_text())
        sent = time.time()
        os.kill(pid, signal.SIGTERM)
        while _alive(pid):  # then the interpreter's own exit: seconds on a busy machine
            assert time.time() - sent < 30, "host 1 did not exit within 30 s of SIGTERM"
            time.sleep(0.05)
        exited_after = time.time() - sent
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    interrupted = json.loads((out / "host1_interrupted.json").read_text())
    print(f"host 1 left {interrupted['at'] - sent:.2f} s and exited {exited_after:.2f} s after SIGTERM")
    assert interrupted["exception"] == "SIGTERMException" and interrupted["at"] - sent < 2.0
    assert proc.returncode == 143, output[-3000:]
    assert "nodeox launch: host 1 failed: exit status 143 (SIGTERM); the other hosts go on" in output
    after = json.loads((out / "host0_after_fit.json").read_text())
    assert after["global_step"] == 30 and not (out / "host1_after_fit.json").exists()
    published = {e["round"]: e["model_hash"] for e in read_events(run_dir) if e["phase"] == "sync_prepare"}
    assert after["model_hash"] == published[max(published)]
    aggregated = {e["round"]: e["hosts"] for e in read_events(run_dir) if e["phase"] == "aggregate"}
    assert aggregated[max(aggregated)] == ["0"]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_lightning_cli_under_launch_writes_each_host_into_the_run_folder(tmp_path) -> None:
    """LightningCLI with its default config saving and default logger, the strategy given in YAML by class_path:
    each host writes its config, checkpoints and training curves under RUN_DIR/hosts/host<i>/; prepare_data runs
    on one host of the machine, and the other waits for it before its setup."""
    run_dir, out = tmp_path / "run", tmp_path / "out"
    config = tmp_path / "config.yaml"
    config.write_text("trainer:\n  strategy:\n    class_path: lightning_nodeox.NodeoxStrategy\n"
                      "    init_args:\n      local_steps: 5\n      cpu_threads: 1\n      codec_threads: 1\n"
                      "  callbacks:\n    - class_path: lightning_nodeox.PhaseMonitor\n"
                      "  max_steps: 15\n  enable_progress_bar: false\n  enable_model_summary: false\n"
                      "  log_every_n_steps: 1\n")
    result = launch(run_dir, 2, [sys.executable, str(HOSTS / "cli_host.py"), "fit", "--config", str(config),
                                 "--data.out", str(out)], cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-5000:]
    assert not (tmp_path / "lightning_logs").exists()
    for host in (0, 1):
        version = run_dir / "hosts" / f"host{host}" / "version_0"
        assert "local_steps: 5" in (version / "config.yaml").read_text()
        assert list((version / "checkpoints").glob("*.ckpt"))
        acc = EventAccumulator(str(version))
        acc.Reload()
        assert {"train_loss", "nodeox/encode_s", "nodeox/wait_s"} <= set(acc.Tags()["scalars"])
        assert [e.step for e in acc.Scalars("nodeox/encode_s")] == [5, 10, 15]
    assert sorted(p.name for p in out.glob("prepared_by_*")) == ["prepared_by_0"]
    assert json.loads((out / "setup_1.json").read_text()) == {"local_rank": 1, "prepared_before_setup": True}


def test_early_stopping_while_another_host_overlaps_its_exchange_still_ends_bit_identical(tmp_path) -> None:
    """Host 0 trains on while its round 5 is in flight (overlap) when host 1's EarlyStopping ends the run with
    that round: host 0 drops the progress it made meanwhile and ends on the run's final model, like host 1."""
    run_dir, out = tmp_path / "run", tmp_path / "out"
    # paced: the hosts meet at epoch 0's end (its values are exchanged there), and host 1's final delta must reach
    # the coordinator within host 0's next 10 steps
    result = launch(run_dir, 2, [sys.executable, str(HOSTS / "digits_host.py"), "--out", str(out), "--max-steps", "200",
                                 "--stop-host", "1", "--overlap", "eager", "--step-seconds", "0.02"])
    assert result.returncode == 0, result.stdout[-5000:]
    after = {h: json.loads((out / f"host{h}_after_fit.json").read_text()) for h in (0, 1)}
    published = {e["round"]: e["model_hash"] for e in read_events(run_dir) if e["phase"] == "sync_prepare"}
    assert sorted(published) == list(range(6)) and after[1]["global_step"] == STEPS_PER_EPOCH
    assert 60 < after[0]["global_step"] < 70  # it stopped at the first batch after the last sync arrived
    t0, m0 = load(out / "host0_final.safetensors")
    t1, m1 = load(out / "host1_final.safetensors")
    assert m0["model_hash"] == m1["model_hash"] == published[5]
    assert all(torch.equal(bits(t0[k]), bits(t1[k])) for k in t0)
