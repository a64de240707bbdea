"""The guards of a round's path, each with a test of its own: a refusal (or a host's check of a reply) that is
deleted makes its test fail. Each test asserts the refusal's reason and status, and that the round's result is
the one without the bad request: the published model hash, the deltas taken, the host's round and model.

Refusals already tested elsewhere (the table of tests/test_bad_input.py, tests/test_identity.py,
tests/test_coordinator.py, tests/test_round_rules.py) are not repeated here. The coordinator is reached over
HTTP (a real ``nodeox coordinator`` process) or, where a setting has no flag or a reply is tampered with, through
the in-process transport (tests/local_transport.py)."""

from __future__ import annotations

import io
import json
import shutil
import signal
import socket
import time
from dataclasses import dataclass, replace

import pytest
import requests
import torch
from helpers import (
    MODEL,
    SETTINGS,
    Coordinator,
    assert_on_the_run_model,
    body_bytes,
    expected_after_round,
    join,
    model,
    model_file,
    raw_request,
    recorded,
    train,
)
from helpers import encoded as encoded_message
from local_transport import BytesBody, LocalClient, LocalCoordinator

from lightning_nodeox.coordinator.server import SHUTDOWN_GRACE
from lightning_nodeox.core.hashing import model_hash
from lightning_nodeox.core.modelfile import model_header, read_model
from lightning_nodeox.core.phases import PhaseLog
from lightning_nodeox.core.protocol import CREDENTIAL_HEADER, OCTETS, Reason, Refusal, SyncReady, Upload
from lightning_nodeox.core.settings import CodecSettings
from lightning_nodeox.core.specs import spec_of
from lightning_nodeox.core.wire import MessageLayout, Message, MessageMeta
from lightning_nodeox.host.client import HttpClient
from lightning_nodeox.host.round import HostRound
from lightning_nodeox.host.tensors import HostTensors

pytestmark = pytest.mark.usefixtures("keep_records")  # every PhaseLog keeps its records

_gen = torch.Generator().manual_seed(15)
GOOD_A = [torch.randn(t.shape, generator=_gen) * 0.01 for _, t in MODEL]
GOOD_B = [torch.randn(t.shape, generator=_gen) * 0.01 for _, t in MODEL]
GOOD_C = [torch.randn(t.shape, generator=_gen) * 0.01 for _, t in MODEL]
BAD = [torch.randn(t.shape, generator=_gen) for _, t in MODEL]  # what a refused delta would have added
OTHER_MODEL = [(n, t + 1) for n, t in MODEL]


def encoded(named, values, meta: MessageMeta, settings: CodecSettings = SETTINGS) -> bytes:
    """A delta of ``values`` for the model ``named``, in ``settings``' codec, with ``meta``'s header."""
    message = encoded_message(values, spec_of(named), settings)
    message.write_header(meta)
    return bytes(message.view())


def refusal(r: requests.Response) -> tuple[int, dict]:
    """A response's status and JSON error ({} when it has none: then it was no refusal)."""
    try:
        return r.status_code, r.json()
    except ValueError:
        return r.status_code, {}


def hash_after(named, contributions) -> str:
    """The hash of round 0's model, given the deltas taken (values, samples), in order."""
    after = expected_after_round([t for _, t in named], contributions)
    return model_hash([(n, t) for (n, _), t in zip(named, after)])


@dataclass
class Run:
    """A coordinator process and its joined hosts (the first provided ``named``), spoken to over HTTP."""

    coord: Coordinator
    clients: dict[str, HttpClient]
    credentials: dict[str, str]
    initial: str
    named: list
    settings: CodecSettings = SETTINGS

    @property
    def url(self) -> str:
        return self.coord.url

    def delta(self, values, host: str, *, round_: int = 0, samples: int = 10, base: str | None = None,
              **meta) -> bytes:
        return encoded(self.named, values, MessageMeta("delta", round_, host, base or self.initial, samples=samples,
                                                  **meta), self.settings)

    def send(self, host: str, values, samples: int, round_: int = 0) -> None:
        """A good delta, taken."""
        message = self.delta(values, host, round_=round_, samples=samples)
        assert self.clients[host].post_delta(round_, memoryview(message)) is Upload.TAKEN

    def post(self, host: str, body: bytes, *, round_: int = 0) -> tuple[int, dict]:
        """A raw delta upload: the HTTP status and the JSON error."""
        r = requests.post(f"{self.url}/v1/rounds/{round_}/delta", params={"host": host}, data=body, timeout=30,
                          headers={"Content-Type": OCTETS, CREDENTIAL_HEADER: self.credentials[host]})
        return refusal(r)

    def sync(self, host: str, round_: int, wait: float = 0) -> requests.Response:
        return requests.get(f"{self.url}/v1/rounds/{round_}/sync", params={"host": host, "wait": wait}, timeout=30,
                            headers={CREDENTIAL_HEADER: self.credentials[host]})

    def status(self) -> dict:
        return requests.get(f"{self.url}/v1/status", timeout=30).json()

    def published(self, host: str, round_: int = 0) -> str:
        """The model hash round ``round_``'s sync announces (waiting for it)."""
        reply = self.clients[host].wait_sync(round_)
        assert isinstance(reply, SyncReady)
        return Message.parse(body_bytes(reply.body)).meta.model_hash

    def unchanged(self, received: list[str], round_: int = 0, model: str | None = None) -> None:
        state = self.status()
        assert (state["round"], state["received"], state["model_hash"]) == (round_, received, model or self.initial)


def start(coordinator, hosts: str = "ab", *args: str, named=MODEL, settings: CodecSettings = SETTINGS) -> Run:
    coord = coordinator(len(hosts), *args)
    tensors = [s.as_json() for s in spec_of(named)]
    clients = {h: HttpClient(coord.url, host=h, retry_for=5) for h in hosts}
    replies = {hosts[0]: clients[hosts[0]].join(tensors)}
    assert replies[hosts[0]].provide_model
    initial = clients[hosts[0]].put_model(memoryview(model_file(named)))
    for h in hosts[1:]:
        replies[h] = clients[h].join(tensors)
        assert replies[h].model_hash == initial
    return Run(coord, clients, {h: r.credential for h, r in replies.items()}, initial, named, settings)


# -- deltas ------------------------------------------------------------------------------------------------------


def test_a_delta_computed_against_another_model_is_refused_and_changes_nothing(coordinator) -> None:
    run = start(coordinator)
    run.send("a", GOOD_A, 30)
    status, body = run.post("b", run.delta(BAD, "b", base=model_hash(OTHER_MODEL)))
    assert (status, body.get("reason"), body.get("model_hash")) == (409, "stale_base", run.initial)
    assert f"computed against model {model_hash(OTHER_MODEL)}" in body["error"]
    run.unchanged(["a"])
    run.send("b", GOOD_B, 10)
    assert run.published("b") == hash_after(MODEL, [(GOOD_A, 30), (GOOD_B, 10)])


def test_a_delta_for_a_round_that_has_not_started_is_refused_and_changes_nothing(coordinator) -> None:
    run = start(coordinator)
    run.send("a", GOOD_A, 30)
    status, body = run.post("b", run.delta(BAD, "b", round_=5), round_=5)  # a payload consistent with its URL
    assert (status, body.get("reason"), body.get("round")) == (409, "stale_base", 0)
    assert "round 5 is not open" in body["error"]
    run.unchanged(["a"])
    run.send("b", GOOD_B, 10)
    assert run.published("b") == hash_after(MODEL, [(GOOD_A, 30), (GOOD_B, 10)])


def test_a_delta_for_the_round_just_published_is_late_and_changes_nothing(coordinator) -> None:
    run = start(coordinator)
    run.send("a", GOOD_A, 30)
    run.send("b", GOOD_B, 10)
    after = run.published("b")
    assert after == hash_after(MODEL, [(GOOD_A, 30), (GOOD_B, 10)])
    status, body = run.post("a", run.delta(BAD, "a", base=after))
    assert (status, body.get("reason"), body.get("round")) == (409, "late", 1)
    assert "round 0 is not open" in body["error"]
    run.unchanged([], round_=1, model=after)


def test_a_second_delta_of_a_host_in_one_round_is_refused_and_the_first_one_counts(coordinator) -> None:
    run = start(coordinator, "abc")
    run.send("a", GOOD_A, 30)
    run.send("b", GOOD_B, 10)
    status, body = run.post("b", run.delta(BAD, "b", samples=50))
    assert (status, body.get("reason")) == (409, "duplicate") and "already sent its delta for round 0" in body["error"]
    run.unchanged(["a", "b"])
    run.send("c", GOOD_C, 20)
    assert run.published("c") == hash_after(MODEL, [(GOOD_A, 30), (GOOD_B, 10), (GOOD_C, 20)])


def test_a_delta_in_another_codec_of_the_same_size_is_refused_and_changes_nothing(coordinator) -> None:
    named = [("w", torch.randn(8, 128, generator=_gen)), ("b", torch.randn(128, generator=_gen))]
    other = CodecSettings(block_size=128, scale_dtype="fp32")  # 34 bytes per 64 values, as the run's own codec
    assert MessageLayout.of(spec_of(named), other).total == MessageLayout.of(spec_of(named), SETTINGS).total
    good_a, good_b, bad = ([torch.randn(t.shape, generator=_gen) * 0.01 for _, t in named] for _ in range(3))
    run = start(coordinator, "ab", named=named)
    run.send("a", good_a, 30)
    status, body = run.post("b", encoded(named, bad, MessageMeta("delta", 0, "b", run.initial, samples=10), other))
    assert (status, body.get("reason")) == (400, "invalid")
    assert "payload uses q4, block size 128 with fp32 scales; this run uses q4, 64 with fp16" in body["error"]
    run.unchanged(["a"])
    run.send("b", good_b, 10)
    assert run.published("b") == hash_after(named, [(good_a, 30), (good_b, 10)])


def test_a_delta_whose_scales_would_overflow_the_accumulator_is_refused_and_changes_nothing(coordinator) -> None:
    fp32 = CodecSettings(scale_dtype="fp32")  # fp16 scales cannot get there: the check guards fp32-scale runs
    huge = [torch.full(t.shape, 1e33) for _, t in MODEL]  # finite in fp32; times 8 x 10 samples, beyond 1e30

    def run_of(refused_first: bool) -> str:
        run = start(coordinator, "ab", "--scale-dtype", "fp32", settings=fp32)
        run.send("a", GOOD_A, 30)
        if refused_first:
            status, body = run.post("b", run.delta(huge, "b"))
            assert (status, body.get("reason")) == (400, "invalid")
            assert "would overflow the accumulator" in body["error"]
            run.unchanged(["a"])
        run.send("b", GOOD_B, 10)
        return run.published("b")

    assert run_of(refused_first=True) == run_of(refused_first=False)


def test_a_delta_of_a_host_that_left_is_refused_and_changes_nothing(coordinator) -> None:
    run = start(coordinator)
    run.clients["b"].leave()
    status, body = run.post("b", run.delta(BAD, "b"))
    # refused before any route runs (Membership.authenticate): its credential no longer acts for the run
    assert (status, body.get("reason")) == (403, "forbidden") and "host b left the run" in body["error"]
    run.unchanged([])
    assert run.status()["hosts"] == {"a": "training", "b": "left"}
    run.send("a", GOOD_A, 30)  # the round closes with a's delta alone
    assert run.published("a") == hash_after(MODEL, [(GOOD_A, 30)])


def test_the_round_itself_refuses_a_delta_of_a_host_that_left_whatever_the_transport(tmp_path) -> None:
    """Every transport's call is refused by the credential check first (above); the round's own check holds
    beneath it."""
    c = LocalCoordinator(tmp_path, 2)
    try:
        a, b = join(c, "a", "b")
        train(b, 0)
        body = b.encode(b.tensors.live, 8, False).join()
        b.client.leave()
        with pytest.raises(Refusal) as refused:
            b.client.post_delta(0, body.view())
        assert refused.value.reason is Reason.FORBIDDEN and "host b left the run" in str(refused.value)

        async def the_round_checks() -> None:
            c.rounds.deltas.check_upload("b", 0, len(body))

        with pytest.raises(Refusal) as refused:
            c.call(the_round_checks())
        assert refused.value.reason is Reason.NOT_JOINED and "host b is not in the run (it left)" in str(refused.value)
        assert (c.state.round, c.rounds.received, c.state.hosts["b"].state.value) == (0, {}, "left")
    finally:
        c.close()


def test_a_delta_before_the_run_has_a_model_is_refused_and_leaves_nothing_behind(coordinator) -> None:
    coord = coordinator(1)
    a = HttpClient(coord.url, host="a", retry_for=5)
    credential = a.join([s.as_json() for s in spec_of(MODEL)]).credential
    initial = model_hash(MODEL)
    delta = encoded(MODEL, BAD, MessageMeta("delta", 0, "a", initial, samples=10))
    r = requests.post(f"{coord.url}/v1/rounds/0/delta", params={"host": "a"}, data=delta, timeout=30,
                      headers={"Content-Type": OCTETS, CREDENTIAL_HEADER: credential})
    status, body = refusal(r)
    assert (status, body.get("reason")) == (409, "no_model") and "has no model yet" in body["error"]
    assert a.put_model(memoryview(model_file())) == initial
    state = requests.get(f"{coord.url}/v1/status", timeout=30).json()
    assert (state["round"], state["received"], state["model_hash"]) == (0, [], initial)


# -- the model --------------------------------------------------------------------------------------------------


def test_an_initial_model_from_a_host_that_is_not_its_provider_is_refused(tmp_path) -> None:
    """Host a was chosen to provide the model but took longer than the provider timeout: host b provides it, and
    a's late upload does not replace it."""
    c = LocalCoordinator(tmp_path / "run", 2, provider_timeout=0.0)
    try:
        a, b = LocalClient(c, "a"), LocalClient(c, "b")
        tensors = [s.as_json() for s in spec_of(MODEL)]
        assert a.join(tensors).provide_model
        assert b.join(tensors).provide_model
        with pytest.raises(Refusal, match="host b provides the model, not host a") as refused:
            a.put_model(io.BytesIO(model_file(MODEL)))
        assert refused.value.reason is Reason.NOT_PROVIDER
        assert c.rounds.model is None
        assert b.put_model(io.BytesIO(model_file(OTHER_MODEL))) == model_hash(OTHER_MODEL)
        assert a.join(tensors).model_hash == model_hash(OTHER_MODEL)
    finally:
        c.close()


def test_an_initial_model_that_is_not_a_model_file_is_refused_and_the_run_waits_for_one(coordinator) -> None:
    coord = coordinator(1)
    a = HttpClient(coord.url, host="a", retry_for=5)
    credential = a.join([s.as_json() for s in spec_of(MODEL)]).credential
    garbage = b"\x07" * len(model_file())  # the size of the model declared, but no safetensors file
    r = requests.put(f"{coord.url}/v1/model", params={"host": "a"}, data=garbage, timeout=30,
                     headers={CREDENTIAL_HEADER: credential})
    status, body = refusal(r)
    assert (status, body.get("reason")) == (400, "invalid") and "model rejected" in body["error"]
    assert requests.get(f"{coord.url}/v1/status", timeout=30).json()["model_hash"] is None
    assert a.put_model(memoryview(model_file())) == model_hash(MODEL)


def test_a_model_given_back_that_is_not_the_one_the_host_said_it_holds_is_refused(coordinator, tmp_path) -> None:
    """The coordinator is killed after round 0 (its snapshot is of round 0's start); host a rejoins the restarted
    one saying it holds round 1's model, then uploads another: refused, and the run takes the right one."""
    run_dir = tmp_path / "resumed"
    first = coordinator(2, "--snapshot-every", "100", run_dir=run_dir)
    tensors = [s.as_json() for s in spec_of(MODEL)]
    a, b = (HttpClient(first.url, host=h, retry_for=5) for h in "ab")
    a.join(tensors)
    initial = a.put_model(memoryview(model_file()))
    b.join(tensors)
    for client, values, samples in ((a, GOOD_A, 30), (b, GOOD_B, 10)):
        message = encoded(MODEL, values, MessageMeta("delta", 0, client.host, initial, samples=samples))
        assert client.post_delta(0, memoryview(message)) is Upload.TAKEN
    after = Message.parse(body_bytes(a.wait_sync(0).body)).meta.model_hash
    held = bytes(body_bytes(a.get_model()).numpy())
    saved = run_dir / "state" / "run.json"
    deadline = time.monotonic() + 30
    while not (saved.exists() and json.loads(saved.read_text())["round"] == 1):
        assert time.monotonic() < deadline, "round 1's state was never saved"
        time.sleep(0.05)
    first.proc.kill()
    first.wait()
    second = coordinator(2, "--snapshot-every", "100", run_dir=run_dir)
    a.url = second.url
    assert a.join(tensors, model_hash=after, round_=1).provide_model
    with pytest.raises(Refusal, match=f"hashes to {initial}, not the {after} it said it holds") as refused:
        a.put_model(memoryview(model_file()))  # round 0's model, not the round 1 model it promised
    assert refused.value.reason is Reason.INVALID
    assert requests.get(f"{second.url}/v1/status", timeout=30).json()["model_hash"] is None
    assert a.join(tensors, model_hash=after, round_=1).provide_model
    assert a.put_model(memoryview(held)) == after
    state = requests.get(f"{second.url}/v1/status", timeout=30).json()
    assert (state["round"], state["model_hash"]) == (1, after)


def held_back(coord: Coordinator, credential: str, body: bytes, *, end: str) -> None:
    """Half of an initial model upload, then the uploader stalls (``end="stall"``) or hangs up (``"close"``);
    returns once the coordinator has let go of the connection."""
    sock = raw_request(coord.url, f"PUT /v1/model?host=a HTTP/1.1\r\nHost: x\r\n{CREDENTIAL_HEADER}: {credential}\r\n"
                                  f"Content-Type: {OCTETS}\r\nContent-Length: {len(body)}\r\n\r\n")
    sock.sendall(body[: len(body) // 2])
    if end == "close":
        sock.shutdown(socket.SHUT_WR)
    sock.settimeout(15)
    try:
        while sock.recv(4096):
            pass
    except OSError:
        pass  # reset: cut
    sock.close()
    time.sleep(1.0)  # what the coordinator would do with the half it read, it has done by now


@pytest.mark.slow
def test_a_stop_is_not_held_up_by_an_upload_whose_body_never_comes(coordinator) -> None:
    """SIGTERM while a host's delta request is in (its headers, not a byte of its body): the coordinator cuts it
    within its shutdown grace (SHUTDOWN_GRACE; aiohttp's default would wait up to 60 s) and exits, saying the run
    stopped before it completed, though the transfer's own limit is longer."""
    coord = coordinator(1, "--transfer-timeout", "300")
    a = HttpClient(coord.url, host="a", retry_for=5)
    credential = a.join([s.as_json() for s in spec_of(MODEL)]).credential
    a.put_model(memoryview(model_file()))
    sock = raw_request(coord.url, f"POST /v1/rounds/0/delta?host=a HTTP/1.1\r\nHost: x\r\n{CREDENTIAL_HEADER}: "
                                  f"{credential}\r\nContent-Type: {OCTETS}\r\nContent-Length: 100000\r\n\r\n")
    try:
        time.sleep(0.5)  # the request is being handled: the coordinator waits for its body
        coord.proc.send_signal(signal.SIGTERM)
        assert coord.wait(SHUTDOWN_GRACE + 25) == 1  # stopped before the run completed (not 60 s later)
    finally:
        sock.close()
    assert "run stopped before the run completed, at round 0" in coord.log_path.read_text()


@pytest.mark.parametrize("end", ["stall", "close"])
def test_an_initial_model_upload_that_does_not_arrive_whole_is_not_taken(coordinator, end) -> None:
    """Stalled past its time limit, or ended early: the half-read model is not the run's (a model file has no
    checksum: only the transfer's own guards stand between a half-filled buffer and the run)."""
    coord = coordinator(1, "--transfer-timeout", "1")
    a = HttpClient(coord.url, host="a", retry_for=5)
    credential = a.join([s.as_json() for s in spec_of(MODEL)]).credential
    held_back(coord, credential, model_file(), end=end)
    assert requests.get(f"{coord.url}/v1/status", timeout=30).json()["model_hash"] is None
    assert a.put_model(memoryview(model_file())) == model_hash(MODEL)


def test_a_model_download_beyond_the_ones_in_flight_is_refused_as_busy(coordinator) -> None:
    coord = coordinator(1)
    named = [("big", torch.randn(4 << 20, generator=_gen))]  # 16 MB: a reader that stops holds its download open
    a = HttpClient(coord.url, host="a", retry_for=5)
    credential = a.join([s.as_json() for s in spec_of(named)]).credential
    a.put_model(memoryview(model_file(named)))
    stalled = [raw_request(coord.url, f"GET /v1/model?host=a HTTP/1.1\r\nHost: x\r\n{CREDENTIAL_HEADER}: "
                                      f"{credential}\r\n\r\n", rcvbuf=64 << 10) for _ in range(2)]
    try:
        deadline = time.monotonic() + 10
        while requests.get(f"{coord.url}/v1/status", timeout=30).json()["downloads"] != 2:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        r = requests.get(f"{coord.url}/v1/model", params={"host": "a"}, headers={CREDENTIAL_HEADER: credential},
                         timeout=30, stream=True)
        status, body = refusal(r)
        r.close()
        assert (status, body.get("reason")) == (503, "busy") and "2 model downloads are in flight" in body["error"]
    finally:
        for sock in stalled:
            sock.close()
    deadline = time.monotonic() + 10
    while requests.get(f"{coord.url}/v1/status", timeout=30).json()["downloads"] != 0:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert read_model(body_bytes(a.get_model()))[1] == model_hash(named)


# -- syncs --------------------------------------------------------------------------------------------------------


def test_a_sync_of_a_round_that_has_not_started_is_refused_and_changes_nothing(coordinator) -> None:
    run = start(coordinator)
    run.send("a", GOOD_A, 30)
    status, body = refusal(run.sync("a", 5))
    assert (status, body.get("reason"), body.get("round")) == (409, "not_open", 0)
    assert "round 5 has not started" in body["error"]
    run.unchanged(["a"])
    run.send("b", GOOD_B, 10)
    assert run.published("a") == hash_after(MODEL, [(GOOD_A, 30), (GOOD_B, 10)])


def test_a_host_waiting_for_a_sync_without_having_sent_its_delta_is_told_to_send_it(coordinator) -> None:
    run = start(coordinator)
    run.send("a", GOOD_A, 30)
    status, body = refusal(run.sync("b", 0))
    assert (status, body.get("reason")) == (409, "no_delta")
    assert "holds no delta of host b for round 0" in body["error"]
    run.unchanged(["a"])
    run.send("b", GOOD_B, 10)
    assert run.published("b") == hash_after(MODEL, [(GOOD_A, 30), (GOOD_B, 10)])


def test_a_sync_replaced_by_later_rounds_is_gone_and_names_the_round_to_fetch(coordinator) -> None:
    run = start(coordinator, "a")
    run.send("a", GOOD_A, 30)
    after = run.published("a")
    message = run.delta(GOOD_B, "a", round_=1, base=after)
    assert run.clients["a"].post_delta(1, memoryview(message)) is Upload.TAKEN
    later = run.published("a", 1)
    status, body = refusal(run.sync("a", 0))
    assert (status, body.get("reason"), body.get("round")) == (410, "gone", 2)
    assert "the sync of round 0 is gone; the model is at round 2" in body["error"]
    run.unchanged([], round_=2, model=later)


def test_a_sync_the_restarted_coordinator_does_not_hold_is_gone_not_waited_for(coordinator, tmp_path) -> None:
    """The coordinator dies after publishing round 1 but before saving it (its state is round 1's start); host a
    gives back round 2's model; host b, which had not fetched round 1's sync, is told it is gone (so it fetches the
    model) instead of being answered "not ready" for ever."""
    run_dir = tmp_path / "resumed"
    first = coordinator(2, "--snapshot-every", "100", run_dir=run_dir)
    tensors = [s.as_json() for s in spec_of(MODEL)]
    a, b = (HttpClient(first.url, host=h, retry_for=5) for h in "ab")
    a.join(tensors)
    base = a.put_model(memoryview(model_file()))
    credential = b.join(tensors).credential
    saved = run_dir / "state" / "run.json"
    for round_ in (0, 1):
        for client, values in ((a, GOOD_A), (b, GOOD_B)):
            message = encoded(MODEL, values, MessageMeta("delta", round_, client.host, base, samples=10))
            assert client.post_delta(round_, memoryview(message)) is Upload.TAKEN
        base = Message.parse(body_bytes(a.wait_sync(round_).body)).meta.model_hash
        if round_ == 0:
            deadline = time.monotonic() + 30
            while not (saved.exists() and json.loads(saved.read_text())["round"] == 1):
                assert time.monotonic() < deadline, "round 1's state was never saved"
                time.sleep(0.05)
            time.sleep(0.5)
            shutil.copytree(run_dir / "state", tmp_path / "state-of-round-1")
    held = bytes(body_bytes(a.get_model()).numpy())
    first.proc.kill()
    first.wait()
    shutil.rmtree(run_dir / "state")
    shutil.copytree(tmp_path / "state-of-round-1", run_dir / "state")
    second = coordinator(2, "--snapshot-every", "100", run_dir=run_dir)
    a.url = b.url = second.url
    assert a.join(tensors, model_hash=base, round_=2).provide_model
    assert a.put_model(memoryview(held)) == base
    status, body = refusal(requests.get(f"{second.url}/v1/rounds/1/sync", params={"host": "b", "wait": 0},
                                        headers={CREDENTIAL_HEADER: credential}, timeout=30))
    assert (status, body.get("reason")) == (410, "gone") and "fetch GET /v1/model" in body["error"]
    state = requests.get(f"{second.url}/v1/status", timeout=30).json()
    assert (state["round"], state["model_hash"], state["received"]) == (2, base, [])
    assert read_model(body_bytes(b.get_model()))[1] == base


# -- a host checks what it is sent ------------------------------------------------------------------------------


class Tampering(LocalClient):
    """The in-process client, with the coordinator's replies changed on their way: ``sync`` rewrites the next
    sync's bytes, ``model`` the next model download's, ``provided`` the hash the coordinator answers a
    provided model with."""

    def __init__(self, coordinator: LocalCoordinator, host: str) -> None:
        super().__init__(coordinator, host)
        self.sync = self.model = self.provided = None

    def wait_sync(self, round_: int, poll: float = 5.0, *, training=None):
        reply = super().wait_sync(round_, poll, training=training)
        if isinstance(reply, SyncReady) and self.sync is not None:
            data, self.sync = self.sync(bytearray(body_bytes(reply.body).numpy())), None
            return SyncReady(reply.round, BytesBody(bytes(data)), reply.complete)
        return reply

    def get_model(self) -> BytesBody:
        body = super().get_model()
        if self.model is not None:
            data, self.model = self.model(bytes(body_bytes(body).numpy())), None
            return BytesBody(data)
        return body

    def put_model(self, body) -> str:
        theirs = super().put_model(body)
        return theirs if self.provided is None else self.provided


def with_meta(**changes):
    """A sync rewriter: the same data under a header with ``changes`` (and a valid CRC)."""

    def rewrite(data: bytearray) -> bytearray:
        message = Message.parse(data)
        message.write_header(replace(message.meta, **changes))
        return data

    return rewrite


def flip_a_data_byte(data: bytearray) -> bytearray:
    data[-3] ^= 0x40
    return data


@pytest.fixture
def local(tmp_path):
    started = []

    def start_local(hosts: int = 2) -> LocalCoordinator:
        started.append(LocalCoordinator(tmp_path / f"run{len(started)}", hosts))
        return started[-1]

    yield start_local
    for c in started:
        c.close()


def hosts_of(coordinator: LocalCoordinator, *ids: str, join: bool = True) -> list[HostRound]:
    hosts = [HostRound(HostTensors(model(seed=i)), Tampering(coordinator, h), PhaseLog(h)) for i, h in enumerate(ids)]
    for h in hosts if join else ():
        h.join()
        h.phases.records.clear()
    return hosts


def a_round(a: HostRound, b: HostRound, tamper) -> None:
    """Both hosts train and send their deltas; host b's sync reaches it rewritten by ``tamper``."""
    train(a, 0), train(b, 0)
    for h in (a, b):
        assert h.upload(h.encode(h.tensors.live, 8, False)) is Upload.TAKEN
    assert a.synchronize().contributed
    b.client.sync = tamper


def applied(host: HostRound) -> list[int]:
    return [r.round for r in recorded(host) if r.phase == "apply"]


def fetched(host: HostRound) -> int:
    return sum(r.phase == "fallback_fetch" for r in recorded(host))


def test_a_sync_made_from_another_base_is_not_applied_the_host_fetches_the_model(local) -> None:
    c = local()
    a, b = hosts_of(c, "a", "b")
    a_round(a, b, with_meta(base_hash=model_hash(OTHER_MODEL)))
    result = b.synchronize()
    assert not result.contributed and (applied(b), fetched(b)) == ([], 1)
    assert b.round == a.round == 1
    assert_on_the_run_model(c, a, b)


def test_a_sync_of_another_round_is_not_applied_the_host_fetches_the_model(local) -> None:
    c = local()
    a, b = hosts_of(c, "a", "b")
    a_round(a, b, with_meta(round=1))
    result = b.synchronize()
    assert not result.contributed and (applied(b), fetched(b)) == ([], 1)
    assert b.round == a.round == 1
    assert_on_the_run_model(c, a, b)


def test_a_sync_that_does_not_parse_is_not_applied_the_host_fetches_the_model(local) -> None:
    c = local()
    a, b = hosts_of(c, "a", "b")
    a_round(a, b, flip_a_data_byte)
    result = b.synchronize()
    assert not result.contributed and (applied(b), fetched(b)) == ([], 1)
    assert b.round == a.round == 1
    assert_on_the_run_model(c, a, b)


def test_a_fetched_model_that_does_not_hash_to_the_coordinators_hash_is_refused(local) -> None:
    c = local()
    a, b = hosts_of(c, "a", "b", join=False)
    a.join()

    def claim_another_hash(data: bytes) -> bytes:
        round_, _, specs, tensors = read_model(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        return model_header(specs, round_, model_hash(OTHER_MODEL)) + b"".join(t.numpy().tobytes() for t in tensors)

    b.client.model = claim_another_hash  # b holds another model than a's, so it fetches a's at its join
    claimed = model_hash(OTHER_MODEL)
    with pytest.raises(RuntimeError, match=f"hashes to {a.model_hash}, not the coordinator's {claimed}"):
        b.join()
    assert b.model_hash == ""  # b never took the model as the run's


def test_an_initial_model_the_coordinator_hashes_otherwise_stops_its_provider(local) -> None:
    c = local()
    (a,) = hosts_of(c, "a", join=False)
    a.client.provided = model_hash(OTHER_MODEL)
    with pytest.raises(RuntimeError, match=f"coordinator hashed the initial model as {model_hash(OTHER_MODEL)}"):
        a.join()
    assert a.model_hash == model_hash(a.tensors.named())
