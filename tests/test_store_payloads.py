"""Syncs and the model through the run's store (``--store``): real coordinator and host processes, the store a
folder (``file://``) or a real S3-compatible server on 127.0.0.1; hosts read what the coordinator wrote once."""

from __future__ import annotations

import json
import time
import urllib.request

import pytest

from lightning_nodeox.core.stores import open_store
from helpers import Coordinator, assert_identical, forked, published, read_events, start_host, stop, wait_for

pytestmark = pytest.mark.slow


def _status(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/v1/status", timeout=10) as r:
        return json.loads(r.read())


def _run(tmp_path, name: str, hosts: int, *args: str, steps: tuple[str, ...] = ("--max-steps", "30"),
         during=None) -> tuple[dict, dict, list[dict], Coordinator]:
    """A run of ``hosts`` digits hosts under a coordinator with ``args`` (kept running at the end, so that its status
    is read): its status, published rounds and records, once every host ended bit-identical on its final model.
    ``during(coordinator)`` is called once the hosts are started."""
    coord = Coordinator(tmp_path / name, hosts, *args, "--keep-running")
    out = tmp_path / f"{name}-out"
    procs = [start_host(str(h), coord.url, out, *steps) for h in range(hosts)]
    try:
        if during is not None:
            during(coord)
        for p in procs:
            assert p.wait(300) == 0
        wait_for(lambda: _status(coord.url)["complete"], 30, "the run to complete")
        status = {**_status(coord.url), "read_at": time.time()}
    finally:
        stop(procs)
        coord.stop()  # (its shutdown's snapshot is written to the store after the status was read)
    rounds = published(coord.run_dir)
    assert assert_identical(out, [str(h) for h in range(hosts)]) == rounds[max(rounds)]["model_hash"]
    return status, rounds, read_events(coord.run_dir), coord


def test_hosts_read_each_sync_from_the_store_and_end_bit_identical(tmp_path, store_url):
    status, rounds, events, _ = _run(tmp_path, "run", 3, "--store", store_url)
    stored = {e["round"]: e for e in events if e["phase"] == "store" and e["what"] == "sync"}
    assert sorted(stored) == sorted(rounds)  # every round's sync went to the store, once
    sync_bytes = {e["round"]: e["bytes"] for e in events if e["phase"] == "download" and e["host"] == "0"}
    assert all(stored[r]["bytes"] == sync_bytes[r] for r in stored)
    # the coordinator sent no sync itself: 3 hosts' downloads cost it one upload of each sync
    assert status["sent_bytes"] == {"sync": 0, "model": 0}
    models = [e for e in events if e["phase"] == "store" and e["what"] == "model"]
    assert len({e["round"] for e in models}) == len(models)  # the model written at most once a round
    before = [e for e in [*stored.values(), *models] if e["end"] <= status["read_at"]]
    assert status["store"]["bytes"] == sum(e["bytes"] for e in before)
    # objects of rounds no host needs are gone: the last two rounds' syncs are left
    store = open_store(store_url)
    assert {key.split("/")[1] for key in store.keys("syncs/")} == {str(r) for r in sorted(rounds)[-2:]}
    # the run's state in the store names the sync hosts read instead of holding a second copy of it
    state = store.keys("state/")
    assert [k for k in state if k.startswith("state/sync-")] == [f"state/sync-{max(rounds) + 1}.q4.link"], state


def test_a_store_that_fails_mid_run_leaves_the_coordinator_sending_the_bytes_itself(tmp_path):
    store = tmp_path / "store"

    def fail(coord: Coordinator) -> None:
        wait_for(lambda: len(published(coord.run_dir)) >= 2, 120, "two rounds published")
        store.rename(tmp_path / "store-gone")
        store.write_text("not a folder: every write to the store fails")

    status, _, _, coord = _run(tmp_path, "run", 2, "--store", f"file://{store}", "--transfer-timeout", "3",
                               steps=("--max-steps", "60", "--step-seconds", "0.02"), during=fail)
    assert status["store"]["failing"] and status["sent_bytes"]["sync"] > 0  # later syncs went from the coordinator
    said = coord.log_path.read_text()
    assert said.count("cannot write to the store") == 1, said[-3000:]


def test_the_report_says_what_the_store_cost_per_round(tmp_path):
    """`nodeox report` of a run with a store: its bytes and requests per round and in all."""
    import subprocess
    import sys

    store = f"file://{tmp_path / 'store'}"
    coord = Coordinator(tmp_path / "run", 2, "--store", store)
    out = tmp_path / "out"
    procs = [start_host(h, coord.url, out, "--max-steps", "20") for h in "01"]
    try:
        for p in procs:
            assert p.wait(180) == 0
        assert coord.wait(60) == 0
    finally:
        stop(procs)
        coord.stop()
    events = read_events(coord.run_dir)
    written = sum(e["bytes"] for e in events if e["phase"] == "store")
    report = subprocess.run([sys.executable, "-m", "lightning_nodeox", "report", str(coord.run_dir), "--json"],
                            capture_output=True, text=True, timeout=60)
    summary = json.loads(report.stdout)["summary"]
    assert summary["store"]["bytes"] == written > 0
    assert summary["store"]["requests"] == sum(e["requests"] for e in events if e["phase"] == "store")
    text = subprocess.run([sys.executable, "-m", "lightning_nodeox", "report", str(coord.run_dir)],
                          capture_output=True, text=True, timeout=60).stdout
    assert "written in" in text and "store:" in text


def test_a_relay_with_a_store_of_its_own_serves_its_sites_hosts_through_it(tmp_path):
    """The root with a store, a relay with another (its own prefix): the relay reads the root's syncs from the
    root's store, its hosts read the relay's from the relay's; everyone ends on the root's final model."""
    out, procs = tmp_path / "out", []
    root = Coordinator(tmp_path / "root", 2, "--store", f"file://{tmp_path / 'store' / 'root'}")
    relay = Coordinator(tmp_path / "siteA", 2, "--upstream", root.url, "--store",
                        f"file://{tmp_path / 'store' / 'siteA'}", command="relay")
    try:
        procs += [start_host(h, relay.url, out, "--max-steps", "30") for h in ("0", "1")]
        procs.append(start_host("2", root.url, out, "--max-steps", "30"))
        for p in procs:
            assert p.wait(180) == 0
        assert root.wait(60) == 0 and relay.wait(60) == 0
    finally:
        stop(procs)
        root.stop()
        relay.stop()
    synced = published(root.run_dir)
    assert assert_identical(out, ["0", "1", "2"]) == synced[max(synced)]["model_hash"]
    for run_dir in (root.run_dir, relay.run_dir):
        stored = {e["round"] for e in read_events(run_dir) if e["phase"] == "store" and e["what"] == "sync"
                  and e["host"] == "coordinator"}
        assert stored == set(synced), run_dir.name  # each wrote every round's sync to its own store


def test_eight_hosts_cost_the_coordinator_one_sync_a_round_with_a_store_and_eight_without(tmp_path, s3_url):
    """The coordinator's sync bytes out per round (sent itself, and written to the store): at most 1.5x one sync
    with the store (8 hosts read it there), about 8x without; and the model the 7 joining hosts fetched at once was
    written to the store once."""
    two_rounds = ("--max-steps", "20")  # a figure per round: the first round's (the model's fetch) and one after it
    with_store, rounds, events, _ = _run(tmp_path, "store", 8, "--store", s3_url, steps=two_rounds)
    without, rounds_plain, _, _ = _run(tmp_path, "plain", 8, steps=two_rounds)
    assert sorted(rounds) == sorted(rounds_plain) == [0, 1]
    sync = {r: e["bytes"] for e in events if e["phase"] == "download" and e["host"] == "0" for r in [e["round"]]}
    one_sync = max(sync.values())
    stored = sum(e["bytes"] for e in events if e["phase"] == "store" and e["what"] == "sync")
    out_with = (with_store["sent_bytes"]["sync"] + stored) / len(rounds)
    out_without = without["sent_bytes"]["sync"] / len(rounds_plain)
    assert out_with <= 1.5 * one_sync, (out_with, one_sync)
    assert out_without >= 7.5 * one_sync, (out_without, one_sync)
    models = [e for e in events if e["phase"] == "store" and e["what"] == "model"]
    fetched = [e for e in events if e["phase"] == "fallback_fetch" and e["round"] == 0]
    assert len(fetched) == 7 and [m["round"] for m in models if m["round"] == 0] == [0]  # 7 joined on one upload
    assert with_store["sent_bytes"]["model"] == 0 and without["sent_bytes"]["model"] >= 7 * models[0]["bytes"]


def test_a_host_whose_store_urls_are_refused_asks_the_coordinator_for_the_bytes(tmp_path, s3_server, monkeypatch):
    """Every presigned read refused (403, as for an expired URL), the coordinator's own writes let through: hosts
    say so and take the syncs and the model from the coordinator, and end bit-identical on its final model."""
    from s3server import S3Proxy, new_bucket, use

    proxy = S3Proxy(s3_server.endpoint, lambda method, path: 403 if "X-Amz-Signature" in path else None)
    use(s3_server, monkeypatch, proxy.endpoint)
    try:
        status, _, _, _ = _run(tmp_path, "run", 2, "--store", f"s3://{new_bucket(s3_server)}/run")
    finally:
        proxy.stop()
    assert proxy.refused > 0 and proxy.forwarded > 0
    assert status["sent_bytes"]["sync"] > 0 and status["sent_bytes"]["model"] > 0
    for h in "01":
        said = (tmp_path / "run-out" / f"host{h}-0.log").read_text()
        assert "cannot use the run's store" in said and "HTTP 403" in said, said[-2000:]


def test_a_bucket_that_does_not_exist_stops_the_coordinator_at_start_naming_the_fix(tmp_path, s3_url):
    import subprocess
    import sys

    done = subprocess.run(forked([sys.executable, "-m", "lightning_nodeox", "coordinator", "--hosts", "1",
                                  "--run-dir", str(tmp_path / "run"), "--bind", "127.0.0.1:0", "--store",
                                  "s3://no-such-bucket/run"]), capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "no-such-bucket" in done.stderr and "create it: aws s3 mb s3://no-such-bucket" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "run" / "coordinator.json").exists()  # never listened


def test_deltas_written_to_the_store_are_read_there_and_the_hosts_end_bit_identical(tmp_path, store_url):
    """``--store-deltas``: each host writes its delta's parts to the store and posts where they are; the
    coordinator takes every delta (a receive record each, its bytes those of the parts) and deletes the parts."""
    status, rounds, events, _ = _run(tmp_path, "run", 2, "--store", store_url, "--store-deltas")
    received = [e for e in events if e["phase"] == "receive" and e["host"] == "coordinator"]
    assert sorted((e["round"], e["from_host"]) for e in received) == [(r, h) for r in sorted(rounds) for h in "01"]
    uploads = {(e["round"], e["host"]): e["bytes"] for e in events if e["phase"] == "upload"}
    assert all(uploads[(e["round"], e["from_host"])] == e["bytes"] for e in received)
    assert open_store(store_url).keys("deltas/") == []  # every delta's parts deleted once read
    assert status["store"]["deltas_read_bytes"] == sum(e["bytes"] for e in received)  # all of them from the store


def test_a_host_whose_delta_writes_are_refused_sends_its_deltas_itself(tmp_path, s3_server, monkeypatch):
    from s3server import S3Proxy, new_bucket, use

    proxy = S3Proxy(s3_server.endpoint, lambda method, path: 403 if method == "PUT" and "X-Amz-Signature" in path
                    else None)
    use(s3_server, monkeypatch, proxy.endpoint)
    try:
        status, rounds, events, _ = _run(tmp_path, "run", 2, "--store", f"s3://{new_bucket(s3_server)}/run",
                                         "--store-deltas")
    finally:
        proxy.stop()
    received = [e for e in events if e["phase"] == "receive" and e["host"] == "coordinator"]
    assert len(received) == 2 * len(rounds) and proxy.refused > 0
    assert status["store"]["deltas_read_bytes"] == 0  # every delta came over HTTP
    for h in "01":
        said = (tmp_path / "run-out" / f"host{h}-0.log").read_text()
        assert "cannot use the run's store" in said and "HTTP 403" in said, said[-2000:]
