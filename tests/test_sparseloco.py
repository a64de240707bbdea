"""The sparse codec's SparseLoCo knobs, each on and off: 64x64 tiles of a matrix or runs of 4096 (``chunking``), a
sent value's sign and one of two magnitudes a chunk (``levels="centroids"``), the decayed error feedback
(``error_decay``) and a sync that is each value's mean over the deltas that sent it (``mean="senders"``): round
trips within their stated bounds, error feedback on and off, malformed input refused, and syncs that hosts apply to
the coordinator's bits (in process and in a real run)."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from helpers import bits, codec_run

from lightning_nodeox.coordinator.model import CoordinatorModel
from lightning_nodeox.core.codec import accumulate_tensor, decode_tensor, encode_delta, mean_of
from lightning_nodeox.core.codecs import codec_for
from lightning_nodeox.core.codecs.settings import SparseSettings, settings_for, settings_from_json
from lightning_nodeox.core.codecs.sparse import CHUNK, TILE, TILED_CALL, tiling
from lightning_nodeox.core.pool import WorkerPool
from lightning_nodeox.core.specs import PayloadError, spec_of
from lightning_nodeox.core.wire import Message, MessageLayout, MessageMeta, check_codec
from lightning_nodeox.host.tensors import HostTensors
from lightning_nodeox.tools import cli

RECIPE = SparseSettings(chunking="tiles")  # SparseLoCo's recipe as written: its 64x64 chunks
DEFAULT = SparseSettings()  # --codec sparse: the recipe, its chunks runs of 4096 (the best on the language model)
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                reason="needs a CUDA GPU"))]
EARLIER = SparseSettings(density=0.01, chunking="runs", levels="q2", error_decay=1.0, mean="deltas")


def views(settings: SparseSettings, shape: tuple[int, ...]):
    """Fresh codes (as the kernels take them, tiled by ``shape``) and scales of a tensor of ``shape``."""
    codec, n = codec_for(settings), math.prod(shape)
    return (codec.codes_view(torch.zeros(codec.code_bytes(n), dtype=torch.uint8), n, shape),
            torch.zeros(codec.scale_count(n), dtype=codec.scale_dtype))


def kernels(settings: SparseSettings):
    return codec_for(settings).kernels("cpu")


def as_tiles(t: torch.Tensor, width: int) -> torch.Tensor:
    """The tiled rows of a flat matrix of rows of ``width``, one 64x64 tile a row (each tile's rows in turn)."""
    bands = t.numel() // (TILE * width)
    return t[: bands * TILE * width].view(bands, TILE, width // TILE, TILE).transpose(1, 2).reshape(-1, CHUNK)


def chunk_rows(t: torch.Tensor, shape: tuple[int, ...], settings: SparseSettings) -> list[torch.Tensor]:
    """A flat tensor's chunks as the codec cuts it: its tiles, then runs of 4096 (the last one shorter)."""
    width, tiled = tiling(shape) if settings.chunking == "tiles" else (0, 0)
    rows = list(as_tiles(t, width)) if tiled else []
    rest = t[tiled * CHUNK :]
    return rows + [rest[s : s + CHUNK] for s in range(0, rest.numel(), CHUNK)]


# Chunks: 64x64 tiles of a matrix

@pytest.mark.parametrize(("shape", "tiled"), [
    ((1100, 256), 17 * 4), ((64, 4096), 64), ((200, 64), 3), ((63, 256), 0), ((100, 768), 0), ((300, 32), 0),
    ((5000,), 0), ((4, 64, 64), 0)])
def test_a_matrix_whose_rows_are_a_power_of_two_of_64_to_4096_is_tiled_band_by_band(shape, tiled: int) -> None:
    """Tiles need a call of whole bands of 64 rows: rows of a power of two in [64, 4096] divide TILED_CALL."""
    width, count = tiling(shape)
    assert count == tiled and (width == shape[1] if tiled else width == 0)
    if tiled:
        assert TILED_CALL % (TILE * width) == 0
    assert codec_for(RECIPE).alignment == TILED_CALL and codec_for(EARLIER).alignment == CHUNK


@pytest.mark.parametrize("settings", [RECIPE, SparseSettings(chunking="tiles", levels="q2"),
                                      SparseSettings(chunking="tiles", density=0.03)],
                         ids=["recipe", "tiles q2", "tiles 3%"])
@pytest.mark.parametrize("shape", [(1100, 256), (200, 64), (64, 4096), (100, 768)])
def test_each_tile_sends_its_own_top_k_and_the_residual_keeps_the_rest(settings, shape) -> None:
    """(1100, 256) takes two calls (TILED_CALL values, then the rest): tiles, then a short run of its last rows."""
    codec, n = codec_for(settings), math.prod(shape)
    x = torch.randn(n, generator=torch.Generator().manual_seed(n)) * torch.linspace(0.1, 3, n)
    codes, scales = views(settings, shape)
    residual = torch.zeros(n)
    encode_delta(kernels(settings), x, torch.zeros(n), residual, codes, scales)
    decoded = torch.empty(n)
    decode_tensor(kernels(settings), codes, scales, decoded)
    assert torch.equal(residual, x - decoded)  # exactly what was not sent
    indices, at = codes.indices(), 0
    for v, d in zip(chunk_rows(x, shape, settings), chunk_rows(decoded, shape, settings)):
        k = codec.entries(v.numel())
        index = indices[at : at + k]
        at += k
        assert sorted(index.tolist()) == sorted(torch.topk(v.abs(), k).indices.tolist())
        assert set(torch.nonzero(d).view(-1).tolist()) == set(index.tolist())  # the rest decodes to -0.0
        assert (d[index].sign() == v[index].sign()).all()
    assert at == indices.numel()


def test_tiles_and_runs_have_one_byte_layout_and_differ_only_in_where_a_chunk_lies() -> None:
    shape = (256, 128)
    tiles, runs = RECIPE, DEFAULT
    specs = spec_of([("w", torch.zeros(shape))])
    assert MessageLayout.of(specs, tiles).total == MessageLayout.of(specs, runs).total
    x = torch.randn(math.prod(shape), generator=torch.Generator().manual_seed(2))
    out = {}
    for settings in (tiles, runs):
        codes, scales = views(settings, shape)
        encode_delta(kernels(settings), x, torch.zeros(x.numel()), None, codes, scales)
        out[settings.chunking] = torch.empty(x.numel())
        decode_tensor(kernels(settings), codes, scales, out[settings.chunking])
    assert not torch.equal(out["tiles"] != 0, out["runs"] != 0)
    assert (out["tiles"] != 0).sum() == (out["runs"] != 0).sum() == 8 * codec_for(tiles).k


def test_the_recipe_sends_0_053x_q4s_bytes() -> None:
    """A full chunk: 64 indices of 12 bits (32 pairs of 3 bytes), 64 codes of 2 bits (16 bytes), two fp16
    magnitudes; q4: 2048 bytes of codes and 64 fp16 scales."""
    codec = codec_for(RECIPE)
    assert codec.k == 64 and codec.code_bytes(CHUNK) + 2 * codec.scale_count(CHUNK) == 96 + 16 + 4
    assert (96 + 16 + 4) / (2048 + 2 * 64) == pytest.approx(0.0533, abs=1e-4)


# Values: a sign and one of two magnitudes a chunk

def test_a_sent_value_keeps_its_sign_and_takes_the_nearer_of_its_chunks_two_magnitudes() -> None:
    """The bound of the docstring: each chunk's squared error at most that of one magnitude (the mean), both
    magnitudes inside the sent magnitudes' range; on Gaussian values a relative error of about 0.06 (q2's levels:
    0.15)."""
    shape = (512, 256)
    n = math.prod(shape)
    x = torch.randn(n, generator=torch.Generator().manual_seed(7))
    errors = {}
    for settings in (RECIPE, SparseSettings(chunking="tiles", levels="q2")):
        codes, scales = views(settings, shape)
        encode_delta(kernels(settings), x, torch.zeros(n), None, codes, scales)
        decoded = torch.empty(n)
        decode_tensor(kernels(settings), codes, scales, decoded)
        sent = decoded != 0
        errors[settings.levels] = float((x[sent] - decoded[sent]).norm() / x[sent].norm())
        if settings.levels != "centroids":
            continue
        pairs = scales.float().view(-1, 2)
        assert (pairs[:, 0] <= pairs[:, 1]).all() and codes.value.numel() == 32 * 16  # 2 bits a value
        for c, (v, d) in enumerate(zip(chunk_rows(x, shape, settings), chunk_rows(decoded, shape, settings))):
            kept = d != 0
            v, d = v[kept], d[kept]
            low, high = pairs[c].tolist()
            assert set(d.abs().unique().tolist()) <= {low, high} and (d.sign() == v.sign()).all()
            assert v.abs().min() * (1 - 1e-3) <= low and high <= v.abs().max() * (1 + 1e-3)
            one = v.sign() * v.abs().mean()
            assert (v - d).norm() <= (v - one).norm() * (1 + 1e-3)
            nearer = torch.where((v.abs() - low).abs() <= (v.abs() - high).abs(), low, high)
            assert torch.allclose(d.abs(), nearer)
    assert errors["centroids"] < 0.08 and errors["q2"] > 0.12


def test_a_chunk_of_equal_magnitudes_comes_back_exact() -> None:
    x = torch.full((CHUNK,), 0.25)
    x[::2] = -0.25
    codes, scales = views(RECIPE, (CHUNK,))
    residual = torch.zeros(CHUNK)
    encode_delta(kernels(RECIPE), x, torch.zeros(CHUNK), residual, codes, scales)
    decoded = torch.empty(CHUNK)
    decode_tensor(kernels(RECIPE), codes, scales, decoded)
    sent = decoded != 0
    assert int(sent.sum()) == 64 and torch.equal(decoded[sent], x[sent]) and (residual[sent] == 0).all()


# Error feedback: decayed, on and off

@pytest.mark.parametrize("decay", [0.95, 0.5, 1.0])
def test_a_host_encodes_its_delta_plus_the_decayed_residual(decay: float) -> None:
    """Round 2 encodes Δ2 + β r1: the same codes as encoding that sum with no residual; r2 is what it left."""
    settings = SparseSettings(error_decay=decay)
    shape = (256, 256)
    n = math.prod(shape)
    gen = torch.Generator().manual_seed(11)
    d1, d2 = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    residual = torch.zeros(n, dtype=torch.bfloat16)  # as a host keeps it
    encode_delta(kernels(settings), d1, torch.zeros(n), residual, *views(settings, shape))
    r1 = residual.clone()
    codes, scales = views(settings, shape)
    encode_delta(kernels(settings), d2, torch.zeros(n), residual, codes, scales)
    reference, reference_scales = views(settings, shape)
    x = d2.clone().add_(r1, alpha=decay) if decay != 1.0 else d2 + r1  # as the kernels load it
    encode_delta(kernels(settings), x, torch.zeros(n), None, reference, reference_scales)
    assert torch.equal(codes.indices(), reference.indices()) and torch.equal(scales, reference_scales)
    decoded = torch.empty(n)
    decode_tensor(kernels(settings), codes, scales, decoded)
    assert torch.equal(residual, (x - decoded).to(torch.bfloat16))


def test_decayed_error_feedback_forgets_what_waits_too_long() -> None:
    """The same Δ every round, 300 rounds: plain error feedback (β = 1) sends it all in the end (the values sent
    average to within 10% of Δ; its residual keeps growing with the values that wait), β = 0.95 keeps at most
    Δ / (1 - β) and lets the values that never reach the top fade (about half of Δ reaches the model: the decayed
    accumulator is a momentum of Δ, not a lossless store), and no error feedback sends Δ's own top 1.6% alone."""
    shape = (128, 256)
    n = math.prod(shape)
    x = torch.randn(n, generator=torch.Generator().manual_seed(3))
    reached, kept = {}, {}
    for decay, feedback in ((1.0, True), (0.95, True), (0.95, False)):
        settings = SparseSettings(error_decay=decay)
        k = kernels(settings)
        residual = torch.zeros(n) if feedback else None
        total, decoded = torch.zeros(n), torch.empty(n)
        for _ in range(300):
            codes, scales = views(settings, shape)
            encode_delta(k, x, torch.zeros(n), residual, codes, scales)
            decode_tensor(k, codes, scales, decoded)
            total += decoded
        case = (decay, feedback)
        reached[case] = float((total / 300 - x).norm() / x.norm())
        kept[case] = None if residual is None else float(residual.norm() / x.norm())
        if not feedback:
            assert int((total != 0).sum()) == 8 * 64
    assert reached[1.0, True] < 0.15 < reached[0.95, True] < 0.7 < 0.9 < reached[0.95, False]
    assert kept[0.95, True] <= 1 / (1 - 0.95) < kept[1.0, True]


def test_a_host_keeps_a_residual_only_with_error_feedback() -> None:
    model = torch.nn.Linear(256, 128)
    for feedback in (True, False):
        tensors = HostTensors([(n, p.detach().clone()) for n, p in model.named_parameters()])
        tensors.allocate(RECIPE, codec_threads=1, error_feedback=feedback)
        try:
            with torch.no_grad():
                for t in tensors.live:
                    t.add_(torch.randn(t.shape, generator=torch.Generator().manual_seed(t.numel())) * 0.01)
            message = tensors.encode(tensors.live, MessageMeta("delta", 0, "h", "", samples=8), seed=None).join()
            assert (tensors.residual is None) == (not feedback) and message.meta.codec == RECIPE
            sent = torch.empty(tensors.live[0].numel())
            decode_tensor(kernels(RECIPE), message.codes(0), message.scales(0), sent)
            assert int((sent != 0).sum()) == 8 * 64  # the weight: 8 tiles of 64x64
            if feedback:
                base = tensors.base[0]
                assert torch.equal(tensors.residual[0], ((tensors.live[0] - base).view(-1) - sent).bfloat16())
        finally:
            tensors.close()


# The sync: each value's mean over the deltas that sent it

def round_of(settings: SparseSettings, shape, weights, seed: int = 0):
    """Deltas of a tensor of ``shape`` with samples ``weights``, accumulated: (acc, senders, each one decoded)."""
    n = math.prod(shape)
    gen, k = torch.Generator().manual_seed(seed), kernels(settings)
    acc, senders, decoded = torch.zeros(n), torch.zeros(n), []
    for h, w in enumerate(weights):
        codes, scales = views(settings, shape)
        encode_delta(k, torch.randn(n, generator=gen), torch.zeros(n), None, codes, scales)
        accumulate_tensor(k, codes, scales, acc, float(w), assign=h == 0, senders=senders)
        decoded.append(torch.empty(n))
        decode_tensor(k, codes, scales, decoded[-1])
    return acc, senders, decoded


def test_the_senders_mean_is_each_values_mean_over_the_deltas_that_sent_it() -> None:
    shape, weights = (192, 256), (30, 10)
    acc, senders, (a, b) = round_of(RECIPE, shape, weights)
    mean = mean_of(acc, 1 / sum(weights), senders, torch.empty(acc.numel()))
    by_a, by_b = a != 0, b != 0
    assert torch.equal(senders, by_a.float() * 30 + by_b.float() * 10)
    assert torch.equal(mean[by_a & ~by_b], a[by_a & ~by_b]) and torch.equal(mean[by_b & ~by_a], b[by_b & ~by_a])
    both = by_a & by_b
    assert bool(both.any()) and torch.allclose(mean[both], (30 * a[both] + 10 * b[both]) / 40)
    assert (mean[~by_a & ~by_b] == 0).all()
    over_deltas = mean_of(acc, 1 / sum(weights), None, torch.empty(acc.numel()))  # the earlier form: diluted
    assert torch.allclose(over_deltas[by_a & ~by_b], a[by_a & ~by_b] * 0.75)


def test_a_codec_that_syncs_the_mean_over_all_deltas_counts_no_senders() -> None:
    k = kernels(EARLIER)
    codes, scales = views(EARLIER, (CHUNK,))
    with pytest.raises(ValueError, match="codec 'sparse' syncs the mean over all deltas; it counts no senders"):
        accumulate_tensor(k, codes, scales, torch.zeros(CHUNK), 1.0, senders=torch.zeros(CHUNK))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("settings", [RECIPE, SparseSettings(chunking="tiles", mean="deltas"), DEFAULT],
                         ids=["recipe", "mean over deltas", "runs"])
def test_hosts_apply_the_sync_to_the_coordinators_bits_and_hash(settings, device) -> None:
    """Two deltas through the coordinator's model: the sync carries each value's mean (over its senders, or over
    both deltas), and a host applying it (on a GPU: its staging areas) reaches the coordinator's bits and hash, on
    every dtype."""
    gen = torch.Generator().manual_seed(4)
    named = [("w", torch.randn(200, 256, generator=gen)), ("h", torch.randn(128, 64, generator=gen).half()),
             ("b", torch.randn(300, generator=gen).bfloat16()), ("steps", torch.tensor([3, 4]))]
    specs = spec_of(named)
    pool = WorkerPool(settings, "cpu", 2)
    try:
        coordinator = CoordinatorModel(specs, [t.clone() for _, t in named], settings, pool)
        assert (coordinator.senders is not None) == (settings.mean == "senders")
        sent = []
        for host, samples in (("a", 30), ("b", 10)):
            message = Message.allocate(MessageLayout.of(specs, settings))
            change = [torch.randn(t.shape, generator=gen) * 0.01 for _, t in named[:3]]
            for j, c in enumerate(change):
                encode_delta(kernels(settings), c.view(-1), torch.zeros(c.numel()), None, message.codes(j),
                             message.scales(j))
            message.raw(3).copy_(named[3][1].view(torch.uint8))
            message.write_header(MessageMeta("delta", 0, host, coordinator.hash, samples=samples))
            coordinator.accumulate(Message.parse(bytes(message.view())), samples)
            sent.append([torch.empty(c.numel()) for c in change])
            for j, out in enumerate(sent[-1]):
                decode_tensor(kernels(settings), message.codes(j), message.scales(j), out)
        closed = coordinator.close_round(0)
        sync = Message.parse(closed.sync.buffer.clone())
        assert sync.meta.capacity == 2 * codec_for(settings).k
        for j, ((_, before), (a, b)) in enumerate(zip(named[:3], zip(*sent))):
            applied = torch.empty(a.numel())
            decode_tensor(kernels(settings), sync.codes(j), sync.scales(j), applied)
            by_a, by_b = (a != 0).float(), (b != 0).float()
            weight = 30 * by_a + 10 * by_b if settings.mean == "senders" else torch.full_like(a, 40.0)
            mean = (30 * a + 10 * b) / weight.clamp_min(1)
            assert torch.allclose(applied, mean, rtol=2**-10, atol=float(mean.abs().max()) * 2**-20), specs[j].name
        host = HostTensors([(n, t.clone().to(device)) for n, t in named])
        host.allocate(settings, codec_threads=1)
        try:
            hashers = host.apply(sync, into_live=True)
            assert host.digest(hashers) == coordinator.hash == sync.meta.model_hash
            for t, c in zip(host.live, coordinator.tensors):
                t = t.cpu()
                assert torch.equal(bits(t) if t.is_floating_point() else t, bits(c) if c.is_floating_point() else c)
        finally:
            host.close()
    finally:
        pool.close()


# Settings and malformed input

@pytest.mark.parametrize(("make", "says"), [
    (lambda: SparseSettings(chunking="rows"), "chunking='rows' is not supported; use one of ('tiles', 'runs')"),
    (lambda: SparseSettings(levels="q3"), "levels='q3' is not supported; use one of ('centroids', 'q2')"),
    (lambda: SparseSettings(mean="hosts"), "mean='hosts' is not supported; use one of ('senders', 'deltas')"),
    (lambda: SparseSettings(error_decay=0), "error_decay=0 is outside (0, 1]: use 0.95 (SparseLoCo's) or 1"),
    (lambda: SparseSettings(error_decay=1.5), "error_decay=1.5 is outside (0, 1]"),
    (lambda: SparseSettings(error_decay="0.9"), "error_decay='0.9' is outside (0, 1]"),
])
def test_a_knob_out_of_its_range_is_refused_naming_the_fix(make, says: str) -> None:
    with pytest.raises(ValueError, match=re.escape(says)):
        make()


def test_a_bad_knob_on_the_command_line_is_refused_in_one_line(tmp_path) -> None:
    with pytest.raises(SystemExit) as refused:
        cli.main(["coordinator", "--hosts", "2", "--run-dir", str(tmp_path / "run"), "--codec", "sparse",
                  "--error-decay", "2"])
    assert str(refused.value) == "nodeox: error_decay=2.0 is outside (0, 1]: use 0.95 (SparseLoCo's) or 1 (error " \
                                 "feedback without decay)"


def test_settings_written_before_the_knobs_read_as_the_codec_then() -> None:
    """A run.json or a header of the code before: ``{"name": "sparse", "density": ..., "scale_dtype": ...}``."""
    assert settings_from_json({"name": "sparse", "density": 0.01, "scale_dtype": "fp16"}) == EARLIER
    assert settings_from_json(RECIPE.to_json()) == RECIPE
    assert settings_from_json(DEFAULT.to_json()) == DEFAULT == settings_for("sparse")
    assert settings_from_json(SparseSettings(error_decay=0.5).to_json()).error_decay == 0.5


def tiled_delta(settings: SparseSettings = RECIPE) -> Message:
    """A delta of a matrix of 200 x 256: 12 tiles, then its last 8 rows as a short run of 2048 values."""
    specs = spec_of([("w", torch.zeros(200, 256))])
    message = Message.allocate(MessageLayout.of(specs, settings))
    n = 200 * 256
    encode_delta(kernels(settings), torch.randn(n, generator=torch.Generator().manual_seed(1)), torch.zeros(n), None,
                 message.codes(0), message.scales(0))
    message.write_header(MessageMeta("delta", 0, "h", "", samples=1))
    return message


@pytest.mark.parametrize(("at", "says"), [(-1, "has an index outside its chunk"),
                                          (70, "has an index twice in one chunk")])
def test_an_index_outside_its_chunk_or_twice_in_a_tile_is_refused(at: int, says: str) -> None:
    message = tiled_delta()
    codes = message.codes(0)
    indices = codes.indices()
    indices[at] = 2048 if at == -1 else indices[at - 1]  # in the short last run / in the second tile
    codes.write_indices(indices)
    message.write_header(message.meta)
    with pytest.raises(PayloadError, match=f"payload tensor 'w' {says}"):
        Message.parse(bytes(message.view()))


def test_a_delta_of_other_knobs_is_refused_naming_both() -> None:
    data = bytes(tiled_delta(SparseSettings(chunking="tiles", levels="q2")).view())
    parsed = Message.parse(data)
    with pytest.raises(PayloadError, match=re.escape(
            "payload uses sparse (density 0.015625, scale_dtype fp16, chunking tiles, levels q2, error_decay 0.95, "
            "mean senders); this run uses sparse (density 0.015625, scale_dtype fp16, chunking tiles, levels "
            "centroids,")):
        check_codec(parsed.meta.codec, RECIPE)


@pytest.mark.slow
@pytest.mark.parametrize(("flags", "settings"), [((), DEFAULT), (("--chunking", "tiles"), RECIPE)],
                         ids=["default", "tiles"])
def test_a_real_run_of_the_recipe_keeps_hosts_bit_identical(tmp_path, flags, settings) -> None:
    """``nodeox launch --codec sparse`` (no other flag: the recipe in runs of 4096; and in SparseLoCo's tiles): two
    digits hosts, host 1 without error feedback; after every round both hold the published model bit for bit, the
    run saves the settings asked for, each upload is the delta layout's size and each sync the size of a sync of
    two deltas; the hidden layer's weight (128 x 1024) is tileable."""
    events, named, _ = codec_run(tmp_path, "--codec", "sparse", *flags)
    assert json.loads((tmp_path / "run" / "state" / "run.json").read_text())["codec"] == settings.to_json()
    specs = spec_of(named)
    assert {e["bytes"] for e in events if e["phase"] == "upload"} == {MessageLayout.of(specs, settings).total}
    assert {e["bytes"] for e in events if e["phase"] == "sync_prepare"} == {
        MessageLayout.of(specs, settings, capacity=128).total}
    assert any(tiling(s.shape)[1] for s in specs)
