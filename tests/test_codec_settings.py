"""A codec's settings are its own: each travels whole (name and every setting) through a message header, ``run.json``
and the join reply; the command line takes a codec's own flags and refuses, in one line, one it does not take; the
older names ``sparse`` and ``sparse3`` keep working; a run saved before settings travelled whole still resumes."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import SPECS, codec_run, delta_message, model
from local_transport import LocalCoordinator

from lightning_nodeox.coordinator.config import OuterSettings
from lightning_nodeox.coordinator.state import SavedRun, RunStore
from lightning_nodeox.core.codecs import codec_for
from lightning_nodeox.core.codecs.settings import (REGISTRY, BF16Settings, FP8Settings, FP32Settings, Int8Settings,
                                                    Q2Settings, Q4Settings, SparseSettings, settings_for,
                                                    settings_from_old_keys)
from lightning_nodeox.core.protocol import JoinReply
from lightning_nodeox.core.specs import spec_of
from lightning_nodeox.core.wire import Message, MessageLayout
from lightning_nodeox.tools import cli

EVERY_CODEC = [Q4Settings(), Q4Settings(block_size=256, scale_dtype="fp32"), Q2Settings(block_size=32),
               Int8Settings(block_size=128), FP8Settings(scale_dtype="fp32"),
               SparseSettings(density=0.02, scale_dtype="fp32"), SparseSettings(density=0.001), BF16Settings(),
               FP32Settings()]
OLD_RUN = Path(__file__).parent / "data" / "run_before_codec_settings"  # see test_a_run_saved_before_...


def test_every_codec_is_among_the_settings_checked_here() -> None:
    assert {s.name for s in EVERY_CODEC} == set(REGISTRY)


@pytest.mark.parametrize("settings", EVERY_CODEC, ids=str)
def test_a_codecs_settings_travel_whole_in_a_header_run_json_and_a_join_reply(settings, tmp_path) -> None:
    values = [torch.randn(s.shape, generator=torch.Generator().manual_seed(7)) * 0.01 for s in SPECS]
    sent = delta_message(values, settings=settings)
    received = Message.parse(bytes(sent.view()))
    assert received.meta.codec == settings and type(received.meta.codec) is type(settings)
    assert json.loads(received.buffer[8 : received.layout.data_start].numpy().tobytes().decode().strip())[
        "__metadata__"]["codec"] == json.dumps(settings.to_json(), separators=(",", ":"))

    saved = SavedRun(round=3, model_hash="0" * 32, complete=False, hosts={}, codec=settings, outer=OuterSettings())
    RunStore(tmp_path).save(saved, sync=None, outer={}, model_chunks=None)
    assert json.loads((tmp_path / "state" / "run.json").read_text())["codec"] == settings.to_json()
    assert RunStore(tmp_path).load().codec == settings

    reply = JoinReply(round=3, model_hash="ab" * 16, codec=settings, credential="c")
    assert JoinReply.from_json(json.loads(json.dumps(reply.to_json()))) == reply


def test_settings_are_refused_naming_the_fix() -> None:
    refusals = {
        "codec 'sparse' has no setting block_size: leave it out (it takes density, scale_dtype, chunking, levels, "
        "error_decay, mean)":
            lambda: settings_for("sparse", block_size=128),
        "codec 'bf16' has no setting scale_dtype: leave it out (it takes none)":
            lambda: settings_for("bf16", scale_dtype="fp32"),
        "density=0.3 is outside [0.001, 0.25]: use a share of each chunk in that range (0.01 sends 1%)":
            lambda: SparseSettings(density=0.3),
        "density=0.0005 is outside [0.001, 0.25]": lambda: SparseSettings(density=0.0005),
        "density='1%' is outside [0.001, 0.25]": lambda: SparseSettings(density="1%"),
        "block_size=64.0 is not supported; use one of (32, 64, 128, 256)": lambda: Q2Settings(block_size=64.0),
        "codec 'sparse3' is sparse at density 0.03: for another value use codec 'sparse'":
            lambda: settings_for("sparse3", density=0.05),
        "codec='int4' is not supported; use one of ('q4', 'q2', 'int8', 'fp8', 'bf16', 'fp32', 'sparse', 'sparse3')":
            lambda: settings_for("int4"),
    }
    for text, make in refusals.items():
        with pytest.raises(ValueError) as refused:
            make()
        assert str(refused.value).startswith(text)


def test_sparse_is_sparselocos_recipe_in_runs_and_sparse3_the_same_at_3_percent() -> None:
    """--codec sparse: SparseLoCo's recipe with chunks of 4096 consecutive values (its 64x64 tiles lost to them on
    the language model, docs/algorithms.md)."""
    assert settings_for("sparse") == SparseSettings() == SparseSettings(
        density=64 / 4096, chunking="runs", levels="centroids", error_decay=0.95, mean="senders")
    assert settings_for("sparse3") == SparseSettings(density=0.03)
    assert (codec_for(settings_for("sparse")).k, codec_for(settings_for("sparse3")).k) == (64, 123)


@pytest.mark.parametrize(("density", "k"), [(0.001, 5), (0.02, 82), (0.25, 1024)])
def test_any_density_in_range_gives_k_values_a_chunk(density: float, k: int) -> None:
    codec = codec_for(SparseSettings(density=density))
    assert codec.k == k == math.ceil(density * 4096)
    full = 3 * -(-k // 2) + -(-k // 4)  # 12-bit indices two in three bytes, 2-bit codes four a byte
    assert codec.code_bytes(4096) == full + -full % 8 and codec.sync_capacity(2) == min(4096, 2 * k)


def config_of(*argv: str):
    args = cli._parser().parse_args(["coordinator", "--hosts", "2", "--run-dir", "run", *argv])
    return cli._config(args)


def test_the_command_line_takes_a_codecs_own_flags() -> None:
    assert config_of().codec == Q4Settings()
    assert config_of("--codec", "sparse", "--density", "0.02").codec == SparseSettings(density=0.02)
    assert config_of("--codec", "q2", "--block-size", "256").codec == Q2Settings(block_size=256)
    assert config_of("--codec", "sparse3", "--scale-dtype", "fp32").codec == SparseSettings(density=0.03,
                                                                                           scale_dtype="fp32")
    assert config_of("--codec", "bf16").codec == BF16Settings()
    assert config_of("--codec", "int8", "--block-size", "128").codec == Int8Settings(block_size=128)
    assert config_of("--codec", "fp8", "--scale-dtype", "fp32").codec == FP8Settings(scale_dtype="fp32")


@pytest.mark.parametrize(("command", "flags", "says"), [
    ("coordinator", ["--codec", "sparse", "--block-size", "128"],
     "codec 'sparse' has no setting block_size: leave it out (it takes density, scale_dtype, chunking, levels, "
     "error_decay, mean)"),
    ("coordinator", ["--codec", "q2", "--density", "0.1"],
     "codec 'q2' has no setting density: leave it out (it takes block_size, scale_dtype)"),
    ("coordinator", ["--density", "0.1"],
     "codec 'q4' has no setting density: leave it out (it takes block_size, scale_dtype)"),
    ("coordinator", ["--codec", "fp8", "--density", "0.1"],
     "codec 'fp8' has no setting density: leave it out (it takes block_size, scale_dtype)"),
    ("coordinator", ["--codec", "fp32", "--block-size", "64"],
     "codec 'fp32' has no setting block_size: leave it out (it takes none)"),
    ("coordinator", ["--codec", "sparse", "--density", "0.5"],
     "density=0.5 is outside [0.001, 0.25]: use a share of each chunk in that range (0.01 sends 1%)"),
    ("launch", ["--codec", "sparse3", "--density", "0.02"],
     "codec 'sparse3' is sparse at density 0.03: for another value use codec 'sparse'"),
])
def test_a_flag_its_codec_does_not_take_is_refused_in_one_line(command: str, flags: list[str], says: str,
                                                               tmp_path) -> None:
    with pytest.raises(SystemExit) as refused:
        cli.main([command, "--hosts", "2", "--run-dir", str(tmp_path / "run"), *flags, "--", "true"])
    assert str(refused.value) == f"nodeox: {says}"
    assert not (tmp_path / "run").exists()  # refused before anything started


def test_the_refusal_is_one_line_without_a_traceback_or_torch(tmp_path) -> None:
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "lightning_nodeox", "coordinator", "--hosts",
                           "2", "--run-dir", str(tmp_path), "--codec", "sparse", "--block-size", "128"],
                          capture_output=True, text=True, timeout=120)
    lines = [line for line in done.stderr.splitlines() if not line.startswith("import time:")]
    loaded = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    assert (done.returncode, lines) == (1, ["nodeox: codec 'sparse' has no setting block_size: leave it out (it "
                                            "takes density, scale_dtype, chunking, levels, error_decay, mean)"])
    assert "lightning_nodeox.core.codecs.settings" in loaded and not {m for m in loaded if m.startswith("torch")}


def test_a_run_saved_before_settings_travelled_whole_resumes(tmp_path) -> None:
    """tests/data/run_before_codec_settings: the state a coordinator of the code before (commit f4a6fe6) saved
    for a run of ``--codec q2 --block-size 128`` (run.json's loose ``q4`` keys, a version-2 sync message)
    after one round of two hosts, then killed; it resumes with its codec, takes its snapshot back once both
    hosts rejoin, and reads its saved sync."""
    shutil.copytree(OLD_RUN, tmp_path / "state")
    saved = json.loads((tmp_path / "state" / "run.json").read_text())
    assert "codec" not in saved and saved["q4"]["codec"] == "q2"  # the older form
    again = LocalCoordinator(tmp_path, 2, store=True, long_poll=0.2)
    try:
        assert again.config.codec == Q2Settings(block_size=128) == again.run.recovery.store.last.codec
        specs = spec_of(model())  # the saved run's hosts' model (tests/helpers.py)
        assert again.call(again.membership.join("a", specs, saved["hosts"]["a"]["credential"])).retry
        reply = again.call(again.membership.join("b", specs, saved["hosts"]["b"]["credential"]))
        assert (reply.retry, reply.model_hash, reply.codec, again.state.round) == (
            False, saved["model_hash"], Q2Settings(block_size=128), 1)
        sync = again.run.recovery.store.read_sync(again.run.recovery.store.last)
        assert (sync.meta.codec, sync.meta.model_hash) == (Q2Settings(block_size=128), saved["model_hash"])
        assert sync.layout.data_start != MessageLayout.of(sync.layout.specs, sync.meta.codec).data_start
    finally:
        again.close()
    assert json.loads((tmp_path / "state" / "run.json").read_text())["codec"] == Q2Settings(block_size=128).to_json()


def test_the_loose_keys_of_older_files_read_as_the_codecs_own_settings() -> None:
    """A version-2 header's metadata (text values) and an older run.json's ``q4`` (with the host knobs beside)."""
    host_knobs = {"rounding": "stochastic", "error_feedback": False}
    assert settings_from_old_keys({"codec": "q2", "block_size": "128", "scale_dtype": "fp32"}) == Q2Settings(
        block_size=128, scale_dtype="fp32")
    assert settings_from_old_keys({"block_size": 64, "scale_dtype": "fp16", **host_knobs}) == Q4Settings()
    assert settings_from_old_keys({"codec": "sparse3", "block_size": 64, "scale_dtype": "fp32", **host_knobs}) == (
        SparseSettings(density=0.03, scale_dtype="fp32", chunking="runs", levels="q2", error_decay=1.0, mean="deltas"))
    assert settings_from_old_keys({"codec": "bf16", "block_size": 64, "scale_dtype": "fp16"}) == BF16Settings()
    with pytest.raises(ValueError, match="codec='q3' is not supported"):
        settings_from_old_keys({"codec": "q3"})


def sparse_code_bytes(numel: int, density: float) -> int:
    """A sparse delta's code bytes for ``numel`` values: per chunk of m values (4096, the last one shorter) its
    ``ceil(density m)`` values, 12-bit indices two in three bytes and 2-bit codes four a byte, padded to 8."""
    chunks = [4096] * (numel // 4096) + ([numel % 4096] if numel % 4096 else [])
    entries = [min(m, max(1, math.ceil(density * m))) for m in chunks]
    size = sum(3 * -(-e // 2) + -(-e // 4) for e in entries)
    return size + -size % 8


@pytest.mark.slow
@pytest.mark.parametrize(("flags", "settings"), [
    (["--codec", "sparse", "--density", "0.02"], SparseSettings(density=0.02)),
    (["--codec", "q2", "--block-size", "256"], Q2Settings(block_size=256)),
])
def test_a_real_run_with_a_codecs_own_flags_keeps_hosts_bit_identical(flags, settings, tmp_path) -> None:
    """``nodeox launch`` with a codec's own flags: after every round both hosts hold the published model bit for
    bit (``codec_run``), and every delta is the size of that codec at those settings."""
    events, named, _ = codec_run(tmp_path, *flags)
    specs = spec_of(named)
    layout = MessageLayout.of(specs, settings)
    assert {e["bytes"] for e in events if e["phase"] == "upload"} == {layout.total}
    sync = MessageLayout.of(specs, settings, capacity=codec_for(settings).sync_capacity(2))  # two deltas a round
    assert {e["bytes"] for e in events if e["phase"] == "sync_prepare"} == {sync.total}
    for spec, region in zip(specs, layout.regions):
        if spec.raw:
            continue
        if settings.name == "sparse":
            expected = (sparse_code_bytes(spec.numel, 0.02), 4 * -(-spec.numel // 4096))  # 2 fp16 magnitudes a chunk
        else:
            expected = (-(-spec.numel // 256) * 64, 2 * -(-spec.numel // 256))  # four codes a byte, fp16 scales
        assert (region.codes[1] - region.codes[0], region.scales[1] - region.scales[0]) == expected, spec.name
