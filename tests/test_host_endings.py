"""A host's fit ends with its run: a fit after the run completed fails at once saying so (and the next run goes on
from the weights held), and a coordinator that stops before the run completed makes the host fail, naming where
the run stood, with a non-zero exit."""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from helpers import forked
from lightning.pytorch import LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_nodeox import NodeoxStrategy
from lightning_nodeox.core.hashing import model_hash
from lightning_nodeox.host.ending import RunCompleted, RunNotCompleted, run_completed
from lightning_nodeox.host.tensors import shared_tensors


class Tiny(LightningModule):
    def __init__(self, step_seconds: float = 0.0) -> None:
        super().__init__()
        self.net = nn.Linear(4, 1)
        self.step_seconds = step_seconds

    def training_step(self, batch, batch_idx):
        time.sleep(self.step_seconds)
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def loader() -> DataLoader:
    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)


def fit(url: str, model: Tiny, tmp_path, max_steps: int = 4) -> Trainer:
    trainer = trainer_for(url, tmp_path, max_steps)
    trainer.fit(model, loader())
    return trainer


def trainer_for(url: str | None, tmp_path, max_steps: int) -> Trainer:
    return Trainer(strategy=NodeoxStrategy(coordinator_url=url, host_id="h", local_steps=2), max_steps=max_steps,
                   logger=False, enable_progress_bar=False, enable_checkpointing=False, default_root_dir=tmp_path)


@pytest.mark.slow
def test_a_second_fit_after_the_run_completed_fails_at_once_saying_so_and_how_to_start_the_next(
        coordinator, tmp_path, caplog) -> None:
    coord = coordinator(1)
    model = Tiny()
    first = fit(coord.url, model, tmp_path)
    assert coord.wait(30) == 0  # the run completed, and its coordinator exited
    final = model_hash(shared_tensors(model))
    assert first.strategy.model_hash == final
    last_round = max(e["round"] for e in coord.events() if e["phase"] == "sync_prepare")
    assert last_round == 1  # 4 steps, rounds of 2

    for again in (lambda: first.fit(model, loader()), lambda: fit(coord.url, model, tmp_path, max_steps=8)):
        start = time.monotonic()  # the same Trainer again, or a new one: at once, not after retry_for (60 s)
        with pytest.raises(RunCompleted) as raised:
            again()
        assert time.monotonic() - start < 5
        message = str(raised.value)
        assert f"the run at {coord.url} has completed (after round {last_round}, model hash {final})" in message
        assert "a new coordinator on a fresh run directory" in message and "nodeox launch" in message
        assert "Trainer(strategy=NodeoxStrategy(...))" in message
    assert model_hash(shared_tensors(model)) == final  # the failed fits changed nothing

    # the next run, as the message says: a new coordinator (here on the same address), a new Trainer
    port = coord.url.rsplit(":", 1)[1]
    nxt = coordinator(1, "--bind", f"127.0.0.1:{port}")
    assert nxt.url == coord.url
    with caplog.at_level(logging.INFO, logger="lightning_nodeox.host.round"):
        second = fit(nxt.url, model, tmp_path, max_steps=4)
    assert f"provided the initial model {final}" in caplog.text  # it goes on from the weights this host held
    assert nxt.wait(30) == 0 and second.strategy.model_hash == model_hash(shared_tensors(model)) != final


HOST = '''
import os, sys, torch
sys.path.insert(0, {tests!r})
from test_host_endings import Tiny, loader
from lightning.pytorch import Trainer
from lightning_nodeox import NodeoxStrategy
torch.set_num_threads(1)
trainer = Trainer(strategy=NodeoxStrategy(local_steps=2, retry_for=1.5), max_steps=100_000, logger=False,
                  enable_progress_bar=False, enable_checkpointing=False, default_root_dir=sys.argv[1])
trainer.fit(Tiny(step_seconds=0.02), loader())
print("fit returned at step", trainer.global_step, flush=True)
'''


SECOND_FIT = '''
import sys, torch
sys.path.insert(0, {tests!r})
from test_host_endings import Tiny, trainer_for, loader
torch.set_num_threads(1)
model = Tiny()
trainer_for(None, sys.argv[1], 4).fit(model, loader())
print("the first fit returned", flush=True)
trainer_for(None, sys.argv[1], 8).fit(model, loader())
print("the second fit returned", flush=True)
'''


@pytest.mark.slow
def test_a_second_fit_in_a_host_process_ends_it_with_the_message_alone_and_exit_status_1(coordinator,
                                                                                         tmp_path) -> None:
    coord = coordinator(1)
    script = tmp_path / "host.py"
    script.write_text(SECOND_FIT.format(tests=os.path.dirname(__file__)))
    host = subprocess.run(forked([sys.executable, str(script), str(tmp_path)]), capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, NODEOX_COORDINATOR_URL=coord.url, NODEOX_HOST_ID="h",
                                                PYTHONUNBUFFERED="1"))
    final = [e for e in coord.events() if e["phase"] == "sync_prepare"][-1]
    assert host.returncode == 1, host.stderr[-3000:]
    assert host.stdout.splitlines()[-1] == "the first fit returned"
    assert "Traceback" not in host.stderr and "Error" not in host.stderr
    assert host.stderr.splitlines()[-1] == str(run_completed(coord.url, final["round"], final["model_hash"]))


@pytest.mark.slow
@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "gone"])
def test_a_host_whose_coordinator_stops_before_the_run_completed_exits_non_zero_saying_where_the_run_stood(
        coordinator, tmp_path, stop) -> None:
    coord = coordinator(1)
    script = tmp_path / "host.py"
    script.write_text(HOST.format(tests=os.path.dirname(__file__)))
    host = subprocess.Popen(forked([sys.executable, str(script), str(tmp_path)]), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, NODEOX_COORDINATOR_URL=coord.url, NODEOX_HOST_ID="h",
                                     PYTHONUNBUFFERED="1"))
    try:
        deadline = time.monotonic() + 90
        while len([e for e in coord.events() if e["phase"] == "sync_prepare"]) < 4:
            assert host.poll() is None and time.monotonic() < deadline, "the run did not get going"
            time.sleep(0.2)
        coord.proc.send_signal(stop)
        assert coord.wait(30) != 0  # the coordinator stopped before the run completed
        out, _ = host.communicate(timeout=90)
    finally:
        if host.poll() is None:
            host.kill()
            host.wait()
    published = max(e["round"] for e in coord.events() if e["phase"] == "sync_prepare")
    assert host.returncode != 0, out[-3000:]
    assert "fit returned" not in out
    found = re.search(rf"{RunNotCompleted.__name__}: host h: the run did not complete: its coordinator at "
                      rf"{re.escape(coord.url)} stopped answering in round (\d+), after (\d+) training steps", out)
    assert found, out[-3000:]
    round_, steps = int(found.group(1)), int(found.group(2))
    # rounds of 2 steps: the host notices at its exchange (the round's steps all taken) or, the data ledger's lease
    # being asked from the training loop, within the round (a busy machine's host can be there when it stops)
    assert published <= round_ <= published + 1 and 2 * round_ <= steps <= 2 * (round_ + 1)
    assert "Start the coordinator again on the same run directory" in out


@pytest.mark.slow
def test_a_fit_against_a_completed_run_whose_coordinator_still_serves_fails_at_once_saying_so(coordinator,
                                                                                              tmp_path) -> None:
    coord = coordinator(1, "--keep-running")
    model = Tiny()
    fit(coord.url, model, tmp_path)
    final = model_hash(shared_tensors(model))
    start = time.monotonic()
    with pytest.raises(RunCompleted, match=re.escape(f"has completed (after round 1, model hash {final})")):
        fit(coord.url, Tiny(), tmp_path)  # the coordinator answers: its join says the run is complete
    assert time.monotonic() - start < 5
    assert coord.proc.poll() is None


def test_a_lease_the_coordinator_never_answers_ends_the_fit_saying_where_the_run_stood() -> None:
    """The data ledger's lease is asked from the training thread (the sampler), not the exchange: a coordinator
    gone there ends the fit as it does mid-exchange (CI once saw the bare Unreachable escape this way)."""
    from types import SimpleNamespace

    from lightning_nodeox.core.protocol import Unreachable
    from lightning_nodeox.host.link import RunLink
    from lightning_nodeox.host.settings import Connection

    def lease(epoch, units):
        raise Unreachable("coordinator at http://127.0.0.1:9 did not answer POST /v1/data/lease after 4 tries")

    link = object.__new__(RunLink)  # only what the lease touches: the round and where the host stood
    link.connection = Connection(coordinator_url="http://127.0.0.1:9", host_id="h")
    link.round = SimpleNamespace(lease=lease, round=3, model_hash="abc", complete=False)
    link.steps = 8
    with pytest.raises(RunNotCompleted, match=r"host h: the run did not complete: its coordinator at "
                                              r"http://127.0.0.1:9 stopped answering in round 3, after 8 training "
                                              r"steps .*abc.*POST /v1/data/lease"):
        link.lease(0, 1)
