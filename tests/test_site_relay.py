"""Site relays (`nodeox relay`): two sites of two digits hosts, each behind a relay, under one root coordinator.
A relay is a coordinator to its hosts and one host to the root; the root's syncs pass down unchanged, so every
host ends on the root's model, bit for bit, and stopping together and sync_dist values work as without relays."""

from __future__ import annotations

import json
import subprocess
from collections import Counter
from pathlib import Path

import pytest
import requests
from helpers import Coordinator, assert_identical, published, read_events, received, start_host, stop, wait_for

STEPS_PER_EPOCH = 56  # 1797 digits in batches of 32, the last one dropped
SITES = {"siteA": ("0", "1"), "siteB": ("2", "3")}


def self_signed(folder: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and its key (openssl's command line)."""
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-keyout", str(key), "-out", str(cert), "-days", "2", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"], check=True, capture_output=True, timeout=60)
    return cert, key


def forwarded_whole(relay_dir: Path, root_dir: Path, relay: str) -> list[tuple]:
    """The records of a relay's run log (its site's: its hosts', its coordinator side's), checked to be at the
    root under ``RELAY/HOST``, each once; returned as (host, round, phase)."""
    site = Counter((e["host"], e["round"], e["phase"]) for e in read_events(relay_dir) if e["host"] != relay)
    at_root = Counter((e["host"].removeprefix(f"{relay}/"), e["round"], e["phase"]) for e in read_events(root_dir)
                      if e["host"].startswith(f"{relay}/"))
    assert at_root == site, (site - at_root, at_root - site)
    return list(site)


@pytest.mark.slow
def test_two_sites_behind_relays_end_bit_identical_with_the_root_and_stop_together(tmp_path, monkeypatch) -> None:
    """Host 2 (site B) stops early (EarlyStopping at its first epoch end, step 56, in round 5): every host of both
    sites stops after round 5; all end on the root's final model; the root takes 2 deltas a round (one per relay),
    each weighted by its site's samples, and the sites' phase records (forwarded by the relays); values logged with
    sync_dist are the same on every host. Each process has its own token (the root's, a site's); the root serves
    TLS (the relays trust its certificate: NODEOX_CA_FILE), relay A too (its hosts trust it alike), relay B plain
    HTTP. Each relay's lines name it, and every record of its run log reaches the root."""
    out, procs = tmp_path / "out", []
    for name in ("root", *SITES):  # each its own token: the root's for the relays, a site's for its hosts
        (tmp_path / f"{name}.token").write_text(f"token-of-{name}")
    cert, key = self_signed(tmp_path)
    tls = ("--tls-cert", str(cert), "--tls-key", str(key))
    monkeypatch.setenv("NODEOX_CA_FILE", str(cert))  # the relays' and hosts' (they inherit the test's environment)
    root = Coordinator(tmp_path / "root", len(SITES), "--token-file", str(tmp_path / "root.token"), *tls)
    relays = {name: Coordinator(tmp_path / name, len(hosts), "--upstream", root.url, "--upstream-token-file",
                                str(tmp_path / "root.token"), "--token-file", str(tmp_path / f"{name}.token"),
                                *(tls if name == "siteA" else ()), command="relay")
              for name, hosts in SITES.items()}
    assert root.url.startswith("https://") and relays["siteA"].url.startswith("https://")
    assert relays["siteB"].url.startswith("http://")
    try:
        for name, hosts in SITES.items():
            procs += [start_host(h, relays[name].url, out, "--max-steps", "200", "--stop-host", "2",
                                 token=f"token-of-{name}") for h in hosts]
        wait_for(lambda: all(p.poll() is not None for p in procs), 240, "the hosts to finish")
        assert [p.returncode for p in procs] == [0] * 4, [(out / f"host{h}-0.log").read_text()[-3000:]
                                                          for hosts in SITES.values() for h in hosts]
        assert root.wait(30) == 0 and all(r.wait(30) == 0 for r in relays.values())
    finally:
        stop(procs)
        for c in (*relays.values(), root):
            c.stop()
    hosts = [h for site in SITES.values() for h in site]
    after = {h: json.loads((out / f"host{h}_after_fit.json").read_text()) for h in hosts}
    synced = published(root.run_dir)
    assert sorted(synced) == list(range(6))  # no round after the stop
    final = assert_identical(out, hosts)
    assert final == synced[5]["model_hash"] == {after[h]["model_hash"] for h in hosts}.pop()
    assert {after[h]["last_round"] for h in hosts} == {5}
    assert {h: after[h]["global_step"] for h in hosts} == {"0": 60, "1": 60, "2": STEPS_PER_EPOCH, "3": 60}

    events = read_events(root.run_dir)
    own = [e for e in events if e["host"] == "coordinator"]
    taken = received(root.run_dir)
    assert Counter(e["round"] for e in taken) == {r: 2 for r in range(6)}  # one delta per relay a round
    assert {e["from_host"] for e in taken} == set(SITES)
    uploads = {(e["round"], e["host"]): e["bytes"] for e in events if e["phase"] == "upload" and e["host"] in SITES}
    assert {(e["round"], e["from_host"]): e["bytes"] for e in taken} == uploads
    samples = {e["round"]: e["samples"] for e in own if e["phase"] == "aggregate"}
    assert samples[5] == (3 * 10 + STEPS_PER_EPOCH - 50) * 32 and samples[0] == 4 * 10 * 32
    forwarded = Counter((e["host"], e["phase"]) for e in events if "/" in e["host"])  # the sites' records, via relays
    for name, site in SITES.items():
        assert all(forwarded[(f"{name}/{h}", "train")] == 6 for h in site)
        assert forwarded[(f"{name}/coordinator", "aggregate")] == 6
    for name, site in SITES.items():  # each relay took its own two hosts' deltas, and passed the root's syncs down
        relayed = read_events(tmp_path / name)
        assert Counter(e["round"] for e in relayed if e["phase"] == "receive") == {r: 2 for r in range(6)}
        assert [e["round"] for e in relayed if (e["host"], e["phase"]) == (name, "upload")] == list(range(6))  # its own
        assert {r: e["model_hash"] for r, e in published(tmp_path / name).items()} == \
            {r: e["model_hash"] for r, e in synced.items()}

    # sync_dist: host h logs 10 (h + 1); the last round weighs host 2's 6 batches against the others' 10
    expected = (10 * 10 + 20 * 10 + 30 * 6 + 40 * 10) / 36
    assert [after[h]["callback_metrics"]["shared_step"] for h in hosts] == [pytest.approx(expected, rel=1e-6)] * 4
    seen = {h: json.loads((out / f"host{h}_shared.json").read_text()) for h in hosts}
    assert all(seen[h][10:50] == [25.0] * 40 for h in hosts)  # rounds 1-4: the mean over both sites
    assert after["2"]["callback_metrics"]["shared_epoch"] == 25.0  # epoch 0 across every host of both sites

    for name, site in SITES.items():  # the relay's lines name it; all its records reached the root, the last too
        said = relays[name].log_path.read_text()
        assert f"nodeox relay {name}: host {site[0]} joined" in said and f"nodeox relay {name}: run complete" in said
        assert not any(line.startswith("nodeox coordinator") for line in said.splitlines())
        assert f"nodeox: host {name}" not in said  # its upstream host's lines name the relay too
        assert "could not be sent" not in said
        records = forwarded_whole(tmp_path / name, root.run_dir, name)
        assert ("coordinator", 5, "sync_prepare") in records and all((h, 5, "verify") in records for h in site)
        # TensorBoard: a site's hosts (and the relay's own upstream phases) where its relay writes them, the
        # relays (as hosts) at the root
        assert sorted(p.name for p in (tmp_path / name / "tb").iterdir()) == sorted(
            ["coordinator", f"host_{name}", *(f"host_{h}" for h in site)])
    assert sorted(p.name for p in (root.run_dir / "tb").iterdir()) == ["coordinator", *(f"host_{n}" for n in SITES)]
    # the site whose host provided the run's first model gave it upstream, in the relay's name
    assert sum(f"nodeox relay {n}: host {n} joined again at round 0 and gave the model back"
               in relays[n].log_path.read_text() for n in SITES) == 1


def status(url: str) -> dict:
    """A coordinator's ``GET /v1/status`` (no token)."""
    return requests.get(f"{url}/v1/status", timeout=10).json()


@pytest.mark.slow
def test_a_relay_killed_is_dropped_by_the_root_and_restarted_its_hosts_ride_it_out_bit_identical(tmp_path) -> None:
    """Root (lease 3 s) with a relay (hosts 0 and 1) and host 2 beside it. The relay is killed with -9 once the
    root has published round 2: to the root it is a host that vanished, dropped at its lease, and host 2 goes on
    alone. Started again on its run directory and port, the relay resumes (its hosts ride it out: they rejoin and
    give its θ back), joins the root again with the credential it kept and goes on from the root's model, which
    moved on meanwhile; the run completes (a stop file, once the site is back) with every host on the root's
    final model."""
    out, procs = tmp_path / "out", []
    root = Coordinator(tmp_path / "root", 2, "--lease", "3")
    relay = Coordinator(tmp_path / "siteA", 2, "--upstream", root.url, command="relay")
    port = relay.url.rsplit(":", 1)[1]
    started = [root, relay]
    stop_file = tmp_path / "stop"
    pace = ("--max-steps", "5000", "--step-seconds", "0.03", "--stop-file", str(stop_file))
    try:
        procs += [start_host(h, relay.url, out, *pace) for h in ("0", "1")]
        procs.append(start_host("2", root.url, out, *pace))
        wait_for(lambda: 2 in published(root.run_dir), 120, "round 2 at the root")
        relay.proc.kill()
        assert relay.proc.wait(30) == -9
        wait_for(lambda: status(root.url)["hosts"].get("siteA") == "dropped", 30, "the root to drop the relay")
        dropped_at = status(root.url)["round"]
        wait_for(lambda: max(published(root.run_dir)) > dropped_at, 30, "a round of host 2 alone")
        again = Coordinator(tmp_path / "siteA", 2, "--upstream", root.url, "--bind", f"127.0.0.1:{port}",
                            command="relay")
        started.append(again)
        wait_for(lambda: any(e["from_host"] == "siteA" and e["round"] > dropped_at for e in received(root.run_dir)),
                 120, "a delta of the restarted relay at the root")
        stop_file.touch()
        wait_for(lambda: all(p.poll() is not None for p in procs), 120, "the hosts to finish")
        assert [p.returncode for p in procs] == [0] * 3, [(out / f"host{h}-0.log").read_text()[-3000:]
                                                          for h in "012"]
        assert root.wait(30) == 0 and again.wait(30) == 0
    finally:
        stop(procs)
        for c in started:
            c.stop()
    synced = published(root.run_dir)
    last = max(synced)
    assert sorted(synced) == list(range(last + 1))
    assert assert_identical(out, ["0", "1", "2"]) == synced[last]["model_hash"]
    assert "resuming the run" in again.log_path.read_text()
    assert "host siteA: no heartbeat" in root.log_path.read_text()
    taken = Counter((e["round"], e["from_host"]) for e in received(root.run_dir))
    assert set(taken.values()) == {1}  # each delta taken once (a delta sent again after the restart is not taken twice)
    alone = sorted(r for r in range(last + 1) if (r, "siteA") not in taken)
    assert all((r, "2") in taken for r in range(last + 1))  # host 2 every round, also while the relay was gone ...
    assert alone and min(alone) >= 2 and max(alone) < last  # ... which it alone took part in, then the site again
    assert all((r, "siteA") in taken for r in range(max(alone) + 1, last + 1))
    relayed = read_events(tmp_path / "siteA")
    assert [e["round"] for e in relayed if e["phase"] == "restart"] != []
    assert {r: e["model_hash"] for r, e in published(tmp_path / "siteA").items()}.items() <= \
        {r: e["model_hash"] for r, e in synced.items()}.items()
