"""The q4 wire format: round trip, safetensors compatibility, and one clear error for every bad payload."""

from __future__ import annotations

import struct

import pytest
import torch
from helpers import encoded
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load as safetensors_load

from lightning_nodeox.core.modelfile import model_header, read_model
from lightning_nodeox.core.codecs.settings import CodecSettings, Q4Settings
from lightning_nodeox.core.specs import PayloadError, TensorSpec, check_same_model, spec_of
from lightning_nodeox.core.wire import VERSION, Message, MessageMeta, fit_metrics

NAMED = [("layer.weight", torch.randn(33, 7)), ("layer.bias", torch.randn(33)), ("bn.running_var", torch.rand(5))]


def make_message(named=NAMED, settings: CodecSettings = Q4Settings(), **meta) -> Message:
    message = encoded([t for _, t in named], spec_of(named), settings)
    fields = dict(kind="delta", round=3, host="7", base_hash="ab" * 16, samples=96) | meta
    message.write_header(MessageMeta(**fields))
    return message


def test_round_trip_and_metadata() -> None:
    message = make_message()
    parsed = Message.parse(bytes(message.view()))
    assert (parsed.meta.kind, parsed.meta.round, parsed.meta.host, parsed.meta.samples) == ("delta", 3, "7", 96)
    assert parsed.meta.base_hash == "ab" * 16
    assert parsed.meta.tensors == spec_of(NAMED)
    for i in range(len(NAMED)):
        assert torch.equal(parsed.codes(i), message.codes(i))
        assert torch.equal(parsed.scales(i), message.scales(i))


def test_readable_by_safetensors() -> None:
    message = make_message()
    tensors = safetensors_load(bytes(message.view()))
    pieces = {f"__crc__/{k}" for k in range(len(message.layout.pieces))}
    assert set(tensors) == {f"{n}/{part}" for n, _ in NAMED for part in ("scales", "codes")} | pieces | {"__trailer__"}
    assert torch.equal(tensors["layer.bias/codes"], message.codes(1))


def test_header_rewrite_keeps_layout() -> None:
    message = make_message()
    size = len(message)
    message.write_header(MessageMeta("delta", 10**15, "x" * 64, "cd" * 16, samples=10**12, final=True))
    assert len(message) == size
    assert Message.parse(bytes(message.view())).meta.final


def corrupt(data: bytes, fn) -> bytes:
    buf = bytearray(data)
    fn(buf)
    return bytes(buf)


def rewrite_metadata(data: bytes, old: bytes, new: bytes) -> bytes:
    """Change header text in place (same length) without fixing the CRC."""
    assert len(old) == len(new) and old in data
    return data.replace(old, new, 1)


@pytest.mark.parametrize("case, pattern", [
    ("truncated", "truncated"),
    ("empty", "truncated"),
    ("bit_flip_data", "integrity"),
    ("bit_flip_header", "integrity|JSON|malformed"),
    ("wrong_version", "version 9"),
    ("huge_header_length", "truncated or corrupt"),
    ("trailing", "trailing"),
])
def test_bad_payloads_raise_payload_error(case: str, pattern: str) -> None:
    data = bytes(make_message().view())
    bad = {
        "truncated": lambda: data[:-10],
        "empty": lambda: b"",
        "bit_flip_data": lambda: corrupt(data, lambda b: b.__setitem__(len(b) - 5, b[len(b) - 5] ^ 0x10)),
        "bit_flip_header": lambda: corrupt(data, lambda b: b.__setitem__(20, b[20] ^ 0x01)),
        "wrong_version": lambda: rewrite_metadata(data, f'"version":"{VERSION}"'.encode(), b'"version":"9"'),
        "huge_header_length": lambda: struct.pack("<Q", 2**40) + data[8:],
        "trailing": lambda: data + b"\0" * 8,
    }[case]()
    with pytest.raises(PayloadError, match=pattern):
        Message.parse(bad)


def test_nan_scale_is_refused_even_with_a_valid_crc() -> None:
    message = make_message(settings=Q4Settings(scale_dtype="fp32"))
    message.scales(1)[0] = float("nan")
    message.write_header(message.meta)  # a sender that computed a correct CRC over a NaN scale
    with pytest.raises(PayloadError, match="NaN or Inf scales for tensor 'layer.bias'"):
        Message.parse(bytes(message.view()))


def test_wrong_shape_is_named() -> None:
    other = [("layer.weight", torch.randn(33, 8)), *NAMED[1:]]
    parsed = Message.parse(bytes(make_message(other).view()))
    with pytest.raises(PayloadError, match=r"'layer.weight' float32 \[33, 8\] does not match the model's"):
        check_same_model(spec_of(NAMED), parsed.meta.tensors, "delta")


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=4096))
def test_random_bytes_only_ever_raise_payload_error(data: bytes) -> None:
    with pytest.raises(PayloadError):
        Message.parse(data)


def test_the_crc32_has_one_spelling() -> None:
    """The header's own crc32 is not covered by itself: a digit spelled another way that reads as the same number
    (upper case hex, which the random byte changes below found once in CI) is refused too."""
    for round_ in range(50):  # a message whose crc32 has a letter in it
        data = bytes(make_message(round=round_).view())
        at = data.index(b'"crc32":"') + len(b'"crc32":"')
        letters = [k for k, digit in enumerate(data[at : at + 8]) if chr(digit).isalpha()]
        if letters:
            break
    assert letters
    Message.parse(data)
    for k in letters:
        changed = data[: at + k] + chr(data[at + k]).upper().encode() + data[at + k + 1 :]
        with pytest.raises(PayloadError, match="crc32 field is malformed"):
            Message.parse(changed)


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=0, max_value=2000), st.integers(min_value=0, max_value=255))
def test_any_single_byte_change_is_detected(position: int, value: int) -> None:
    data = bytes(make_message().view())
    position %= len(data)
    if data[position] == value:
        return
    changed = data[:position] + bytes([value]) + data[position + 1 :]
    try:
        Message.parse(changed)
    except PayloadError:
        return
    # only the header's padding (spaces after the JSON) may change without consequence
    assert changed[position] in b" \t\r\n" and data[position] in b" \t\r\n"


def test_model_file_round_trip_and_checks() -> None:
    specs = spec_of(NAMED)
    body = bytearray(model_header(specs, 5, "ff" * 16))
    for _, t in NAMED:
        body += t.numpy().tobytes()
    round_, model_hash, got_specs, tensors = read_model(torch.frombuffer(body, dtype=torch.uint8))
    assert (round_, model_hash, got_specs) == (5, "ff" * 16, specs)
    assert all(torch.equal(a, b) for a, (_, b) in zip(tensors, NAMED))
    with pytest.raises(PayloadError, match="bytes but its header describes"):
        read_model(torch.frombuffer(body[:-4], dtype=torch.uint8))


def test_spec_of_takes_integer_and_boolean_tensors_as_raw_and_refuses_other_dtypes() -> None:
    steps, mask = spec_of([("steps", torch.tensor(3)), ("mask", torch.ones(3, dtype=torch.bool))])
    assert (steps.dtype, steps.raw, steps.nbytes) == ("int64", True, 8) and (mask.raw, mask.nbytes) == (True, 3)
    with pytest.raises(ValueError, match="floating-point, integer and boolean"):
        spec_of([("z", torch.zeros(2, dtype=torch.complex64))])
    assert TensorSpec("a", "float32", (2, 3)).numel == 6 and not TensorSpec("a", "float32", (2, 3)).raw


def test_metrics_travel_in_the_header_without_changing_the_layout() -> None:
    plain = make_message()
    metrics = {"val_loss": [0.25, "mean"], "count": [3.0, "sum"]}
    message = make_message(metrics=metrics)
    assert len(message) == len(plain)
    assert Message.parse(bytes(message.view())).meta.metrics == metrics
    assert Message.parse(bytes(plain.view())).meta.metrics == {}


def test_metrics_that_do_not_fit_are_named_and_the_rest_still_travels() -> None:
    metrics = {f"metric_{i:03d}_" + "x" * 40: [float(i), "mean"] for i in range(200)}
    kept, dropped = fit_metrics(metrics)
    assert 40 < len(kept) < 200 and dropped == list(metrics)[len(kept):]
    message = make_message(metrics=kept)
    assert Message.parse(bytes(message.view())).meta.metrics == kept
    with pytest.raises(ValueError, match="fit_metrics"):
        make_message(metrics=metrics)


def test_malformed_metrics_are_refused() -> None:
    message = make_message(metrics={"a": [1.0, "mean"]})
    bad = bytes(message.view()).replace(b'[1.0,\\"mean\\"]', b'\\"one point\\"  ')
    with pytest.raises(PayloadError, match="metrics must be"):
        Message.parse(bad)
