"""The data ledger through site relays, end to end: `nodeox launch --hosts 4 --sites 2` of digits hosts whose
loaders get the ledger's sampler; each relay leases blocks of units from the root and shares them out to its two
hosts (lightning_nodeox/relay/data.py)."""

from __future__ import annotations

import json
import os
import signal
from collections import Counter
from pathlib import Path

import pytest
from helpers import DIGITS, Coordinator, launch, read_events, wait_for
from test_ledger_wiring import SAMPLES as LEDGER_SAMPLES, SEED, UNIT, Host, assert_every_index_once, data_status, exchange

from lightning_nodeox.core.ledger_terms import Lease
from lightning_nodeox.core.protocol import DataSpec, Refusal

SAMPLES = 1797  # scikit-learn's digits
SITES = ("siteA", "siteB")
HOSTS = ("0", "1", "2", "3")
WHOLE = (0, 1)  # the epochs the run surely trains whole (its last, the third, ends at the first host's final delta)


def _trained(out: Path, host: str) -> list[list[int]]:
    return json.loads((out / f"host{host}_indices.json").read_text())


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("overlap", ["off", "eager"])
def test_two_sites_of_two_hosts_train_every_index_of_each_epoch_once_and_the_root_commits_each_epoch_whole(
        tmp_path: Path, overlap: str) -> None:
    """Three epochs (the run ends at the first final delta, mid-way through the last): across the four hosts (two
    behind each relay) each whole epoch's trained indices are every index once; the root's data records commit
    exactly the dataset's length for each, and each site's ledger committed what its hosts trained."""
    run_dir, out = tmp_path / "run", tmp_path / "out"
    result = launch(run_dir, 4, [*DIGITS, "--out", str(out), "--ledger", "--log-indices", "--max-epochs", "3",
                                 "--max-steps", "100000", "--local-steps", "6", "--batch-size", "32", "--overlap", overlap],
                    "--sites", "2", "--data-unit", "128", timeout=360)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert "bad phase records" not in result.stdout  # the sites' data records stay in the relays' run logs
    assert "could not commit" not in result.stdout and "is void: the ledger is at" not in result.stdout  # none void
    trained = {h: _trained(out, h) for h in HOSTS}
    for epoch in WHOLE:  # none lost, none twice, across both sites
        indices = [i for h in HOSTS for e, i in trained[h] if e == epoch]
        assert sorted(indices) == list(range(SAMPLES)), (epoch, len(indices), Counter(indices).most_common(3))

    root = [e for e in read_events(run_dir) if e["phase"] == "data" and e["host"] == "coordinator"]
    ends = [k for k, e in enumerate(root) if e["epoch_ended"] is not None]
    ended = [root[k]["epoch_ended"] for k in ends]
    assert ended in (list(WHOLE), [*WHOLE, 2])  # the third may end too, when the first final delta is at its end
    for epoch, (start, end) in enumerate(zip([-1, *ends], ends)):  # each epoch committed whole, once
        assert sum(e["published_samples"] for e in root[start + 1: end + 1]) == SAMPLES
        assert all(e["epoch"] == epoch for e in root[start + 1: end])

    for k, hosts in enumerate((("0", "1"), ("2", "3"))):  # each site's ledger: what its hosts trained, committed
        site = [e for e in read_events(run_dir / "sites" / f"site{k}") if e["phase"] == "data"
                and e["host"] == "coordinator"]
        for epoch in WHOLE:
            mine = sum(1 for h in hosts for e, _ in trained[h] if e == epoch)
            assert 0 < mine < SAMPLES  # both sites took part
            assert sum(e["published_samples"] for e in site if e["epoch"] == epoch) == mine


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_through_relays_over_http_bad_data_is_refused_naming_both_and_a_killed_relays_units_go_back(
        tmp_path: Path) -> None:
    """A root and two relays (processes); hosts driven with the real client (test_ledger_wiring's ``Host``): a
    relay whose first host declares another dataset is refused upstream naming both, and its next host (the run's
    data) joins; the two sites' hosts, one unit a round each, commit the epoch's every index once; relay B killed
    -9 holding a unit is cut off at the root past its lease, and that unit goes to site A."""
    root = Coordinator(tmp_path / "root", 2, "--data-unit", str(UNIT), "--lease", "3")
    relays = {name: Coordinator(tmp_path / name, 1, "--upstream", root.url, command="relay") for name in SITES}
    try:
        a = Host(relays["siteA"].url, "a")
        a.round.join()
        wrong = Host(relays["siteB"].url, "w", DataSpec(LEDGER_SAMPLES + 1, seed=SEED))
        with pytest.raises(Refusal, match=f"dataset has {LEDGER_SAMPLES + 1} samples but the run's has {LEDGER_SAMPLES}"):
            wrong.round.join()
        b = Host(relays["siteB"].url, "b")
        b.round.join()  # the site's data is now the run's: relay B joins the root with it
        step = 0
        while data_status(root.url)["epoch"] == 0 and step < 20:
            exchange([a, b], step)
            step += 1
        assert_every_index_once(a.taken + b.taken)
        assert step == LEDGER_SAMPLES // UNIT // 2  # one unit each a round
        for site, host in (("siteA", a), ("siteB", b)):  # each site's ledger committed what its host trained
            assert data_status(relays[site].url)["hosts"][host.client.host]["committed"] == LEDGER_SAMPLES // 2

        while not isinstance(b.lease(), Lease):  # the epoch's end first, then a unit of epoch 1
            pass
        held = b.held.spans[0]
        os.kill(relays["siteB"].pid, signal.SIGKILL)  # relay B dies holding it
        wait_for(lambda: not data_status(root.url)["hosts"]["siteB"]["present"], 60, "the root to cut relay B off")
        assert data_status(root.url)["hosts"]["siteB"]["returned"] == len(held)
        while not isinstance(a.lease(), Lease):
            pass
        assert a.held.spans[0] == held  # given back at the root, leased again through relay A
    finally:
        for c in (*relays.values(), root):
            c.stop()
