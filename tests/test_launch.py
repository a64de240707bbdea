"""`nodeox launch`: one prefixed line per line a host writes (a progress bar shown as it ends), exit statuses named,
and the coordinator's options forwarded as given."""

from __future__ import annotations

import io

from lightning_nodeox.tools.console import Console
from lightning_nodeox.tools.launch import _exit_status


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
    assert _exit_status(143) == "exit status 143 (SIGTERM)"
    assert _exit_status(-9) == "exit status -9 (SIGKILL)"
    assert _exit_status(1) == "exit status 1"


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
