"""The exchange streamed piece by piece (docs/design.md, "Streaming"): what a bad piece, a delta that stops
half-way, a piece whose result would not be finite and a sync download that breaks off do to a round. In each,
the round's result is the one the rule says, every host ends bit-identical, and nothing of the round outlives it.

Pieces are made small (``NODEOX_PIECE_BYTES``) so that a small model has several."""

from __future__ import annotations

import gc
import threading
import time

import pytest
import requests
import torch
from helpers import (
    assert_on_the_run_model,
    bits,
    body_bytes,
    delta_message,
    expected_after_round,
    model,
    model_file,
    raw_request,
    train,
    upload,
)
from helpers import (
    hosts as joined_hosts,
)

from lightning_nodeox.core.hashing import model_hash
from lightning_nodeox.core.modelfile import read_model
from lightning_nodeox.core.protocol import CREDENTIAL_HEADER, SyncReady, Upload
from lightning_nodeox.core.specs import PayloadError, spec_of
from lightning_nodeox.core.streaming import MessageReader
from lightning_nodeox.core.wire import Message
from lightning_nodeox.core.phases import PhaseLog
from lightning_nodeox.host.client import HttpClient
from lightning_nodeox.host.round import HostRound
from lightning_nodeox.host.tensors import HostTensors
from local_transport import LocalClient

PIECE = 1024
NAMED = [(f"t{i}", torch.randn(32, 32, generator=torch.Generator().manual_seed(i))) for i in range(6)]
SPECS = spec_of(NAMED)


@pytest.fixture
def small_pieces(monkeypatch):
    monkeypatch.setenv("NODEOX_PIECE_BYTES", str(PIECE))


def deltas_of(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + seed)
    return [torch.randn(t.shape, generator=gen) * 0.01 for _, t in NAMED]


# -- pieces and their reader, in this process ------------------------------------------------------------------------

def test_a_message_of_small_pieces_checks_each_piece_alone(small_pieces) -> None:
    message = delta_message(deltas_of(0), host="a", samples=8, specs=SPECS)
    pieces = message.layout.pieces
    assert [(p.first, p.stop) for p in pieces] == [(0, 2), (2, 4), (4, 6)]  # 544 bytes a tensor: two a piece
    data = bytearray(message.view())
    data[message.layout.data_start + pieces[1].data[0] + 3] ^= 0x01
    corrupted = Message.read_head(bytes(data[: message.layout.data_start]),
                                    torch.frombuffer(data, dtype=torch.uint8), total=len(data))
    corrupted.check_piece(0)  # the others pass on their own
    corrupted.check_piece(2)
    with pytest.raises(PayloadError, match="piece 1 failed its integrity check"):
        corrupted.check_piece(1)


def test_a_reader_gives_each_piece_once_sealed_and_the_makers_error(small_pieces) -> None:
    message = delta_message(deltas_of(0), host="a", samples=8, specs=SPECS)
    reader = MessageReader(message)
    gates = [threading.Event(), threading.Event()]

    def make(k: int) -> None:
        if k < 2:
            gates[k].wait(10)
        else:
            raise ValueError("diverged")

    reader.produce(make, lambda: None)
    pieces, start = message.layout.pieces, message.layout.data_start
    assert len(bytes(reader.read(1 << 20))) == start  # the header at once
    gates[0].set()
    assert len(bytes(reader.read(1 << 20))) == pieces[0].end  # piece 0, once sealed
    gates[1].set()
    assert len(bytes(reader.read(1 << 20))) == pieces[1].end - pieces[0].end
    with pytest.raises(ValueError, match="diverged"):
        reader.read(1 << 20)  # piece 2 failed: the upload is cut there
    with pytest.raises(ValueError, match="diverged"):
        reader.join()


# -- a real coordinator over HTTP ------------------------------------------------------------------------------------

@pytest.mark.slow
def test_a_bad_piece_and_a_delta_that_stops_half_way_keep_what_was_taken(coordinator, small_pieces) -> None:
    """Round 0: b's piece 1 is corrupted, c stalls after its piece 0, a's delta is whole. Rule: pieces
    taken stay, the rest of a cut delta is dropped: t0, t1 are the mean of a, b and c; t2..t5 are a's alone. Round
    1 then goes on as usual, and the coordinator holds no upload of round 0 afterwards."""
    coord = coordinator(3, "--transfer-timeout", "2")
    clients = {h: HttpClient(coord.url, host=h, retry_for=20) for h in "abc"}
    specs_json = [s.as_json() for s in SPECS]
    clients["a"].join(specs_json)
    initial = clients["a"].put_model(memoryview(model_file(NAMED)))
    for h in "bc":
        clients[h].join(specs_json)
    samples = {"a": 8, "b": 24, "c": 16}
    sent = {h: delta_message(deltas_of(i), host=h, base_hash=initial, samples=samples[h], specs=SPECS)
            for i, h in enumerate("abc")}

    bad = bytearray(sent["b"].view())
    bad[sent["b"].layout.data_start + sent["b"].layout.pieces[1].data[0] + 5] ^= 0x40
    assert clients["b"].post_delta(0, memoryview(bad)) is Upload.LATE  # told: cut, apply the sync
    assert clients["b"].post_delta(0, memoryview(bad)) is Upload.LATE  # and again, when it sends it again

    c = sent["c"]
    half = bytes(c.view()[: c.wire_end(0) + 100])
    sock = raw_request(coord.url, f"POST /v1/rounds/0/delta?host=c HTTP/1.1\r\nHost: x\r\n{CREDENTIAL_HEADER}: "
                                  f"{clients['c'].credential}\r\nContent-Type: application/octet-stream\r\n"
                                  f"Content-Length: {len(c)}\r\n\r\n")
    sock.sendall(half)  # c's VM paused half-way through its upload: the coordinator cuts it on its time limit
    deadline = time.monotonic() + 10
    while coord.log_path.read_text().count("was cut after 1 of its 3 pieces") < 2:
        assert time.monotonic() < deadline, coord.log_path.read_text()
        time.sleep(0.05)
    assert clients["a"].post_delta(0, sent["a"].view()) is Upload.TAKEN

    reply = clients["a"].wait_sync(0)
    assert isinstance(reply, SyncReady)
    sync = Message.parse(body_bytes(reply.body))
    model = [t for _, t in NAMED]
    everyone = expected_after_round(model, [(deltas_of(1), 24), (deltas_of(2), 16), (deltas_of(0), 8)])
    a_only = expected_after_round(model, [(deltas_of(0), 8)])
    expected = everyone[:2] + a_only[2:]
    assert sync.meta.model_hash == model_hash([(n, t) for (n, _), t in zip(NAMED, expected)])
    round_, served, _, tensors = read_model(body_bytes(clients["b"].get_model()))
    assert (round_, served) == (1, sync.meta.model_hash)
    assert all(torch.equal(got.view(-1), want.view(-1)) for got, want in zip(tensors, expected))

    sock.close()
    status = requests.get(f"{coord.url}/v1/status", timeout=10).json()
    assert status["uploads"] == 0 and status["round"] == 1
    for i, h in enumerate("abc"):  # round 1 as usual, from the model every host now holds
        d = delta_message(deltas_of(10 + i), round_=1, host=h, base_hash=served, samples=4, specs=SPECS)
        assert clients[h].post_delta(1, d.view()) is Upload.TAKEN
    after = [x for x in expected]
    final = expected_after_round(after, [(deltas_of(10), 4), (deltas_of(11), 4), (deltas_of(12), 4)])
    assert Message.parse(body_bytes(clients["c"].wait_sync(1).body)).meta.model_hash == model_hash(
        [(n, t) for (n, _), t in zip(NAMED, final)])


# -- hosts in this process -----------------------------------------------------------------------------------------

@pytest.fixture
def tiny_pieces(monkeypatch):
    monkeypatch.setenv("NODEOX_PIECE_BYTES", str(PIECE))  # helpers.model: w (50x40) is one piece, b and norm another


def test_a_sync_download_that_breaks_off_resumes_without_applying_a_piece_twice(local_coordinator,
                                                                                  tiny_pieces) -> None:
    c = local_coordinator()
    a, b = joined_hosts(c, "a", "b")
    applied = []
    apply_piece = b.tensors.apply_piece

    def counted(applying, k):
        applied.append(k)
        apply_piece(applying, k)

    b.tensors.apply_piece = counted
    for h in (a, b):
        train(h, 0)
        upload(h)
    b.client.break_next_sync = True  # b's download ends half-way, after its first piece
    assert a.synchronize().contributed and b.synchronize().contributed
    assert sorted(applied) == [0, 1]  # each piece once: the retry skipped the piece applied
    assert_on_the_run_model(c, a, b)


def test_a_piece_whose_result_is_not_finite_is_refused_alone(local_coordinator, tiny_pieces) -> None:
    """An fp16 model whose ``b`` is at 30000: b's change of +50000 (sent as is) overflows it. Its piece (b, norm) is refused,
    θ keeps its bits there; piece 0 (w) applies; both hosts end on the coordinator's model."""
    c = local_coordinator()
    named = [(n, t.half()) for n, t in model(seed=0)]
    named[1] = ("b", torch.full((50,), 30000.0, dtype=torch.float16))
    a, b = (HostRound(HostTensors([(n, t.clone()) for n, t in named]), LocalClient(c, h), PhaseLog(h)) for h in "ab")
    for h in (a, b):
        h.join()
    model_ = c.rounds.model
    assert len(model_.layout.pieces) == 2
    train(a, 0)
    before = [t.clone() for t in model_.tensors]
    upload(a)
    crafted = [torch.full((50, 40), 0.01), torch.full((50,), 50000.0), torch.zeros(50)]  # finite, fp16 scales fit
    assert b.client.post_delta(0, delta_message(crafted, host="b", base_hash=b.model_hash, samples=80,
                                                specs=spec_of(named)).view()) is Upload.TAKEN
    for h in (a, b):
        assert h.synchronize().contributed
    assert not torch.equal(model_.tensors[0], before[0])  # piece 0 applied
    assert all(torch.equal(bits(model_.tensors[i]), bits(before[i])) for i in (1, 2))  # piece 1 refused alone
    assert all(torch.isfinite(t).all() for t in model_.tensors)
    assert_on_the_run_model(c, a, b)


def test_nothing_of_a_cut_delta_outlives_its_round(local_coordinator, tiny_pieces) -> None:
    c = local_coordinator()
    a, b = joined_hosts(c, "a", "b")
    counts = []
    for r in range(4):
        for h in (a, b):
            train(h, r)
        upload(a)
        message = b.encode(b.tensors.live, 8, False).join()
        data = bytearray(message.view())
        if r >= 2:  # rounds 2 and 3: b's piece 1 is corrupted
            data[message.layout.data_start + message.layout.pieces[1].data[0]] ^= 0x01
        assert b.client.post_delta(r, memoryview(data)) is (Upload.LATE if r >= 2 else Upload.TAKEN)
        del message, data
        assert a.synchronize().contributed and b.synchronize().contributed
        assert_on_the_run_model(c, a, b)
        gc.collect()
        counts.append(sum(isinstance(o, Message) for o in gc.get_objects()))
    # as many messages alive after a cut round as after a whole one (from round 1 on: both syncs exist)
    assert counts[1] == counts[2] == counts[3], counts
