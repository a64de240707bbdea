"""Who a host is: valid ids, one live process per id, a credential per host, and at most --hosts ids."""

from __future__ import annotations

import asyncio
import os
import re

import pytest
from helpers import SPECS, TwoOptimizers, data, model_file
from lightning.pytorch import Trainer

from lightning_nodeox import NodeoxStrategy
from lightning_nodeox.coordinator.config import CoordinatorConfig
from lightning_nodeox.coordinator.lifecycle import CoordinatorRun
from lightning_nodeox.coordinator.runlog import RunLog
from lightning_nodeox.core.pool import WorkerPool
from lightning_nodeox.core.protocol import Reason, Refusal
from lightning_nodeox.core.codecs.settings import Q4Settings
from lightning_nodeox.host.client import HttpClient
from lightning_nodeox.host.settings import Connection, ConnectionSettings

TENSORS = [s.as_json() for s in SPECS]


@pytest.mark.parametrize("host_id", ["a/b", "a+b", "a#b", "a&b", "", "x" * 65, "..", "coordinator", "é"])
def test_host_ids_outside_the_rule_are_refused_by_the_host(host_id) -> None:
    with pytest.raises(ValueError, match=re.escape("A-Z a-z 0-9 _ . -")):
        Connection(coordinator_url="http://127.0.0.1:1", host_id=host_id)


def test_the_default_host_id_is_the_machine_and_the_local_rank_or_the_process(monkeypatch) -> None:
    monkeypatch.setenv("NODEOX_COORDINATOR_URL", "http://127.0.0.1:1")
    monkeypatch.delenv("NODEOX_HOST_ID", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    by_pid = ConnectionSettings().resolve().host_id
    assert by_pid.endswith(f"-{os.getpid()}") and re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", by_pid)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert ConnectionSettings().resolve().host_id == by_pid.removesuffix(str(os.getpid())) + "3"
    assert ConnectionSettings(host_id="gpu-7").resolve().host_id == "gpu-7"


@pytest.mark.slow
def test_a_second_process_with_a_live_id_is_refused_and_a_restarted_one_gets_back_in(coordinator, tmp_path) -> None:
    coord = coordinator(2)
    first = HttpClient(coord.url, host="a", retry_for=5)
    assert first.join(TENSORS).provide_model
    first.put_model(memoryview(model_file()))
    trainer = Trainer(strategy=NodeoxStrategy(coordinator_url=coord.url, host_id="a", retry_for=5), max_steps=2,
                      logger=False, default_root_dir=tmp_path, enable_progress_bar=False)
    with pytest.raises(Refusal, match="host id a is in use by another live process") as refused:
        trainer.fit(TwoOptimizers(), data())
    assert refused.value.reason is Reason.ID_IN_USE
    assert first.join(TENSORS).credential  # the live process itself may join again: it presents its credential
    first.leave()
    restarted = HttpClient(coord.url, host="a", retry_for=5)
    assert restarted.join(TENSORS).model_hash  # the id is free once its holder left
    with pytest.raises(Refusal, match="credential for host a") as stale:
        first.get_model()  # the old credential no longer acts for host a
    assert stale.value.reason is Reason.FORBIDDEN
    restarted.get_model().close()


@pytest.mark.parametrize("elastic", [False, True])
def test_joins_beyond_hosts_need_elastic(tmp_path, elastic) -> None:
    async def joins() -> list:
        config = CoordinatorConfig(hosts=1, run_dir=tmp_path, elastic=elastic, long_poll=0.05)
        pool = WorkerPool(Q4Settings(), "cpu", 1)
        runlog = RunLog(tmp_path)
        run = CoordinatorRun(config, runlog, pool)
        try:
            out = [await run.membership.join("a", SPECS)]
            try:
                out.append(await run.membership.join("b", SPECS))
            except Refusal as e:
                out.append(e)
            return out
        finally:
            run.close()
            pool.close()
            runlog.close()

    first, second = asyncio.run(joins())
    assert first.provide_model
    if elastic:
        assert second.retry  # admitted: waits for host a's model like any host
    else:
        assert isinstance(second, Refusal) and second.reason is Reason.FULL and "--elastic" in str(second)
