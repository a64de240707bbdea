"""The coordinator process over real HTTP: joining, bad input refused with 4xx, rounds never poisoned."""

from __future__ import annotations

import time

import pytest
import requests
import torch

from lightning_nodeox.core.protocol import Reason, Refusal, SyncReady, Unreachable, Upload, read_fully
from lightning_nodeox.host.client import HttpClient
from lightning_nodeox.core.codec import Q4Settings, accumulate_tensor, apply_sync, encode_sync_and_apply, encode_tensor
from lightning_nodeox.core.hashing import model_hash
from lightning_nodeox.core.modelfile import model_header, read_model
from lightning_nodeox.core.specs import spec_of
from lightning_nodeox.core.wire import Q4Layout, Q4Message, Q4Meta
from reference_q4 import kernels

MODEL = [("fc.weight", torch.randn(40, 30, generator=torch.Generator().manual_seed(0))),
         ("fc.bias", torch.randn(40, generator=torch.Generator().manual_seed(1))),
         ("bn.running_mean", torch.zeros(40))]
SPECS = spec_of(MODEL)
SETTINGS = Q4Settings()


def model_file(named=MODEL) -> bytes:
    body = bytearray(model_header(spec_of(named), 0, ""))
    for _, t in named:
        body += t.numpy().tobytes()
    return bytes(body)


def delta_message(deltas: list[torch.Tensor], *, round_: int, host: str, base_hash: str, samples: int,
                  specs=SPECS) -> Q4Message:
    message = Q4Message.allocate(Q4Layout.of(specs, SETTINGS))
    k = kernels(SETTINGS)
    for i, d in enumerate(deltas):
        encode_tensor(k, d.reshape(-1), message.codes(i), message.scales(i))
    message.write_header(Q4Meta("delta", round_, host, base_hash, samples=samples))
    return message


def test_unreachable_coordinator_fails_fast_with_its_url() -> None:
    with socket_closed_port() as port:
        url = f"http://127.0.0.1:{port}"
        client = HttpClient(url, host="0", retry_for=1.5)
        start = time.monotonic()
        with pytest.raises(Unreachable, match=f"coordinator at {url} did not answer"):
            client.join([])
        assert time.monotonic() - start < 10


def test_round_refuses_bad_deltas_and_stays_unpoisoned(coordinator) -> None:
    coord = coordinator(2)
    a = HttpClient(coord.url, host="a", retry_for=5)
    b = HttpClient(coord.url, host="b", retry_for=5)
    reply = a.join([s.as_json() for s in SPECS])
    assert reply.provide_model and reply.block_size == 64
    initial_hash = a.put_model(memoryview(model_file()))
    assert initial_hash == model_hash(MODEL)
    assert b.join([s.as_json() for s in SPECS]).model_hash == initial_hash

    gen = torch.Generator().manual_seed(2)
    good_a = [torch.randn(t.shape, generator=gen) * 0.01 for _, t in MODEL]
    good_b = [torch.randn(t.shape, generator=gen) * 0.01 for _, t in MODEL]

    def refused(reason: Reason, pattern: str, body, host=b, round_=0) -> None:
        with pytest.raises(Refusal) as e:
            host.post_delta(round_, body)
        assert e.value.reason is reason, e.value
        assert pattern in str(e.value), e.value

    valid_b = bytes(delta_message(good_b, round_=0, host="b", base_hash=initial_hash, samples=10).view())
    assert b.post_delta(5, valid_b) is Upload.STALE_BASE  # a round that is not open
    refused(Reason.INVALID, "bytes but this model's q4 delta is", valid_b[:-16])
    flipped = bytearray(valid_b)
    flipped[-3] ^= 0x40
    refused(Reason.INVALID, "integrity check", bytes(flipped))
    transposed = [("fc.weight", torch.zeros(30, 40)), *MODEL[1:]]
    wrong_shape = delta_message([torch.zeros(30, 40), *good_b[1:]], round_=0, host="b", base_hash=initial_hash,
                                samples=10, specs=spec_of(transposed))
    refused(Reason.INVALID, "does not match the model's", bytes(wrong_shape.view()))
    stale = delta_message(good_b, round_=0, host="b", base_hash="00" * 16, samples=10)
    assert b.post_delta(0, bytes(stale.view())) is Upload.STALE_BASE
    poison = delta_message([torch.full(t.shape, 1e3) for _, t in MODEL], round_=0, host="a", base_hash=initial_hash,
                           samples=10)
    refused(Reason.INVALID, "sent as round 0's delta of host b", bytes(poison.view()))  # host a's payload sent as b's

    # the round goes on with the good deltas only
    valid_a = bytes(delta_message(good_a, round_=0, host="a", base_hash=initial_hash, samples=30).view())
    assert a.post_delta(0, memoryview(valid_a)) is Upload.TAKEN
    assert a.post_delta(0, memoryview(valid_a)) is Upload.TAKEN  # a retry: the coordinator already has it
    assert b.post_delta(0, memoryview(valid_b)) is Upload.TAKEN
    reply = b.wait_sync(0)
    assert isinstance(reply, SyncReady)
    sync = Q4Message.parse(body_bytes(reply.body))
    expected = expected_after_round([t for _, t in MODEL], [(good_a, 30), (good_b, 10)])
    assert sync.meta.model_hash == model_hash(list(zip([n for n, _ in MODEL], expected)))
    local = [t.clone() for _, t in MODEL]
    for i, t in enumerate(local):
        apply_sync(kernels(SETTINGS), sync.codes(i), sync.scales(i), t.clone().view(-1), t.view(-1))
    assert all(torch.equal(x, y) for x, y in zip(local, expected))

    # the full model is served on request and matches
    round_, served_hash, _, tensors = read_model(body_bytes(a.get_model()))
    assert (round_, served_hash) == (1, sync.meta.model_hash)
    assert all(torch.equal(x, y) for x, y in zip(tensors, expected))
    deadline = time.monotonic() + 10  # the record is written once the server has finished sending
    while not any(e["phase"] == "model_materialize" for e in coord.events()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert any(e["phase"] == "model_materialize" and e["for_host"] == "a" for e in coord.events())


def body_bytes(body) -> torch.Tensor:
    buffer = torch.empty(body.size, dtype=torch.uint8)
    read_fully(body, memoryview(buffer.numpy()))
    body.close()
    return buffer


def expected_after_round(model: list[torch.Tensor], contributions) -> list[torch.Tensor]:
    """What the coordinator must publish: q4 of the sample-weighted mean of the dequantized deltas."""
    total = sum(n for _, n in contributions)
    out = []
    for i, t in enumerate(model):
        acc = torch.zeros(t.numel())
        for j, (deltas, samples) in enumerate(contributions):
            k = kernels(SETTINGS)
            message = delta_message(deltas, round_=0, host="x", base_hash="", samples=samples)
            accumulate_tensor(k, message.codes(i), message.scales(i), acc, float(samples), assign=j == 0)
        new = t.clone().view(-1)
        codes, scales = torch.empty_like(message.codes(i)), torch.empty_like(message.scales(i))
        encode_sync_and_apply(kernels(SETTINGS), acc, 1 / total, new, codes, scales)
        out.append(new.view(t.shape))
    return out


def test_token_is_required_when_configured(coordinator, tmp_path) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    coord = coordinator(1, "--token-file", str(token))
    r = requests.post(f"{coord.url}/v1/join", json={"host": "0"}, timeout=10)
    assert r.status_code == 401 and "NODEOX_TOKEN" in r.json()["error"]
    assert requests.get(f"{coord.url}/v1/health", timeout=10).status_code == 200
    client = HttpClient(coord.url, host="0", token="s3cret")
    assert client.join([s.as_json() for s in SPECS]).provide_model


def test_bad_requests_get_json_errors(coordinator) -> None:
    coord = coordinator(1)
    r = requests.post(f"{coord.url}/v1/events", data=b"not json", timeout=10)
    assert r.status_code == 400 and "records" in r.json()["error"]
    r = requests.post(f"{coord.url}/v1/rounds/0/delta?host=0", data=b"x", timeout=10)
    assert r.status_code == 409 and "no model yet" in r.json()["error"]
    r = requests.get(f"{coord.url}/v1/rounds/zero/sync", timeout=10)
    assert r.status_code == 400 and "integer" in r.json()["error"]
    assert "X-Nodeox-Time" in r.headers


class socket_closed_port:
    """A local port with nothing listening on it."""

    def __enter__(self) -> int:
        import socket

        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        self.port = s.getsockname()[1]
        s.close()
        return self.port

    def __exit__(self, *exc) -> None:
        pass


def test_a_host_that_never_returns_does_not_hold_the_end_of_the_run(coordinator) -> None:
    """Host b's lease expires, so round 0 closes without it; once host a has finished, the run is complete."""
    coord = coordinator(2, "--lease", "1")
    a = HttpClient(coord.url, host="a", retry_for=5)
    b = HttpClient(coord.url, host="b", retry_for=5)
    a.join([s.as_json() for s in SPECS])
    h = a.put_model(memoryview(model_file()))
    b.join([s.as_json() for s in SPECS])  # ... and then b is never heard of again
    final = delta_message([torch.zeros(t.shape) for _, t in MODEL], round_=0, host="a", base_hash=h, samples=4)
    final.write_header(Q4Meta("delta", 0, "a", h, samples=4, final=True))
    a.post_delta(0, final.view())
    reply = a.wait_sync(0)
    assert isinstance(reply, SyncReady) and reply.complete
    reply.body.close()
    assert coord.wait(30) == 0  # complete, and nobody is left to serve: a sends no heartbeats either


def test_refused_and_malformed_requests_change_nothing(coordinator) -> None:
    coord = coordinator(2)
    a = HttpClient(coord.url, host="a", retry_for=5)
    a.join([s.as_json() for s in SPECS])
    a.put_model(memoryview(model_file()))
    wrong = [["fc.weight", "float32", [40, 31]], *[s.as_json() for s in SPECS[1:]]]
    r = requests.post(f"{coord.url}/v1/join", json={"host": "x", "tensors": wrong}, timeout=10)
    assert r.status_code == 400 and "does not match" in r.json()["error"]
    r = requests.post(f"{coord.url}/v1/join", json={"host": "y", "tensors": [["w", "int8", [1]]]}, timeout=10)
    assert r.status_code == 400 and "invalid dtype" in r.json()["error"]
    assert set(requests.get(f"{coord.url}/v1/status", timeout=10).json()["hosts"]) == {"a"}
    r = requests.get(f"{coord.url}/v1/rounds/0/sync?wait=nan", timeout=10)
    assert r.status_code == 400 and "seconds" in r.json()["error"]
    r = requests.post(f"{coord.url}/v1/events", json={"records": [
        {"round": 0, "host": "stranger", "phase": "encode", "start": 1.0, "end": 2.0}]}, timeout=10)
    assert r.status_code == 400 and "not joined" in r.json()["error"]
    r = requests.put(f"{coord.url}/v1/model?host=a", data=model_file(), timeout=10)
    assert r.status_code == 409 and "already has a model" in r.json()["error"]
