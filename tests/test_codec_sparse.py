"""The sparse codecs (``sparse``: 1%, ``sparse3``: 3%): the top-k round trip and its error bound, error feedback
carrying what a round did not send, the no-op sync, the sync of a round's deltas (exact support under averaging,
the top of a dense step under Nesterov) and its precision, malformed messages refused (in process and over HTTP),
a host's delta and sync through HostTensors, and a real run."""

from __future__ import annotations

import io
import json
import math
import re
import zlib

import pytest
import requests
import torch
from helpers import MODEL, SPECS, Coordinator, bits, body_bytes, codec_run, host_delta, model_file
from local_transport import LocalClient, LocalCoordinator

from lightning_nodeox.coordinator.model import CoordinatorModel
from lightning_nodeox.core import safetensors
from lightning_nodeox.core.codec import (
    accumulate_tensor,
    apply_sync,
    decode_tensor,
    encode_delta,
    encode_sync_and_apply,
)
from lightning_nodeox.core.codecs import codec_for
from lightning_nodeox.core.codecs.sparse import CHUNK, SCALE, Sparse
from lightning_nodeox.core.hashing import model_hash
from lightning_nodeox.core.pool import WorkerPool
from lightning_nodeox.core.protocol import CREDENTIAL_HEADER, OCTETS, Reason, Refusal, Upload
from lightning_nodeox.core.codecs.settings import CodecSettings, Q4Settings, SparseSettings
from lightning_nodeox.core.specs import PayloadError, spec_of
from lightning_nodeox.core.wire import MessageLayout, Message, MessageMeta
from lightning_nodeox.host.client import HttpClient
from lightning_nodeox.host.tensors import HostTensors

EARLIER = {"chunking": "runs", "levels": "q2", "error_decay": 1.0, "mean": "deltas"}  # the codec before SparseLoCo's
SPARSE = SparseSettings(density=0.01, **EARLIER)  # recipe (tests/test_sparseloco.py tests the recipe's knobs)
SPARSE3 = SparseSettings(density=0.03, **EARLIER)
EARLIER_FLAGS = ("--codec", "sparse", "--density", "0.01", "--chunking", "runs", "--levels", "q2", "--error-decay", "1",
                 "--mean", "deltas")
SIZES = [1, 3, 10, 4095, 4096, 5000, 3 * CHUNK + 17]
INTS = {2: torch.int16, 4: torch.int32}


def kernels(settings: CodecSettings):
    return codec_for(settings).kernels("cpu", 2 * CHUNK)  # a tensor of three chunks crosses a call's boundary


def views(codec: Sparse, n: int):
    """Fresh codes (as the kernels take them) and scales of a tensor of ``n`` values."""
    codes = codec.codes_view(torch.zeros(codec.code_bytes(n), dtype=torch.uint8), n)
    return codes, torch.zeros(codec.scale_count(n), dtype=codec.scale_dtype)


def chunk_spans(n: int):
    return [(s, min(n, s + CHUNK)) for s in range(0, n, CHUNK)]


def as_ints(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().view(-1).view(INTS[t.element_size()])


def is_minus_zero(t: torch.Tensor) -> torch.Tensor:
    return as_ints(t.float()) == as_ints(torch.tensor(-0.0))


@pytest.mark.parametrize("settings", [SPARSE, SPARSE3, SparseSettings(density=0.01, scale_dtype="fp32", **EARLIER)],
                         ids=["1%", "3%", "1% fp32 scales"])
@pytest.mark.parametrize("n", SIZES)
def test_a_delta_is_the_top_k_of_each_chunk_in_2_bits_and_the_residual_keeps_the_rest(settings, n: int) -> None:
    codec = codec_for(settings)
    x = torch.randn(n, generator=torch.Generator().manual_seed(n)) * torch.linspace(0.1, 3, n)
    codes, scales = views(codec, n)
    residual = torch.zeros(n)
    encode_delta(kernels(settings), x, torch.zeros(n), residual, codes, scales)
    decoded = torch.empty(n)
    decode_tensor(kernels(settings), codes, scales, decoded)
    assert torch.equal(residual, x - decoded)  # exactly what was not sent
    at, indices = 0, codes.indices()
    for c, (s, e) in enumerate(chunk_spans(n)):
        m, v = e - s, x[s:e]
        k = min(m, math.ceil(codec.density * m))
        index = indices[at : at + k]
        at += k
        assert sorted(index.tolist()) == sorted(torch.topk(v.abs(), k).indices.tolist())
        sent = torch.zeros(m, dtype=torch.bool)
        sent[index] = True
        assert is_minus_zero(decoded[s:e][~sent]).all()
        # the definition: q2's codes of s0 = 0.7 mean|v|, the least-squares scale of those codes
        chosen = v[index]
        s0 = chosen.abs().mean() * SCALE
        level = (torch.round(chosen / (2 * s0) + 1.5).clamp(0, 3) * 2 - 3)
        s_ls = (chosen * level).sum() / (level * level).sum()
        assert float(scales[c]) == float(s_ls.to(codec.scale_dtype))
        assert torch.equal(decoded[s:e][index], level * float(scales[c]))
        # the bound of the docstring: the least-squares scale does no worse than s0's
        d0 = level * s0
        assert (chosen - d0).abs().le(torch.maximum(s0.expand_as(chosen), chosen.abs() - 3 * s0) * (1 + 1e-6)).all()
        slack = 1e-3 * chosen.norm() if settings.scale_dtype == "fp16" else 1e-5 * chosen.norm()
        assert (chosen - decoded[s:e][index]).norm() <= (chosen - d0).norm() + slack
    assert at == indices.numel()
    kept = torch.zeros(n, dtype=torch.bfloat16)  # a host keeps its residual in bf16: x - decoded, rounded once
    encode_delta(kernels(settings), x, torch.zeros(n), kept, *views(codec, n))
    assert torch.equal(kept, (x - decoded).to(torch.bfloat16))


def test_stochastic_rounding_is_refused_naming_the_fix() -> None:
    with pytest.raises(ValueError, match="codec 'sparse' rounds to nearest only: use rounding='nearest'"):
        codec_for(SPARSE3).check_rounding("stochastic")


@pytest.mark.parametrize("entries", [1, 2, 41, 123, 4096])
def test_indices_pack_two_in_three_bytes(entries: int) -> None:
    codec = codec_for(SPARSE).at_capacity(min(entries, CHUNK))
    n = 2 * CHUNK
    codes, _ = views(codec, n)
    gen = torch.Generator().manual_seed(entries)
    indices = torch.cat([torch.randperm(CHUNK, generator=gen)[:entries] for _ in range(2)])
    indices[:2] = torch.tensor([0, CHUNK - 1])[: min(2, entries)]
    codes.write_indices(indices)
    assert codes.index.numel() == 2 * 3 * -(-entries // 2) and torch.equal(codes.indices(), indices)


def test_bytes_per_value_at_each_density_against_q4() -> None:
    n = 1 << 20
    q4 = codec_for(Q4Settings())
    q4_bytes = q4.code_bytes(n) + 2 * q4.scale_count(n)
    ratios = {}
    for settings in (SPARSE, SPARSE3):
        codec = codec_for(settings)
        ratios[settings.density] = (codec.code_bytes(n) + 2 * codec.scale_count(n)) / q4_bytes
    assert codec_for(SPARSE).k == 41 and codec_for(SPARSE3).k == 123
    # a full chunk: 41 indices of 12 bits (21 pairs of 3 bytes), 41 codes of 2 bits (11 bytes), one fp16 scale
    assert (256 * (3 * 21 + 11 + 2)) / q4_bytes == pytest.approx(ratios[0.01], rel=1e-3)
    assert (256 * (3 * 62 + 31 + 2)) / q4_bytes == pytest.approx(ratios[0.03], rel=1e-3)
    assert 0.034 < ratios[0.01] < 0.036 and 0.10 < ratios[0.03] < 0.101


@pytest.mark.parametrize("feedback", [True, False])
def test_error_feedback_carries_the_values_a_round_did_not_send(feedback: bool) -> None:
    """The same x every round: with error feedback the decoded values add up to r x, short of it by the residual
    alone (at most what waits for its turn); without, they stay 1% of it."""
    n = 2 * CHUNK
    x = torch.randn(n, generator=torch.Generator().manual_seed(3))
    codec, k = codec_for(SPARSE), kernels(SPARSE)
    residual = torch.zeros(n) if feedback else None
    total, decoded = torch.zeros(n), torch.empty(n)
    errors = {}
    for r in range(1, 401):
        codes, scales = views(codec, n)
        encode_delta(k, x, torch.zeros(n), residual, codes, scales)
        decode_tensor(k, codes, scales, decoded)
        total += decoded
        if r in (100, 400):
            errors[r] = float((total - r * x).norm() / (r * x).norm())
            if feedback:
                assert torch.allclose(total, r * x - residual, atol=1e-3)
    if feedback:
        assert errors[400] < 0.15 and errors[400] < 0.5 * errors[100]
    else:
        assert errors[400] > 0.8


@pytest.mark.parametrize("feedback", [True, False])
def test_a_host_keeps_a_residual_only_with_error_feedback(feedback: bool) -> None:
    """``NodeoxStrategy(error_feedback=False)`` reaches the codec as it does every codec's: no residual kept."""
    as_run, parts = host_delta(SPARSE, error_feedback=feedback, in_features=300, k=kernels(SPARSE))
    assert as_run and (parts is None) == (not feedback)
    for delta, sent, residual in parts or []:
        n = delta.numel()
        assert (sent != 0).sum() == math.ceil(0.01 * 4096) * (n // CHUNK) + math.ceil(0.01 * (n % CHUNK))
        assert torch.equal(residual, (delta - sent).to(torch.bfloat16))


@pytest.mark.parametrize("capacity", [None, 1, 82, CHUNK], ids=["delta", "sync 1", "sync 82", "sync 4096"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_noop_sync_changes_no_bit_of_any_model(capacity, dtype: torch.dtype) -> None:
    codec = codec_for(SPARSE) if capacity is None else codec_for(SPARSE).at_capacity(capacity)
    n = 5000
    info = torch.finfo(dtype)
    values = torch.randn(n, generator=torch.Generator().manual_seed(1)).to(dtype)
    values[:6] = torch.tensor([0.0, -0.0, info.smallest_normal, -info.smallest_normal, info.max, -info.max]).to(dtype)
    values[-30:] = 0.0
    codes, scales = views(codec, n)
    codec.fill_noop(codes, scales)
    decoded = torch.empty(n)
    decode_tensor(kernels(SPARSE), codes, scales, decoded)
    assert is_minus_zero(decoded).all()
    base, target = values.clone(), torch.empty_like(values)
    apply_sync(kernels(SPARSE), codes, scales, base, target)
    assert torch.equal(as_ints(target), as_ints(values)) and torch.equal(as_ints(base), as_ints(values))
    assert codec.magnitude(codes, scales) == 0.0 and codec.malformed(codes, scales, n) is None


def round_of(settings: CodecSettings, n: int, hosts: int, seed: int = 0):
    """``hosts`` deltas of a tensor of ``n`` values, accumulated by their samples: (mean, codes of each)."""
    gen = torch.Generator().manual_seed(seed)
    codec, k = codec_for(settings), kernels(settings)
    acc, weights = torch.zeros(n), [10 * (h + 1) for h in range(hosts)]
    for h, w in enumerate(weights):
        codes, scales = views(codec, n)
        encode_delta(k, torch.randn(n, generator=gen) * 0.01, torch.zeros(n), None, codes, scales)
        accumulate_tensor(k, codes, scales, acc, float(w), assign=h == 0)
    return acc, 1 / sum(weights)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hosts", [1, 3])
def test_the_sync_of_a_round_carries_the_mean_whole_and_every_host_reaches_the_coordinators_bytes(dtype, hosts) -> None:
    n = 3 * CHUNK + 900
    codec = codec_for(SPARSE)
    acc, inverse = round_of(SPARSE, n, hosts)
    mean = acc * inverse
    capacity = codec.sync_capacity(hosts)
    assert capacity == hosts * codec.k
    sync = codec.at_capacity(capacity)
    codes, scales = views(sync, n)
    model = torch.randn(n, generator=torch.Generator().manual_seed(5)).to(dtype)
    coordinator = model.clone()
    encode_sync_and_apply(kernels(SPARSE), acc, inverse, coordinator, codes, scales)
    decoded = torch.empty(n)
    decode_tensor(kernels(SPARSE), codes, scales, decoded)
    assert ((mean != 0) <= (decoded != 0)).all()  # every value the deltas moved is in the sync
    assert (decoded != 0).sum() <= (mean != 0).sum()
    for c, (s, e) in enumerate(chunk_spans(n)):  # fp16 values of one scale a chunk: 2^-11 relative, 2^-25 s below
        err = (decoded[s:e] - mean[s:e]).abs()
        assert (err <= mean[s:e].abs() * 2**-10 + float(scales[c].float()) * 2**-23).all()
        assert torch.equal(decoded[s:e] == 0, mean[s:e] == 0)
    host_base, host_live = model.clone(), model.clone()
    apply_sync(kernels(SPARSE), codes, scales, host_base, host_live)
    assert torch.equal(bits(host_live), bits(coordinator)) and torch.equal(bits(host_base), bits(coordinator))
    untouched = mean == 0
    assert torch.equal(as_ints(coordinator[untouched]), as_ints(model[untouched]))  # -0.0 added: the same bits


def test_a_dense_step_keeps_its_top_capacity_values_a_chunk() -> None:
    """Nesterov's step is dense: the sync keeps the largest ``capacity`` values of each chunk."""
    n = CHUNK + 1000
    sync = codec_for(SPARSE).at_capacity(82)
    step = torch.randn(n, generator=torch.Generator().manual_seed(8))
    codes, scales = views(sync, n)
    encode_sync_and_apply(kernels(SPARSE), step, 1.0, torch.zeros(n), codes, scales)
    decoded = torch.empty(n)
    decode_tensor(kernels(SPARSE), codes, scales, decoded)
    for (s, e), kept in zip(chunk_spans(n), (82, 20)):  # a last chunk of 1000: 82 * 10 / 41
        top = set(torch.topk(step[s:e].abs(), kept).indices.tolist())
        assert set(torch.nonzero(decoded[s:e]).view(-1).tolist()) == top


# Messages: the header's capacity, and what is refused

NAMED = [("w", torch.zeros(5000)), ("b", torch.zeros(3, 7)), ("steps", torch.zeros(3, dtype=torch.int64))]
NAMED_SPECS = spec_of(NAMED)


def sync_message(capacity: int, specs=NAMED_SPECS) -> Message:
    message = Message.allocate(MessageLayout.of(specs, SPARSE, capacity=capacity))
    codec = message.layout.codec
    for j, spec in enumerate(specs):
        if spec.raw:
            message.raw(j).zero_()
        else:
            codec.fill_noop(message.codes(j), message.scales(j))
    message.write_header(MessageMeta("sync", 3, "coordinator", "0" * 32, samples=5, model_hash="a" * 32))
    return message


def with_metadata(data: bytes, **changes: str | None) -> bytes:
    """``data`` with its header's metadata changed (None: a key removed; the same reserved size) and its header
    CRC made right again."""
    head_bytes, data_start = safetensors.split(data, "payload")
    header = json.loads(head_bytes)
    for key, value in changes.items():
        if value is None:
            del header["__metadata__"][key]
        else:
            header["__metadata__"][key] = value
    header["__metadata__"]["crc32"] = "00000000"
    text = json.dumps(header, separators=(",", ":")).encode()
    framed = bytearray(safetensors.frame(text, reserve=data_start - safetensors.PREFIX_BYTES))
    pos = framed.index(b'"crc32":"') + len(b'"crc32":"')
    framed[pos : pos + 8] = f"{zlib.crc32(framed):08x}".encode()
    return bytes(framed) + data[data_start:]


def bad_index(message: Message, value: int) -> bytes:
    message = Message.parse(bytes(message.view()))
    codes = message.codes(0)
    indices = codes.indices()
    indices[-1] = value  # the last chunk of "w" holds 904 values
    codes.write_indices(indices)
    message.write_header(message.meta)
    return bytes(message.view())


def test_a_sync_says_its_capacity_and_its_layout_follows() -> None:
    specs = spec_of(NAMED)
    for capacity in (1, 82, CHUNK):
        message = sync_message(capacity)
        parsed = Message.parse(bytes(message.view()))
        assert parsed.meta.capacity == capacity == parsed.layout.capacity and parsed.meta.model_hash == "a" * 32
        w = parsed.codes(0)
        assert w.indices().numel() == min(CHUNK, capacity) + min(904, -(-capacity * 10 // 41))
    small, large = (MessageLayout.of(specs, SPARSE, capacity=c).total for c in (41, 82))
    delta = MessageLayout.of(specs, SPARSE)
    assert delta.capacity is None and Message.allocate(delta).meta.capacity == 41
    assert delta.total < small < large


BAD_SYNCS = {  # name: (bytes, what the error says)
    "capacity 0": (lambda: with_metadata(bytes(sync_message(82).view()), capacity="0"),
                   "a sparse sync's capacity is in [1, 4096], got 0"),
    "capacity above C": (lambda: with_metadata(bytes(sync_message(82).view()), capacity="5000"),
                         "a sparse sync's capacity is in [1, 4096], got 5000"),
    "offsets not its capacity's": (lambda: with_metadata(bytes(sync_message(82).view()), capacity="60"),
                                   "payload is truncated or has trailing bytes"),
    "no capacity": (lambda: with_metadata(bytes(sync_message(82).view()), capacity=None), "says no capacity"),
    "an index beyond its chunk": (lambda: bad_index(sync_message(82), 904), "has an index outside its chunk"),
    "an index twice in a chunk": (lambda: bad_index(sync_message(82), 0), "has an index twice in one chunk"),
    "a truncated piece": (lambda: bytes(sync_message(82).view())[:-48], "payload is truncated"),
}


@pytest.mark.parametrize("name", BAD_SYNCS)
def test_a_malformed_sync_is_refused_naming_why(name: str) -> None:
    make, text = BAD_SYNCS[name]
    with pytest.raises(PayloadError, match=re.escape(text)):
        Message.parse(make())


def test_a_header_whose_offsets_disagree_with_its_capacity_is_refused_as_it_streams() -> None:
    data = with_metadata(bytes(sync_message(82).view()), capacity="60")
    _, start = safetensors.split(data, "payload")
    with pytest.raises(PayloadError, match="missing or has the wrong dtype or offsets|takes .* bytes"):
        Message.read_head(data[:start])


# Deltas over the coordinator's own checks (the in-process transport)

_gen = torch.Generator().manual_seed(9)
GOOD_A = [torch.randn(t.shape, generator=_gen) * 0.01 for _, t in MODEL]
GOOD_B = [torch.randn(t.shape, generator=_gen) * 0.01 for _, t in MODEL]


def sparse_delta(host: str, base: str, values=GOOD_B, settings: CodecSettings = SPARSE, samples: int = 10,
                 specs=SPECS) -> Message:
    message = Message.allocate(MessageLayout.of(specs, settings))
    k = kernels(settings)
    for j, v in enumerate(values):
        n = v.numel()
        encode_delta(k, v.reshape(-1).float(), torch.zeros(n), None, message.codes(j), message.scales(j))
    message.write_header(MessageMeta("delta", 0, host, base, samples=samples))
    return message


def expected_sync(model, contributions, capacity: int) -> list[torch.Tensor]:
    """The model after a round of the sparse deltas ``contributions`` ((message, samples) each)."""
    total = sum(w for _, w in contributions)
    sync, k = codec_for(SPARSE).at_capacity(capacity), kernels(SPARSE)
    out = []
    for j, t in enumerate(model):
        acc = torch.zeros(t.numel())
        for h, (message, w) in enumerate(contributions):
            accumulate_tensor(k, message.codes(j), message.scales(j), acc, float(w), assign=h == 0)
        new = t.clone().view(-1)
        encode_sync_and_apply(k, acc, 1 / total, new, *views(sync, t.numel()))
        out.append(new.view(t.shape))
    return out


def flipped(data: bytearray) -> bytearray:
    data[-3] ^= 0x40
    return data


def bad_delta_index(base: str) -> bytearray:
    message = sparse_delta("b", base)
    codes = message.codes(0)
    indices = codes.indices()
    indices[0] = 1200  # fc.weight: one chunk of 1200 values
    codes.write_indices(indices)
    message.write_header(message.meta)
    return bytearray(message.view())


BAD_DELTAS = {  # name: (body, what the refusal says)
    "truncated": (lambda b: bytearray(sparse_delta("b", b).view())[:-16], "bytes for the tensors its header names"),
    "one flipped byte": (lambda b: flipped(bytearray(sparse_delta("b", b).view())), "integrity check"),
    "an index outside its chunk": (bad_delta_index, "payload tensor 'fc.weight' has an index outside its chunk"),
    "another capacity": (lambda b: bytearray(with_metadata(bytes(sparse_delta("b", b).view()), capacity="42")),
                         "payload is a sparse delta of capacity 42; its codec sends 41 values a chunk"),
    "a sparse3 delta": (lambda b: bytearray(sparse_delta("b", b, GOOD_B[1:], SPARSE3, specs=SPECS[1:]).view()),
                        "payload uses sparse (density 0.03, scale_dtype fp16, chunking runs, levels q2, error_decay 1.0, "
                        "mean deltas); "
                        "this run uses sparse (density 0.01,"),
}


def test_malformed_sparse_deltas_are_refused_and_the_round_keeps_what_it_took(tmp_path) -> None:
    """Host a's delta, then every bad one of host b (each refused, naming why), then b's good delta: the published
    sync has the capacity of two deltas and the model is exactly the one computed here."""
    c = LocalCoordinator(tmp_path, 2, codec=SPARSE)
    try:
        a, b = LocalClient(c, "a"), LocalClient(c, "b")
        tensors = [s.as_json() for s in SPECS]
        assert a.join(tensors).provide_model
        initial = a.put_model(io.BytesIO(model_file()))
        assert b.join(tensors).model_hash == initial == model_hash(MODEL)
        good_a = sparse_delta("a", initial, GOOD_A, samples=30)
        assert a.post_delta(0, memoryview(bytearray(good_a.view()))) is Upload.TAKEN
        for name, (body, text) in BAD_DELTAS.items():
            with pytest.raises(Refusal) as refused:
                b.post_delta(0, memoryview(body(initial)))
            assert refused.value.reason is Reason.INVALID and text in str(refused.value), (name, str(refused.value))
            assert c.rounds.received == {"a": 30}, name
        good_b = sparse_delta("b", initial)
        b.post_delta(0, memoryview(bytearray(good_b.view())))
        sync = Message.parse(body_bytes(b.wait_sync(0).body))
        assert sync.meta.codec == SPARSE and sync.meta.capacity == 82 == sync.layout.capacity
        assert len(sync) == MessageLayout.of(SPECS, SPARSE, capacity=82).total
        after = expected_sync([t for _, t in MODEL], [(good_a, 30), (good_b, 10)], 82)
        assert sync.meta.model_hash == model_hash([(n, t) for (n, _), t in zip(MODEL, after)]) == c.rounds.model.hash
    finally:
        c.close()


@pytest.mark.slow
def test_a_real_run_with_sparse_keeps_hosts_bit_identical(tmp_path) -> None:
    """``nodeox launch`` with the codec's earlier form: two digits hosts, host 1 without error feedback; after every
    round both hold the published model bit for bit, each upload is the delta layout's size and each sync the size
    of a sync of two deltas."""
    events, named, _ = codec_run(tmp_path, *EARLIER_FLAGS)
    specs = spec_of(named)
    assert {e["bytes"] for e in events if e["phase"] == "upload"} == {MessageLayout.of(specs, SPARSE).total}
    assert {e["bytes"] for e in events if e["phase"] == "sync_prepare"} == {
        MessageLayout.of(specs, SPARSE, capacity=82).total}
    q4 = MessageLayout.of(specs, Q4Settings())
    assert MessageLayout.of(specs, SPARSE).total - q4.data_start < 0.1 * (q4.total - q4.data_start)


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"))]


@pytest.mark.parametrize("device", DEVICES)
def test_a_host_encodes_a_delta_the_coordinator_takes_and_applies_its_sync_to_the_coordinators_hash(device) -> None:
    """Through HostTensors (on a GPU: its staging areas; a sync of two deltas outgrows the delta's) and the
    coordinator's model: the host's delta is the codec's, and the sync applied by the host reaches the
    coordinator's bytes and hash, on every dtype."""
    gen = torch.Generator().manual_seed(4)
    named = [("w", torch.randn(3 * CHUNK + 5, generator=gen)), ("h", torch.randn(40, 30, generator=gen).half()),
             ("b", torch.randn(70, generator=gen).bfloat16()), ("steps", torch.tensor([3, 4]))]
    pool = WorkerPool(SPARSE, "cpu", 2)
    host = HostTensors([(n, t.clone().to(device)) for n, t in named])
    host.allocate(SPARSE, codec_threads=1)
    try:
        coordinator = CoordinatorModel(spec_of(named), [t.clone() for _, t in named], SPARSE, pool)
        with torch.no_grad():
            for t in host.live:
                if t.is_floating_point():
                    t.add_(torch.randn(t.shape, generator=gen).to(t.dtype).to(device) * 0.01)
        reader = host.encode(host.live, MessageMeta("delta", 0, "h", coordinator.hash, samples=8), None)
        delta = Message.parse(bytes(reader.join().view()))
        assert len(delta) == MessageLayout.of(spec_of(named), SPARSE).total and delta.meta.capacity == 41
        cpu = [t.cpu() for t in host.live]
        expected = sparse_delta("x", "", [c.float() - b.float() for c, b in zip(cpu, (t for _, t in named))][:3],
                                specs=spec_of(named)[:3])
        if device == "cpu":  # the same codes as the reference encoder (a GPU's top-k may break ties otherwise)
            for j in range(3):
                assert torch.equal(delta.codes(j).indices(), expected.codes(j).indices())
        coordinator.accumulate(delta, 8)
        other = sparse_delta("o", "", [torch.randn(t.shape, generator=gen) * 0.01 for _, t in named[:3]],
                             specs=spec_of(named)[:3])
        coordinator.accumulate(other, 8)
        assert coordinator.deltas == 2
        closed = coordinator.close_round(0)
        assert closed.sync.meta.capacity == 82 and len(closed.sync) > len(delta)
        sync = Message.parse(closed.sync.buffer.clone())
        hashers = host.apply(sync, into_live=True)
        assert host.digest(hashers) == coordinator.hash == sync.meta.model_hash
        for t, c in zip(host.live, coordinator.tensors):
            assert torch.equal(bits(t.cpu()) if t.is_floating_point() else t.cpu(),
                               bits(c) if c.is_floating_point() else c)
    finally:
        host.close()
        pool.close()


@pytest.mark.slow
def test_malformed_sparse_deltas_over_http_get_400_and_the_round_keeps_what_it_took(tmp_path) -> None:
    """The rows of BAD_DELTAS against a real ``nodeox coordinator --codec sparse``: each a 400 with its JSON error and
    reason; the round then publishes the model of host a's and host b's good deltas."""
    coord = Coordinator(tmp_path / "run", 2, *EARLIER_FLAGS)
    try:
        a, b = HttpClient(coord.url, host="a", retry_for=5), HttpClient(coord.url, host="b", retry_for=5)
        tensors = [s.as_json() for s in SPECS]
        assert a.join(tensors).provide_model
        initial = a.put_model(memoryview(model_file()))
        credential = b.join(tensors).credential
        good_a = sparse_delta("a", initial, GOOD_A, samples=30)
        assert a.post_delta(0, memoryview(bytearray(good_a.view()))) is Upload.TAKEN
        for name, (body, text) in BAD_DELTAS.items():
            answer = requests.post(f"{coord.url}/v1/rounds/0/delta", params={"host": "b"}, data=bytes(body(initial)),
                                   headers={"Content-Type": OCTETS, CREDENTIAL_HEADER: credential}, timeout=30)
            assert answer.status_code == 400 and text in answer.json()["error"], (name, answer.text)
            assert answer.json()["reason"] == "invalid", name
        good_b = sparse_delta("b", initial)
        assert b.post_delta(0, memoryview(bytearray(good_b.view()))) is Upload.TAKEN
        sync = Message.parse(body_bytes(b.wait_sync(0).body))
        after = expected_sync([t for _, t in MODEL], [(good_a, 30), (good_b, 10)], 82)
        assert sync.meta.capacity == 82 and sync.meta.model_hash == model_hash(
            [(n, t) for (n, _), t in zip(MODEL, after)])
    finally:
        coord.stop()
