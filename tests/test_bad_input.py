"""Bad input over real HTTP: each request gets the right 4xx with a JSON error and reason, and the round's result
does not change. Host a's delta arrives first, then every bad request of the table, then host b's good delta: the
published model must be exactly the one computed here from a's and b's deltas, in that order."""

from __future__ import annotations

import http.client
import json
import math
from dataclasses import dataclass
from urllib.parse import urlsplit

import pytest
import requests
import torch
from helpers import MODEL, SPECS, Coordinator, body_bytes, delta_message, expected_after_round, model_file

from lightning_nodeox.core.hashing import model_hash
from lightning_nodeox.core.modelfile import read_model
from lightning_nodeox.core.protocol import CREDENTIAL_HEADER, OCTETS, Reason, Refusal, SyncReady, Upload
from lightning_nodeox.core.specs import spec_of
from lightning_nodeox.core.wire import Message, MessageMeta
from lightning_nodeox.host.client import HttpClient

pytestmark = pytest.mark.slow  # every test here starts processes

TOKEN = "s3cret-token"
TENSORS = [s.as_json() for s in SPECS]
_gen = torch.Generator().manual_seed(2)
GOOD_A = [torch.randn(t.shape, generator=_gen) * 0.01 for _, t in MODEL]
GOOD_B = [torch.randn(t.shape, generator=_gen) * 0.01 for _, t in MODEL]


@dataclass
class Run:
    coord: Coordinator
    a: HttpClient
    b: HttpClient
    credentials: dict[str, str]
    initial_hash: str

    @property
    def url(self) -> str:
        return self.coord.url

    def delta(self, values=GOOD_B, *, host="b", samples=10, specs=SPECS, base=None) -> bytes:
        message = delta_message(values, round_=0, host=host, base_hash=base or self.initial_hash, samples=samples,
                                specs=specs)
        return bytes(message.view())

    def headers(self, *, token: str | bytes | None = TOKEN, as_: str | None = "b") -> dict:
        h = {}
        if token is not None:
            h["Authorization"] = b"Bearer " + token if isinstance(token, bytes) else f"Bearer {token}"
        if as_ is not None:
            h[CREDENTIAL_HEADER] = self.credentials.get(as_, "not-a-credential")
        return h

    def post_delta(self, body: bytes, *, host="b", round_=0, **who) -> requests.Response:
        return requests.post(f"{self.url}/v1/rounds/{round_}/delta", params={"host": host}, data=body,
                             headers={"Content-Type": OCTETS, **self.headers(**who)}, timeout=30)

    def join(self, body, **who) -> requests.Response:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        return requests.post(f"{self.url}/v1/join", data=data, headers=self.headers(**who), timeout=30)

    def events(self, body, *, host="b", **who) -> requests.Response:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        return requests.post(f"{self.url}/v1/events", params={"host": host}, data=data,
                             headers={"Content-Type": "application/json", **self.headers(**who)}, timeout=30)

    def status(self) -> dict:
        return requests.get(f"{self.url}/v1/status", headers=self.headers(), timeout=30).json()


def declared_only(url: str, method: str, path: str, headers: dict, length: int) -> tuple[int, dict]:
    """A request that announces ``length`` body bytes but sends none: the answer must come before the body."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    try:
        conn.putrequest(method, path)
        for k, v in {**headers, "Content-Length": str(length), "Content-Type": OCTETS}.items():
            conn.putheader(k, v)
        conn.endheaders()
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad_input")
    (root / "token").write_text(TOKEN)
    coord = Coordinator(root / "run", 2, "--token-file", str(root / "token"))
    try:
        a = HttpClient(coord.url, host="a", token=TOKEN, retry_for=5)
        b = HttpClient(coord.url, host="b", token=TOKEN, retry_for=5)
        reply_a = a.join(TENSORS)
        assert reply_a.provide_model and reply_a.credential
        initial_hash = a.put_model(memoryview(model_file()))
        reply_b = b.join(TENSORS)
        assert reply_b.model_hash == initial_hash and reply_b.credential not in ("", reply_a.credential)
        run = Run(coord, a, b, {"a": reply_a.credential, "b": reply_b.credential}, initial_hash)
        assert a.post_delta(0, memoryview(run.delta(GOOD_A, host="a", samples=30))) is Upload.TAKEN
        yield run
    finally:
        coord.stop()


def flipped(data: bytes) -> bytes:
    out = bytearray(data)
    out[-3] ^= 0x40
    return bytes(out)


def nan_delta(run: Run) -> bytes:
    message = Message.parse(bytearray(run.delta()))
    message.scales(0)[3] = math.nan
    message.write_header(MessageMeta("delta", 0, "b", run.initial_hash, samples=10))  # a valid CRC over the NaN
    return bytes(message.view())


def record(**fields) -> dict:
    return {"round": 0, "host": "b", "phase": "encode", "start": 1.0, "end": 2.0, **fields}


TRANSPOSED = spec_of([("fc.weight", torch.zeros(30, 40)), *MODEL[1:]])
NESTED = b'{"records": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"

# name: (request, status, reason, what the error says)
CASES = {
    "no token": (lambda r: r.post_delta(r.delta(), token=None), 401, "unauthorized", "NODEOX_TOKEN"),
    "wrong token": (lambda r: r.post_delta(r.delta(), token="guess"), 401, "unauthorized", "bearer token"),
    "non-UTF-8 token": (lambda r: r.post_delta(r.delta(), token=b"\xff\xfe"), 401, "unauthorized", "bearer token"),
    "truncated body": (lambda r: r.post_delta(r.delta()[:-16]), 400, "invalid", "bytes but this model's q4 delta is"),
    "one flipped byte": (lambda r: r.post_delta(flipped(r.delta())), 400, "invalid", "integrity check"),
    "wrong round": (lambda r: r.post_delta(r.delta(), round_=5), 409, "stale_base", "round 5 is not open"),
    "wrong shapes": (lambda r: r.post_delta(r.delta([torch.zeros(30, 40), *GOOD_B[1:]], specs=TRANSPOSED)),
                     400, "invalid", "does not match the model's"),
    "a NaN delta": (lambda r: r.post_delta(nan_delta(r)), 400, "invalid", "NaN or Inf scales"),
    "2^31 samples": (lambda r: r.post_delta(r.delta(samples=2**31)), 400, "invalid", "at most 16777216"),
    "a delta of another host's payload": (lambda r: r.post_delta(r.delta(host="a")), 400, "invalid",
                                          "sent as round 0's delta of host b"),
    "oversized body": (lambda r: declared_only(r.url, "POST", "/v1/events?host=b", r.headers(), 5 << 20),
                       413, "too_large", "larger than"),
    "oversized delta": (lambda r: declared_only(r.url, "POST", "/v1/rounds/0/delta?host=b", r.headers(), 1 << 40),
                        400, "invalid", "bytes but this model's q4 delta is"),
    "malformed JSON": (lambda r: r.join(b'{"host": "c", "tensors": ['), 400, "invalid", "not valid JSON"),
    "deeply nested JSON": (lambda r: r.events(NESTED), 400, "invalid", "nested too deeply"),
    "NaN in JSON": (lambda r: r.events(b'{"records": [{"round": 0, "host": "b", "phase": "encode", "start": NaN, '
                                       b'"end": 2.0}]}'), 400, "invalid", "NaN is not a number JSON allows"),
    "Infinity in JSON": (lambda r: r.events(b'{"records": [{"round": 0, "host": "b", "phase": "encode", '
                                            b'"start": 1e400, "end": 2.0}]}'), 400, "invalid", "overflows"),
    "bytes=10**400": (lambda r: r.events({"records": [record(bytes=10**400)]}), 400, "invalid",
                      "bytes must be an integer"),
    "an unknown phase": (lambda r: r.events({"records": [record(phase="mining")]}), 400, "invalid",
                         "is not one of train, encode"),
    "too many extra fields": (lambda r: r.events({"records": [record(**{f"f{i}": i for i in range(17)})]}),
                              400, "invalid", "at most 16"),
    "an extra field that is not a plain value": (lambda r: r.events({"records": [record(deep=[[1]])]}), 400,
                                                 "invalid", "must be a number"),
    "records of another host": (lambda r: r.events({"records": [record(host="a")]}), 403, "forbidden",
                                "a host sends only its own records"),
    "events without a credential": (lambda r: r.events({"records": [record()]}, as_=None), 403, "forbidden",
                                    "credential for host b"),
    "an unknown host": (lambda r: r.post_delta(r.delta(host="zed"), host="zed", as_=None), 409, "not_joined",
                        "host zed has not joined"),
    "a host id with /": (lambda r: r.join({"host": "a/b", "tensors": TENSORS}), 400, "invalid", "is not valid"),
    "a host id with + # &": (lambda r: r.join({"host": "a+b#c&d", "tensors": TENSORS}), 400, "invalid",
                             "is not valid"),
    "host: null": (lambda r: r.join({"host": None, "tensors": TENSORS}), 400, "invalid", "None is not valid"),
    "a join without tensors": (lambda r: r.join({"host": "c"}), 400, "invalid", "tensor specs are required"),
    "a join of another model": (lambda r: r.join({"host": "b", "tensors": [["fc.weight", "float32", [40, 31]],
                                                                          *TENSORS[1:]]}, as_="b"),
                                400, "invalid", "does not match the model's"),
    "a join of a complex tensor": (lambda r: r.join({"host": "c", "tensors": [["w", "complex64", [1]]]}), 400, "invalid",
                                    "invalid dtype"),
    "a round that is not a number": (
        lambda r: requests.get(f"{r.url}/v1/rounds/zero/sync", params={"host": "b"}, headers=r.headers(), timeout=30),
        400, "invalid", "must be an integer"),
    "a join of an absurd model": (lambda r: r.join({"host": "c", "tensors": [["w", "float32", [10**30]]]}), 400,
                                  "invalid", "is not supported"),
    "another host's upload with its own credential": (lambda r: r.post_delta(r.delta(host="a"), host="a"), 403,
                                                      "forbidden", "only the process that joined as a"),
    "another host's leave with its own credential": (
        lambda r: requests.post(f"{r.url}/v1/hosts/a/leave", headers=r.headers(), timeout=30), 403, "forbidden",
        "credential for host a"),
    "a leave without credential": (
        lambda r: requests.post(f"{r.url}/v1/hosts/b/leave", headers=r.headers(as_=None), timeout=30), 403,
        "forbidden", "credential for host b"),
    "a sync without credential": (
        lambda r: requests.get(f"{r.url}/v1/rounds/0/sync", params={"host": "b", "wait": 0},
                               headers=r.headers(as_=None), timeout=30), 403, "forbidden", "credential for host b"),
    "a model download without credential": (
        lambda r: requests.get(f"{r.url}/v1/model", params={"host": "b"}, headers=r.headers(as_=None), timeout=30),
        403, "forbidden", "credential for host b"),
    "a model upload when the run has one": (
        lambda r: requests.put(f"{r.url}/v1/model", params={"host": "a"}, data=model_file(),
                               headers=r.headers(as_="a"), timeout=30), 409, "has_model", "already has a model"),
    "a sync wait of NaN seconds": (
        lambda r: requests.get(f"{r.url}/v1/rounds/0/sync", params={"host": "b", "wait": "nan"},
                               headers=r.headers(), timeout=30), 400, "invalid", "seconds"),
    "a second process with a live host's id": (lambda r: r.join({"host": "b", "tensors": TENSORS}, as_=None), 409,
                                               "id_in_use", "host id b is in use by another live process"),
    "a join beyond --hosts": (lambda r: r.join({"host": "c", "tensors": TENSORS}, as_=None), 409, "full",
                              "already has its 2 hosts"),
    "a join whose model_hash is not a string": (
        lambda r: r.join({"host": "b", "tensors": TENSORS, "model_hash": 5}, as_="b"), 400, "invalid",
        "model_hash must be a string"),
    "a join whose round is not an integer": (
        lambda r: r.join({"host": "b", "tensors": TENSORS, "model_hash": "x", "round": -1}, as_="b"), 400, "invalid",
        "join: round must be an integer"),
    "a join larger than its limit": (lambda r: declared_only(r.url, "POST", "/v1/join", r.headers(), 17 << 20), 413,
                                     "too_large", "request body of 17825792 bytes is larger than"),
    "events without records": (lambda r: r.events({"rows": []}), 400, "invalid", 'events need {"records"'),
    "more than 10000 records in one batch": (lambda r: r.events({"records": [record()] * 10_001}), 400, "invalid",
                                             "10001 records in one batch"),
    "an event batch without a Content-Length": (
        lambda r: requests.post(f"{r.url}/v1/events", params={"host": "b"}, data=iter([b'{"records": []}']),
                                headers=r.headers(), timeout=30), 411, "length_required", "needs a Content-Length"),
    "a model upload without a Content-Length": (
        lambda r: requests.put(f"{r.url}/v1/model", params={"host": "a"}, data=iter([model_file()]),
                               headers=r.headers(as_="a"), timeout=30), 411, "length_required",
        "needs a Content-Length"),
    "values without a credential": (
        lambda r: requests.post(f"{r.url}/v1/values/epoch.train.0.1", params={"host": "b", "wait": 0},
                                json={"payload": {}}, headers=r.headers(as_=None), timeout=30), 403, "forbidden",
        "credential for host b"),
    "a values key with a space": (
        lambda r: requests.post(f"{r.url}/v1/values/a%20b", params={"host": "b", "wait": 0}, json={"payload": {}},
                                headers=r.headers(), timeout=30), 400, "invalid", "values key 'a b' must be"),
    "values without a payload": (
        lambda r: requests.post(f"{r.url}/v1/values/epoch.train.0.1", params={"host": "b", "wait": 0},
                                json={"values": {}}, headers=r.headers(), timeout=30), 400, "invalid",
        'expected {"payload": ...}'),
    "values larger than their limit": (
        lambda r: declared_only(r.url, "POST", "/v1/values/epoch.train.0.1?host=b", r.headers(), 2 << 20), 413,
        "too_large", "request body of 2097152 bytes is larger than 1048576"),
    "a call that names no host": (
        lambda r: requests.post(f"{r.url}/v1/rounds/0/delta", data=r.delta(), headers=r.headers(), timeout=30), 400,
        "invalid", "query parameter host=ID is missing"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_gets_its_4xx_and_changes_nothing(run: Run, name: str) -> None:
    send, status, reason, says = CASES[name]
    response = send(run)
    got_status, body = response if isinstance(response, tuple) else (response.status_code, response.json())
    assert (got_status, body.get("reason")) == (status, reason), body
    assert says in body["error"], body["error"]
    state = run.status()
    assert (state["round"], state["received"], state["model_hash"]) == (0, ["a"], run.initial_hash)
    assert state["hosts"] == {"a": "training", "b": "training"}


def test_after_the_bad_input_the_round_completes_with_the_good_deltas(run: Run) -> None:
    assert run.b.post_delta(0, memoryview(run.delta(GOOD_B))) is Upload.TAKEN
    reply = run.b.wait_sync(0)
    assert isinstance(reply, SyncReady)
    sync = Message.parse(body_bytes(reply.body))
    expected = expected_after_round([t for _, t in MODEL], [(GOOD_A, 30), (GOOD_B, 10)])
    assert sync.meta.model_hash == model_hash(list(zip([n for n, _ in MODEL], expected)))
    round_, served_hash, _, tensors = read_model(body_bytes(run.a.get_model()))
    assert (round_, served_hash) == (1, sync.meta.model_hash)
    assert all(torch.equal(x, y) for x, y in zip(tensors, expected))
    lines = (run.coord.run_dir / "events.jsonl").read_text().splitlines()
    records = [json.loads(line, parse_constant=lambda c: pytest.fail(f"{c} in events.jsonl")) for line in lines]
    assert {r["host"] for r in records} == {"coordinator"}  # no bad record was written
    assert sorted(p.name for p in (run.coord.run_dir / "tb").iterdir()) == ["coordinator"]


def test_the_initial_model_must_fit_what_its_provider_declared(coordinator) -> None:
    coord = coordinator(1)
    a = HttpClient(coord.url, host="a", retry_for=5)
    credential = a.join(TENSORS).credential
    who = {CREDENTIAL_HEADER: credential}
    status, body = declared_only(coord.url, "PUT", "/v1/model?host=a", who, 1 << 40)  # answered before any byte
    assert (status, body["reason"]) == (400, "invalid") and "does not fit the 3 tensors host a declared" in body["error"]
    other = model_file([("fc.weight", torch.zeros(30, 40)), *MODEL[1:]])  # as many bytes, other shapes
    r = requests.put(f"{coord.url}/v1/model", params={"host": "a"}, data=other, headers=who, timeout=30)
    assert r.status_code == 400 and "as declared at join" in r.json()["error"]
    assert a.put_model(memoryview(model_file())) == model_hash(MODEL)


def test_telemetry_beyond_its_byte_budget_waits(coordinator) -> None:
    coord = coordinator(1)
    a = HttpClient(coord.url, host="a", retry_for=5)
    a.join(TENSORS)
    a.put_model(memoryview(model_file()))
    wordy = {f"note_{i}": "x" * 256 for i in range(16)}
    batch = [{"round": 0, "host": "a", "phase": "encode", "start": 1.0, "end": 2.0, **wordy}] * 700
    a.post_events(batch)  # about 3.3 MB: within the budget of 4 MiB a minute
    with pytest.raises(Refusal) as refused:
        a.post_events(batch)
    assert refused.value.reason is Reason.RATE_LIMITED and "more than 4194304 bytes" in str(refused.value)
    assert sum(1 for e in coord.events() if e["host"] == "a") == 700


def test_a_round_that_would_overflow_the_fp16_model_is_refused_and_changes_nothing(coordinator) -> None:
    named = [("w", torch.full((30, 20), 30000.0, dtype=torch.float16)), ("b", torch.zeros(20))]
    specs = spec_of(named)
    coord = coordinator(1)
    a = HttpClient(coord.url, host="a", retry_for=5)
    a.join([s.as_json() for s in specs])
    initial = a.put_model(memoryview(model_file(named)))
    huge = delta_message([torch.full((30, 20), 50000.0), torch.ones(20)], round_=0, host="a", base_hash=initial,
                         samples=4, specs=specs)  # finite, and fine in fp16 scales; but 30000 + 50000 is not fp16
    assert a.post_delta(0, huge.view()) is Upload.TAKEN
    reply = a.wait_sync(0)
    sync = Message.parse(body_bytes(reply.body))
    assert sync.meta.model_hash == sync.meta.base_hash == initial
    round_, served_hash, _, tensors = read_model(body_bytes(a.get_model()))
    assert (round_, served_hash) == (1, initial)
    assert all(torch.equal(x.view(-1).view(torch.uint8), t.view(-1).view(torch.uint8))
               for x, (_, t) in zip(tensors, named))
    refused = [e for e in coord.events() if e["phase"] == "sync_prepare" and e["round"] == 0]
    assert refused[0]["refused"] == "not finite: w" and refused[0]["model_hash"] == initial
    assert "round 0 refused" in coord.log_path.read_text()
    # the next round goes on from the unchanged model
    small = [torch.full((30, 20), 0.5), torch.ones(20)]
    message = delta_message(small, round_=1, host="a", base_hash=initial, samples=4, specs=specs)
    message.write_header(MessageMeta("delta", 1, "a", initial, samples=4))
    assert a.post_delta(1, message.view()) is Upload.TAKEN
    expected = expected_after_round([t for _, t in named], [(small, 4)])
    assert Message.parse(body_bytes(a.wait_sync(1).body)).meta.model_hash == model_hash(
        list(zip(["w", "b"], expected)))
