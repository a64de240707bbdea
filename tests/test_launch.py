"""`nodeox launch`: one prefixed line per line a host writes (a progress bar shown as it ends), exit statuses named,
and the coordinator's options forwarded as given; with ``--sites`` the hosts spread over relays under the root."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from collections import Counter

import pytest
from helpers import DIGITS, launch, published, read_events, received
from helpers import assert_identical as assert_hosts_identical

from lightning_nodeox.tools.console import Console
from lightning_nodeox.tools.supervision import exit_status
from lightning_nodeox.tools.topology import spread


def streamed(data: bytes) -> list[str]:
    out = io.StringIO()
    Console(out).follow("[host 0]", io.BufferedReader(io.BytesIO(data)))
    return out.getvalue().splitlines()


def test_a_progress_bar_shows_its_last_state_not_every_refresh() -> None:
    bar = b"".join(b"\rEpoch 0: %3d%%|" % p for p in range(0, 101, 5))
    tqdm_write = b"\r" + b" " * 20 + b"\rnodeox: host 0 round 1, step 20\n"  # tqdm.write clears the bar first
    lines = streamed(b"GPU available: False\n" + bar + tqdm_write + bar + b"\n" + b"done\r\n" + b"tail")
    assert lines == ["[host 0] GPU available: False", "[host 0] nodeox: host 0 round 1, step 20",
                     "[host 0] Epoch 0: 100%|", "[host 0] done", "[host 0] tail"]


def test_blank_lines_and_broken_utf8_pass_through() -> None:
    assert streamed(b"a\n\nb \xff\xfe\n") == ["[host 0] a", "[host 0] ", "[host 0] b \ufffd\ufffd"]


def test_exit_status_names_the_signal() -> None:
    assert exit_status(143) == "exit status 143 (SIGTERM)"
    assert exit_status(-9) == "exit status -9 (SIGKILL)"
    assert exit_status(1) == "exit status 1"


def test_launch_forwards_coordinator_options_as_given_and_shares_their_defaults(monkeypatch, tmp_path) -> None:
    from lightning_nodeox.coordinator.config import CoordinatorConfig, OuterSettings
    from lightning_nodeox.tools import launch as launch_module
    from lightning_nodeox.tools.cli import _config, _parser, main

    started = {}
    monkeypatch.setattr(launch_module, "launch", lambda config, argv, command, gpus, **_: started.update(
        config=config, argv=argv, command=command, gpus=gpus) or 0)
    given = ["--hosts", "2", "--run-dir", str(tmp_path), "--outer-lr", "0.5"]
    assert main(["launch", *given, "--gpus-per-host", "2", "--min-hosts", "1", "--", "python", "train.py"]) == 0
    assert started["argv"] == ["--bind", "127.0.0.1:0", *given, "--min-hosts", "1"]  # launch's own bind, then as given
    assert (started["command"], started["gpus"]) == (["python", "train.py"], 2)
    coordinator = _config(_parser().parse_args(["coordinator", *started["argv"]]))
    assert coordinator == started["config"]  # what launch checked is what its coordinator runs
    assert coordinator == CoordinatorConfig(hosts=2, run_dir=tmp_path, bind="127.0.0.1:0", min_hosts=1,
                                            outer=OuterSettings(lr=0.5))  # every other setting at its default
    alone = _config(_parser().parse_args(["coordinator", "--hosts", "2", "--run-dir", str(tmp_path)]))
    assert alone == CoordinatorConfig(hosts=2, run_dir=tmp_path)
    main(["launch", *given, "--bind", "127.0.0.1:9", "--", "python"])
    assert started["argv"][-2:] == ["--bind", "127.0.0.1:9"] and started["config"].bind == "127.0.0.1:9"


def test_hosts_spread_over_sites_in_blocks_as_even_as_possible_and_bad_site_counts_are_refused() -> None:
    assert spread(4, 2) == [[0, 1], [2, 3]]
    assert spread(7, 3) == [[0, 1, 2], [3, 4], [5, 6]]
    assert spread(3, 3) == [[0], [1], [2]] and spread(5, 1) == [[0, 1, 2, 3, 4]]
    with pytest.raises(ValueError, match="give at most --sites 2"):
        spread(2, 3)
    with pytest.raises(ValueError, match="at least 1"):
        spread(2, 0)


def test_launch_with_sites_gives_each_relay_the_serving_flags_and_the_token_and_refuses_what_the_root_cannot_take(
        monkeypatch, tmp_path, capsys) -> None:
    from lightning_nodeox.tools import launch as launch_module
    from lightning_nodeox.tools.cli import main

    started = {}
    monkeypatch.setattr(launch_module, "launch", lambda config, argv, command, gpus, **kw: started.update(kw) or 0)
    (tmp_path / "t").write_text("secret")
    given = ["--hosts", "4", "--run-dir", str(tmp_path), "--lease", "3", "--outer-lr", "0.5", "--fresh",
             "--token-file", str(tmp_path / "t"), "--min-hosts", "2", "--sites", "2"]
    assert main(["launch", *given, "--", "python"]) == 0
    assert started == {"sites": 2, "relay_args": ["--lease", "3.0", "--fresh", "--token-file", str(tmp_path / "t"),
                                                  "--upstream-token-file", str(tmp_path / "t")]}
    for bad, said in ((["--sites", "5"], "--sites 5 is more than --hosts 4"), (["--sites", "0"], "at least 1"),
                      (["--sites", "2", "--min-hosts", "3"], "the coordinator's hosts are its 2 relays")):
        with pytest.raises(SystemExit, match=said):
            main(["launch", "--hosts", "4", "--run-dir", str(tmp_path), *bad, "--", "python"])


@pytest.mark.slow
def test_launch_with_two_sites_runs_a_root_two_relays_and_four_hosts_that_end_on_the_roots_model(tmp_path) -> None:
    """`nodeox launch --hosts 4 --sites 2`: hosts 0, 1 behind relay site0, hosts 2, 3 behind site1; every host ends
    on the root's final model, the root takes 2 deltas a round, and the report groups the hosts by site with the
    far-link bytes those of the 2 relays' messages."""
    run_dir, out = tmp_path / "run", tmp_path / "out"
    result = launch(run_dir, 4, [*DIGITS, "--out", str(out), "--max-steps", "20"], "--sites", "2", timeout=180)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    synced = published(run_dir)
    assert sorted(synced) == [0, 1]
    assert assert_hosts_identical(out, ["0", "1", "2", "3"]) == synced[1]["model_hash"]
    taken = received(run_dir)
    assert Counter((e["round"], e["from_host"]) for e in taken) == {(r, s): 1 for r in (0, 1) for s in ("site0", "site1")}
    assert "[site 1 host 2]" in result.stdout and "[relay 1]" in result.stdout
    for k, hosts in enumerate((["0", "1"], ["2", "3"])):  # each relay its own run directory, its own hosts
        relayed = read_events(run_dir / "sites" / f"site{k}")
        assert {e["from_host"] for e in relayed if e["phase"] == "receive" and e["host"] == "coordinator"} == set(hosts)

    report = json.loads(subprocess.run([sys.executable, "-m", "lightning_nodeox", "report", str(run_dir), "--json"],
                                       capture_output=True, text=True, check=True, timeout=60).stdout)
    events = read_events(run_dir)
    for rnd in report["rounds"]:
        r = rnd["round"]
        assert rnd["hosts"] == ["site0", "site1"]
        assert {name: site["hosts"] for name, site in rnd["sites"].items()} == {"site0": ["0", "1"],
                                                                                  "site1": ["2", "3"]}
        assert rnd["far_bytes"]["up"] == sum(e["bytes"] for e in taken if e["round"] == r)  # 2 relays' messages
        assert rnd["far_bytes"]["down"] == sum(e["bytes"] for e in events if e["round"] == r and e["host"] in
                                               ("site0", "site1") and e["phase"] in ("download", "fallback_fetch"))
        assert rnd["site_bytes"]["up"] == sum(e["bytes"] for e in events if e["round"] == r and
                                              e["phase"] == "upload" and e["host"].count("/") == 1)
        assert rnd["far_bytes"]["up"] < rnd["site_bytes"]["up"]  # 2 messages across the far links against 4
    token = (run_dir / "token").read_text()
    assert (run_dir / "token").stat().st_mode & 0o777 == 0o600 and len(token) >= 40  # made by launch, its own
    assert "status page: http://127.0.0.1:" in result.stdout and f"/?token={token}" in result.stdout
    assert "nodeox launch: done, the run completed; run directory" in result.stdout
    ended = subprocess.run([sys.executable, "-m", "lightning_nodeox", "status", str(run_dir)], capture_output=True,
                           text=True, timeout=60)
    assert (ended.returncode, ended.stdout) == (0, f"{run_dir}: run complete after 2 rounds, model "
                                                   f"{synced[1]['model_hash']} (the coordinator has exited; nodeox "
                                                   f"report {run_dir} for its figures)\n"), ended.stderr
