"""No object of a finished round outlives it: the coordinator's round state machine, in this process, with the
garbage collector off (so only reference counting frees anything: a reference cycle would keep a round alive)."""

from __future__ import annotations

import asyncio
import gc
import time
import weakref

import torch
from helpers import MODEL, SPECS, delta_message, model_file
from local_transport import MemoryBody

from lightning_nodeox.coordinator.config import CoordinatorConfig
from lightning_nodeox.coordinator.lifecycle import CoordinatorRun
from lightning_nodeox.coordinator.service import CoordinatorService
from lightning_nodeox.coordinator.runlog import RunLog
from lightning_nodeox.coordinator.state import RunStore
from lightning_nodeox.core.pool import WorkerPool
from lightning_nodeox.core.wire import Message

ROUNDS = 4


def messages() -> list[Message]:
    return [o for o in gc.get_objects() if isinstance(o, Message)]


def live_messages(before: list[Message]) -> int:
    """Messages alive now that were not before the scenario (``before`` holds those, so their ids stay theirs:
    an earlier test in this process may keep some alive)."""
    old = {id(m) for m in before}
    return sum(id(m) not in old for m in messages())


async def scenario(tmp_path, monkeypatch) -> list[int]:
    before = messages()
    config = CoordinatorConfig(hosts=2, run_dir=tmp_path, threads=1)
    pool = WorkerPool(config.codec, "cpu", 1)
    runlog = RunLog(tmp_path)
    run = CoordinatorRun(config, runlog, pool, RunStore(tmp_path))
    state, service = run.state, CoordinatorService(run)
    parsed: list[tuple[int, weakref.ref]] = []
    read_head = Message.read_head

    def read_and_watch(*args, **kwargs):
        message = read_head(*args, **kwargs)
        parsed.append((message.meta.round, weakref.ref(message)))
        return message

    monkeypatch.setattr(Message, "read_head", staticmethod(read_and_watch))
    await run.load_initial_model(torch.frombuffer(bytearray(model_file()), dtype=torch.uint8))
    for host in "ab":
        credential = (await service.join(host, SPECS)).credential
        assert service.authenticate(host, credential) == host
    buffers: list[tuple[int, weakref.ref]] = []
    counts = []
    gen = torch.Generator().manual_seed(0)
    for r in range(ROUNDS):
        for host in "ab":
            deltas = [torch.randn(t.shape, generator=gen) * 0.01 for _, t in MODEL]
            message = delta_message(deltas, round_=r, host=host, base_hash=state.model.hash, samples=8)
            body = MemoryBody(bytearray(message.view()))
            del message
            await service.receive_delta(host, r, body)
            buffers.append((r, weakref.ref(body)))
            del body
        deadline = time.monotonic() + 30
        while state.round != r + 1:  # the round closes on its own once both deltas are accumulated
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        await (run.save_at_shutdown() if r == ROUNDS - 1 else run.recovery.saved())
        # round r + 1 has started: nothing of round r's deltas is alive
        assert [rr for rr, ref in buffers if ref() is not None] == []
        assert [rr for rr, ref in parsed if ref() is not None and rr <= r] == []
        counts.append(live_messages(before))
    run.close()
    pool.close()
    runlog.close()
    return counts


def test_no_payload_or_buffer_of_a_finished_round_outlives_it(tmp_path, monkeypatch) -> None:
    gc.collect()
    gc.disable()
    try:
        counts = asyncio.run(scenario(tmp_path, monkeypatch))
    finally:
        gc.enable()
    # what stays is the two sync messages, reused round after round (the latest, and the spare it replaces)
    assert counts[1:] == [2] * (ROUNDS - 1), counts
