"""The coordinator process over real HTTP: reaching it, tokens, and the end of a run (bad input: test_bad_input.py)."""

from __future__ import annotations

import time

import pytest
import requests
import torch
from helpers import MODEL, SPECS, body_bytes, delta_message, model_file, socket_closed_port

from lightning_nodeox.core.protocol import SyncReady, Unreachable, Upload, read_fully
from lightning_nodeox.core.wire import Message, MessageMeta
from lightning_nodeox.host.client import HttpClient


def test_unreachable_coordinator_fails_fast_with_its_url() -> None:
    with socket_closed_port() as port:
        url = f"http://127.0.0.1:{port}"
        client = HttpClient(url, host="0", retry_for=1.5)
        start = time.monotonic()
        with pytest.raises(Unreachable, match=f"coordinator at {url} did not answer"):
            client.join([])
        assert time.monotonic() - start < 10


@pytest.mark.slow
def test_token_is_required_when_configured(coordinator, tmp_path) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    coord = coordinator(1, "--token-file", str(token))
    r = requests.post(f"{coord.url}/v1/join", json={"host": "0"}, timeout=10)
    assert r.status_code == 401 and "NODEOX_TOKEN" in r.json()["error"]
    assert requests.get(f"{coord.url}/v1/health", timeout=10).status_code == 200
    client = HttpClient(coord.url, host="0", token="s3cret")
    assert client.join([s.as_json() for s in SPECS]).provide_model


@pytest.mark.slow
def test_a_host_that_never_returns_does_not_hold_the_end_of_the_run(coordinator) -> None:
    """Host b's lease expires, so round 0 closes without it; once host a has finished, the run is complete."""
    coord = coordinator(2, "--lease", "1")
    a = HttpClient(coord.url, host="a", retry_for=5)
    b = HttpClient(coord.url, host="b", retry_for=5)
    a.join([s.as_json() for s in SPECS])
    h = a.put_model(memoryview(model_file()))
    b.join([s.as_json() for s in SPECS])  # ... and then b is never heard of again
    final = delta_message([torch.zeros(t.shape) for _, t in MODEL], round_=0, host="a", base_hash=h, samples=4)
    final.write_header(MessageMeta("delta", 0, "a", h, samples=4, final=True))
    a.post_delta(0, final.view())
    reply = a.wait_sync(0)
    assert isinstance(reply, SyncReady) and reply.complete
    body_bytes(reply.body)  # a has the final sync whole
    assert coord.wait(30) == 0  # complete, and nobody is left to serve: a sends no heartbeats either


@pytest.mark.slow
def test_a_final_delta_completes_the_run_with_its_round_and_later_deltas_are_late(coordinator) -> None:
    """Stopping together: host a's training ended (final delta) while host b trains on; the round they share is
    the run's last one, its sync says so and carries their sync_dist values reduced; b's next delta is late."""
    coord = coordinator(2)
    a = HttpClient(coord.url, host="a", retry_for=5)
    b = HttpClient(coord.url, host="b", retry_for=5)
    a.join([s.as_json() for s in SPECS])
    h = a.put_model(memoryview(model_file()))
    b.join([s.as_json() for s in SPECS])
    zeros = [torch.zeros(t.shape) for _, t in MODEL]
    for host, client, samples, final, value in (("a", a, 10, True, 1.0), ("b", b, 30, False, 3.0)):
        message = delta_message(zeros, round_=0, host=host, base_hash=h, samples=samples)
        message.write_header(MessageMeta("delta", 0, host, h, samples=samples, final=final,
                                    metrics={"val_loss": [value, "mean"], "seen": [samples, "sum"]}))
        assert client.post_delta(0, message.view()) is Upload.TAKEN
    reply = b.wait_sync(0)
    assert isinstance(reply, SyncReady) and reply.complete
    buf = bytearray(reply.body.size)
    read_fully(reply.body, memoryview(buf))
    reply.body.close()
    assert Message.parse(buf).meta.metrics == {"val_loss": [2.5, "mean"], "seen": [40.0, "sum"]}
    later = delta_message(zeros, round_=1, host="b", base_hash=h, samples=30)
    assert b.post_delta(1, later.view()) is Upload.LATE


def test_sync_dist_values_reduce_by_samples_and_by_their_reduction() -> None:
    from lightning_nodeox.coordinator.metrics import reduce_metrics

    reduced = reduce_metrics([(1, {"loss": [1.0, "mean"], "top": [5.0, "max"]}),
                              (3, {"loss": [3.0, "mean"], "top": [2.0, "max"], "n": [4.0, "sum"]})])
    assert reduced == {"loss": [2.5, "mean"], "top": [5.0, "max"], "n": [4.0, "sum"]}
    assert reduce_metrics([(0, {"loss": [1.0, "mean"]}), (0, {"loss": [2.0, "mean"]})]) == {"loss": [1.5, "mean"]}
