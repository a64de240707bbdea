"""What tests share: tiny models and their stand-in training, rounds in this process (local_transport's
coordinator), q4 messages and model files built by hand, reading what hosts saved, and the processes of a run (a
coordinator, `nodeox launch`) on 127.0.0.1 port 0.

Fixtures live in conftest.py; everything a test module imports from another lives here."""

from __future__ import annotations

import io
import json
import os
import socket
import struct
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

import pytest
import torch
from lightning.pytorch import LightningModule
from local_transport import LocalClient, LocalCoordinator
from reference_q4 import kernels
from safetensors import safe_open
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_nodeox.core.codec import (accumulate_tensor, apply_sync, decode_tensor, encode_delta, encode_sync_and_apply,
                                         encode_tensor)
from lightning_nodeox.core.codecs import codec_for
from lightning_nodeox.core.hashing import model_hash
from lightning_nodeox.core.modelfile import model_header
from lightning_nodeox.core.phases import PhaseLog
from lightning_nodeox.core.protocol import Reason, Refusal, Upload, read_fully
from lightning_nodeox.core.codecs.settings import CodecSettings, Q4Settings
from lightning_nodeox.core.specs import TensorSpec, spec_of
from lightning_nodeox.core.wire import MessageLayout, Message, MessageMeta
from lightning_nodeox.host.round import HostRound
from lightning_nodeox.host.tensors import HostTensors
from lightning_nodeox.tools.supervision import ready_url

REPO = Path(__file__).resolve().parents[1]
HOSTS = Path(__file__).parent / "hosts"
FORKED = HOSTS / "forked.py"  # runs `python SCRIPT` forked from the session's zygote (tests/zygote.py): suite time
SETTINGS = Q4Settings()

# A model as a coordinator receives it over HTTP: named tensors, one of them a buffer.
MODEL = [("fc.weight", torch.randn(40, 30, generator=torch.Generator().manual_seed(0))),
         ("fc.bias", torch.randn(40, generator=torch.Generator().manual_seed(1))),
         ("bn.running_mean", torch.zeros(40))]
SPECS = spec_of(MODEL)

SHAPES = {"w": (50, 40), "b": (50,), "norm.running_mean": (50,)}


# Tiny models and their training

def model(seed: int = 0, shapes: dict[str, tuple[int, ...]] = SHAPES) -> list[tuple[str, torch.Tensor]]:
    """Named random tensors of ``shapes``, the same for the same seed."""
    gen = torch.Generator().manual_seed(seed)
    return [(n, torch.randn(s, generator=gen)) for n, s in shapes.items()]


def train(host: HostRound, step: int) -> None:
    """Stand-in for local training: a different nudge per host and step, the same in every process."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{host.host}/{step}".encode()))
    with torch.no_grad():
        for t in host.tensors.live:
            t.add_(torch.randn(t.shape, generator=gen) * 0.01)


class TwoOptimizers(LightningModule):
    """Manual optimization with two optimizers (a GAN-shaped step), BatchNorm and self.log."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.a = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))
        self.b = nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        opt_a, opt_b = self.optimizers()
        loss_a = nn.functional.mse_loss(self.a(x), y)
        opt_a.zero_grad()
        self.manual_backward(loss_a)
        opt_a.step()
        loss_b = nn.functional.mse_loss(self.b(x), y)
        opt_b.zero_grad()
        self.manual_backward(loss_b)
        opt_b.step()
        self.log_dict({"loss_a": loss_a, "loss_b": loss_b})

    def configure_optimizers(self):
        return torch.optim.Adam(self.a.parameters(), 1e-2), torch.optim.SGD(self.b.parameters(), 1e-2)


def data(n: int = 256) -> DataLoader:
    """``n`` samples of 8 features, the target their sum."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=16)


# Rounds in this process (local_transport's coordinator)

def hosts(coordinator: LocalCoordinator, *ids: str) -> list[HostRound]:
    """Hosts ``ids`` joined to ``coordinator``, all on the same model."""
    out = [HostRound(HostTensors(model(seed=0)), LocalClient(coordinator, h), PhaseLog(h)) for h in ids]
    for h in out:
        h.join()
    return out


def join(c: LocalCoordinator, *ids: str) -> list[HostRound]:
    """Hosts ``ids`` joined to ``c``, each from its own model (the first provides it), with no records yet."""
    hosts = [HostRound(HostTensors(model(seed=i)), LocalClient(c, h), PhaseLog(h)) for i, h in enumerate(ids)]
    for h in hosts:
        h.join()
        h.phases.records.clear()  # what happens from here on is the test's
    return hosts


def upload(host: HostRound, samples: int = 8, final: bool = False) -> Upload:
    """Encode and send the host's live model's delta."""
    return host.upload(host.encode(host.tensors.live, samples, final))


def train_on_model(host: HostRound, k: int, round_: int) -> None:
    """This round's deterministic "training": a change that depends on the model, the host and the round (unlike
    helpers.train's nudge, so a host that trained on another model would send another delta); frozen parameters
    (see :func:`frozen`) stay as they are."""
    with torch.no_grad():
        for i, (t, p) in enumerate(zip(host.tensors.live, host.tensors.moving.parameters)):
            if p is None or p.requires_grad:
                t.mul_(1 + 1e-3 * k).add_(1e-3 * ((i + k + round_) % 5 - 2))


def frozen(named: list[tuple[str, torch.Tensor]], names: tuple[str, ...], fragments: int = 1) -> HostTensors:
    """The host tensors of ``named`` where the tensors ``names`` are frozen parameters (the others always move), in
    ``fragments``."""
    return HostTensors(named, [nn.Parameter(t, requires_grad=False) if n in names else None for n, t in named],
                       fragments=fragments)


def deltas(host: HostRound) -> list[torch.Tensor]:
    """What the host's training changed since the round began."""
    return [t - b for t, b in zip(host.tensors.live, host.tensors.base)]


def exchange(*pairs: tuple[HostRound, int]) -> None:
    """One round in a fixed arrival order (the sum of deltas rounds differently in another order)."""
    for host, samples in pairs:
        host.upload(host.encode(host.tensors.live, samples, False))
    for host, _ in pairs:
        assert host.synchronize().contributed


def both(fn_a, fn_b):
    """Run two hosts' blocking calls at once (a round closes only when both have sent)."""
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("a", fn_a()))
    thread.start()
    result["b"] = fn_b()
    thread.join(30)
    return result["a"], result["b"]


def assert_on_the_run_model(coordinator: LocalCoordinator, *hosts: HostRound) -> None:
    """Every host holds the in-process coordinator's model, bit for bit, with nothing of its own on top."""
    expected = coordinator.rounds.model.hash
    for h in hosts:
        assert h.model_hash == expected == model_hash(h.tensors.named()), h.host
        assert all(torch.equal(b, t) for b, t in zip(h.tensors.base, h.tensors.live))


# Messages and model files built by hand

def encoded(values: list[torch.Tensor], specs: list[TensorSpec], settings: CodecSettings = SETTINGS) -> Message:
    """A q4 message of ``values`` (one per spec), its header not yet written."""
    message = Message.allocate(MessageLayout.of(specs, settings))
    k = kernels(settings)
    for i, v in enumerate(values):
        encode_tensor(k, v.reshape(-1).float(), message.codes(i), message.scales(i))
    return message


def delta_message(deltas: list[torch.Tensor], *, round_: int = 0, host: str = "h", base_hash: str = "",
                  samples: int = 1, specs: list[TensorSpec] = SPECS, settings: CodecSettings = SETTINGS) -> Message:
    """A host's q4 delta for ``round_``, as it would send it."""
    message = encoded(deltas, specs, settings)
    message.write_header(MessageMeta("delta", round_, host, base_hash, samples=samples))
    return message


def model_file(named=MODEL) -> bytes:
    """The bytes of a model upload (round 0, no hash yet)."""
    body = bytearray(model_header(spec_of(named), 0, ""))
    for _, t in named:
        body += t.numpy().tobytes()
    return bytes(body)


def body_bytes(body) -> torch.Tensor:
    """All of a streamed body, closed after."""
    buffer = torch.empty(body.size, dtype=torch.uint8)
    read_fully(body, memoryview(buffer.numpy()))
    body.close()
    return buffer


def expected_after_round(model: list[torch.Tensor], contributions, settings: CodecSettings = SETTINGS) -> list[torch.Tensor]:
    """What the coordinator must publish: the codec's sync of the sample-weighted mean of the dequantized deltas."""
    total = sum(n for _, n in contributions)
    specs = spec_of([(f"t{i}", t) for i, t in enumerate(model)])
    out = []
    for i, t in enumerate(model):
        acc = torch.zeros(t.numel())
        for j, (deltas, samples) in enumerate(contributions):
            k = kernels(settings)
            message = delta_message(deltas, round_=0, host="x", base_hash="", samples=samples, specs=specs,
                                    settings=settings)
            accumulate_tensor(k, message.codes(i), message.scales(i), acc, float(samples), assign=j == 0)
        new = t.clone().view(-1)
        codes, scales = torch.empty_like(message.codes(i)), torch.empty_like(message.scales(i))
        encode_sync_and_apply(kernels(settings), acc, 1 / total, new, codes, scales)
        out.append(new.view(t.shape))
    return out


def load(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """A host's saved safetensors file: its tensors and its metadata."""
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()  # noqa: SIM118 - safe_open is not iterable


def bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes (any dtype, 0-d included), for bit-for-bit comparisons."""
    return t.reshape(-1).view(torch.uint8)


# Checks every codec's tests share

def encode_flat(x: torch.Tensor, settings: CodecSettings, *, chunk: int = 256, seed: int | None = None):
    """(kernels, codes, scales) of flat ``x`` in the codec of ``settings`` (small chunks: many chunk boundaries)."""
    k = kernels(settings, chunk)
    codec = codec_for(settings)
    codes = torch.empty(codec.code_bytes(x.numel()), dtype=torch.uint8)
    scales = torch.empty(codec.scale_count(x.numel()), dtype=codec.scale_dtype)
    encode_tensor(k, x, codes, scales, seed=seed)
    return k, codes, scales


def blockwise_round_trip(x: torch.Tensor, settings: CodecSettings, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    """The decoded values of ``x`` in a blockwise codec and each value's scale (as a decoder reads it)."""
    k, codes, scales = encode_flat(x, settings, **kw)
    out = torch.empty(x.numel())
    decode_tensor(k, codes, scales, out)
    return out, scales.float().repeat_interleave(settings.block_size)[: x.numel()]


def feedback_errors(settings: CodecSettings, *, error_feedback: bool, rounds: int = 50, n: int = 1 << 15):
    """``rounds`` rounds of Gaussian deltas, each encoded (with a residual, as a host with ``error_feedback`` keeps
    it) and decoded: the norm of (sum of the true deltas - sum of the decoded) after each round, that difference
    at the end, and the residual (None without error feedback)."""
    k, codec = kernels(settings, 4096), codec_for(settings)
    gen = torch.Generator().manual_seed(1)
    base = torch.zeros(n)
    residual = torch.zeros(n, dtype=torch.bfloat16) if error_feedback else None
    true_total, sent_total, decoded = torch.zeros(n), torch.zeros(n), torch.empty(n)
    codes = torch.empty(codec.code_bytes(n), dtype=torch.uint8)
    scales = torch.empty(codec.scale_count(n), dtype=codec.scale_dtype)
    errors = []
    for _ in range(rounds):
        delta = torch.randn(n, generator=gen)
        encode_delta(k, base + delta, base, residual, codes, scales)
        decode_tensor(k, codes, scales, decoded)
        true_total += delta
        sent_total += decoded
        errors.append(torch.linalg.vector_norm(true_total - sent_total).item())
    return errors, true_total - sent_total, residual


def host_delta(settings: CodecSettings, *, error_feedback: bool, in_features: int = 30, k=None):
    """A host of ``Linear(in_features, 20)`` whose weights moved by noise encodes its delta (``k``: the kernels
    that decode it): whether the message has the run's codec and its layout's size, and per tensor (its delta
    ``live - base``, flat; the values sent, decoded; its residual), or None where the host keeps no residual."""
    model = torch.nn.Linear(in_features, 20)
    tensors = HostTensors([(n, p.detach()) for n, p in model.named_parameters()])
    tensors.allocate(settings, codec_threads=1, error_feedback=error_feedback)
    try:
        with torch.no_grad():
            for t in tensors.live:
                t.add_(torch.randn(t.shape, generator=torch.Generator().manual_seed(t.numel())) * 0.01)
        message = tensors.encode(tensors.live, MessageMeta("delta", 0, "h", "", samples=8), seed=None).join()
        as_run = message.meta.codec == settings and len(message) == MessageLayout.of(tensors.specs, settings).total
        if tensors.residual is None:
            return as_run, None
        parts = []
        for i, (live, base) in enumerate(zip(tensors.live, tensors.base)):
            sent = torch.empty(live.numel())
            decode_tensor(k or kernels(settings), message.codes(i), message.scales(i), sent)
            parts.append(((live - base).reshape(-1), sent, tensors.residual[i].clone()))
        return as_run, parts
    finally:
        tensors.close()


def synced_on_both_sides(settings: CodecSettings, model: torch.Tensor, contributions):
    """The coordinator's model after a round of ``contributions`` (a list of (delta, samples)) in the codec of
    ``settings``, and a host's live and base after it applied that round's sync."""
    n, codec = model.numel(), codec_for(settings)
    host_live, host_base, acc = model.clone(), model.clone(), torch.zeros(n)
    for i, (delta, samples) in enumerate(contributions):
        k, codes, scales = encode_flat(delta, settings, chunk=512)
        accumulate_tensor(k, codes, scales, acc, float(samples), assign=i == 0)
    sync_codes = torch.empty(codec.code_bytes(n), dtype=torch.uint8)
    sync_scales = torch.empty(codec.scale_count(n), dtype=codec.scale_dtype)
    coordinator_model = model.clone()
    encode_sync_and_apply(kernels(settings, 1024), acc, 1 / sum(s for _, s in contributions), coordinator_model,
                          sync_codes, sync_scales)
    apply_sync(kernels(settings, 256), sync_codes, sync_scales, host_base, host_live)
    return coordinator_model, host_live, host_base


def refused_then_published(tmp_path: Path, settings: CodecSettings, bad: dict, good_a, good_b) -> None:
    """Through the in-process coordinator of a run of ``settings``: host a's delta ``good_a`` (30 samples), then
    every delta of ``bad`` from host b (name: (body of the base hash, what the refusal says); each refused as
    invalid, naming why, the round keeping a's alone), then b's ``good_b`` (10 samples): the published model is
    exactly the one computed here from a's and b's deltas."""
    def body(values, host: str, base: str, samples: int) -> memoryview:
        return delta_message(values, host=host, base_hash=base, samples=samples, settings=settings).view()

    c = LocalCoordinator(tmp_path, 2, codec=settings)
    try:
        a, b = LocalClient(c, "a"), LocalClient(c, "b")
        tensors = [s.as_json() for s in spec_of(MODEL)]
        assert a.join(tensors).provide_model
        initial = a.put_model(io.BytesIO(model_file()))
        assert b.join(tensors).model_hash == initial == model_hash(MODEL)
        assert a.post_delta(0, body(good_a, "a", initial, 30)) is Upload.TAKEN
        for name, (make, text) in bad.items():
            with pytest.raises(Refusal) as refused:
                b.post_delta(0, memoryview(make(initial)))
            assert refused.value.reason is Reason.INVALID and text in str(refused.value), name
            assert c.rounds.received == {"a": 30}, name
        b.post_delta(0, body(good_b, "b", initial, 10))
        sync = Message.parse(body_bytes(b.wait_sync(0).body))
        after = expected_after_round([t for _, t in MODEL], [(good_a, 30), (good_b, 10)], settings)
        assert sync.meta.codec == settings
        assert sync.meta.model_hash == model_hash([(n, t) for (n, _), t in zip(MODEL, after)]) == c.rounds.model.hash
    finally:
        c.close()


# Processes of a run

class Process(subprocess.Popen):
    """A Popen whose ``wait`` returns once the process is gone, also one forked from the zygote: after its forwarder
    is killed (-9) the zygote kills the child a moment later, and a test must not start its successor before."""

    def wait(self, timeout: float | None = None) -> int:
        code = super().wait(timeout)
        path = os.environ.get("NODEOX_TEST_ZYGOTE")
        if path and os.path.exists(path):
            request = json.dumps({"gone": self.pid}).encode()
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(30)
                try:
                    s.connect(path)
                    s.sendall(struct.pack("!Q", len(request)) + request)
                    s.recv(1)  # the zygote closes it once the forwarder's child is gone
                except OSError:
                    pass
        return code


def forked(command: list[str]) -> list[str]:
    """``command`` with tests/hosts/forked.py in front of the script (or ``-m MODULE``) when it runs this
    interpreter, so that it is forked from the zygote with torch and Lightning imported (the same process
    otherwise; it runs the script itself without a zygote); torchrun's workers are forked too."""
    if command[:1] != [sys.executable] or command[1:2] == [str(FORKED)]:
        return command
    if command[1:3] == ["-m", "torch.distributed.run"]:
        script = next(i for i, a in enumerate(command) if i > 2 and a.endswith(".py"))
        command = [*command[:script], str(FORKED), *command[script:]]
    return [sys.executable, str(FORKED), *command[1:]]


class socket_closed_port:
    """A local port with nothing listening on it."""

    def __enter__(self) -> int:
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        self.port = s.getsockname()[1]
        s.close()
        return self.port

    def __exit__(self, *exc) -> None:
        pass


class Coordinator:
    """A `nodeox coordinator` subprocess (``command``: or a `nodeox relay`); stopped (and waited for) when the test
    ends."""

    def __init__(self, run_dir: Path, hosts: int, *args: str, timeout: float = 60, command: str = "coordinator") -> None:
        self.run_dir = run_dir
        ready = run_dir / "ready"
        ready.unlink(missing_ok=True)
        run_dir.mkdir(parents=True, exist_ok=True)
        n = len(list(run_dir.parent.glob(f"{run_dir.name}-coordinator*.log")))
        self.log_path = run_dir.parent / f"{run_dir.name}-coordinator{n}.log"  # outside: a new run moves records aside
        self.log = open(self.log_path, "w")
        self.proc = Process(
            [sys.executable, str(FORKED), "-m", "lightning_nodeox", command, "--hosts", str(hosts), "--run-dir",
             str(run_dir), "--bind", "127.0.0.1:0", "--ready-file", str(ready), "--threads", "1", *args],
            stdout=self.log, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
        deadline = time.monotonic() + timeout
        while not (url := ready_url(ready)):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"coordinator did not start: {self.log_path.read_text()}")
            time.sleep(0.05)
        self.url = url

    @property
    def pid(self) -> int:
        """The coordinator's own process (``proc`` may be its forwarder, tests/hosts/forked.py)."""
        return json.loads((self.run_dir / "coordinator.json").read_text())["pid"]

    def events(self) -> list[dict]:
        path = self.run_dir / "events.jsonl"
        return read_events(self.run_dir) if path.exists() else []

    def wait(self, timeout: float = 60) -> int:
        return self.proc.wait(timeout)

    def stop(self) -> None:
        terminate(self.proc, 15)
        self.log.close()


def launch(run_dir: Path, hosts: int, command: list[str], *coordinator_args: str, timeout: float = 240,
           env: dict | None = None, cwd: Path = REPO) -> subprocess.CompletedProcess:
    """`nodeox launch` a run on this machine (in ``cwd``), bounded by ``timeout`` seconds."""
    return subprocess.run(
        [sys.executable, "-m", "lightning_nodeox", "launch", "--hosts", str(hosts), "--run-dir", str(run_dir),
         "--threads", "1", *coordinator_args, "--", *forked(command)],
        capture_output=True, text=True, timeout=timeout, cwd=cwd,
        env=dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **(env or {})))


def codec_run(tmp_path: Path, *codec_flags: str) -> tuple[list[dict], list[tuple[str, torch.Tensor]], Path]:
    """``nodeox launch CODEC_FLAGS`` (``--codec CODEC`` and its settings): two digits hosts, host 1 without error
    feedback; checks that after every round both hold the published model bit for bit. Returns the run's events,
    the model's named tensors (as the hosts ended) and the hosts' out folder."""
    run_dir, out = tmp_path / "run", tmp_path / "out"
    result = launch(run_dir, 2, [sys.executable, str(HOSTS / "digits_host.py"), "--out", str(out),
                                 "--error-feedback", "on,off"], *codec_flags)
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-5000:]
    events = read_events(run_dir)
    published = {e["round"]: e["model_hash"] for e in events if e["phase"] == "sync_prepare"}
    assert sorted(published) == [0, 1, 2]
    for name in ["round0", "round1", "final"]:
        t0, m0 = load(out / f"host0_{name}.safetensors")
        t1, m1 = load(out / f"host1_{name}.safetensors")
        assert set(t0) == set(t1) and all(torch.equal(bits(t0[k]), bits(t1[k])) for k in t0), name
        assert m0["model_hash"] == m1["model_hash"] == published[int(m0["round"])]
    return events, [(k, t0[k]) for k in json.loads(m0["order"])], out


def read_events(run_dir: Path) -> list[dict]:
    """The run's events.jsonl, one dict a line."""
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]


def raw_request(url: str, head: str, *, rcvbuf: int | None = None) -> socket.socket:
    """A socket that has sent ``head`` (a request, maybe half of one) to the coordinator at ``url``."""
    host, port = url.removeprefix("http://").split(":")
    s = socket.socket()
    if rcvbuf is not None:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.connect((host, int(port)))
    s.sendall(head.encode())
    return s


def recorded(host) -> list:
    """The phase records a host emitted (with the ``keep_records`` fixture)."""
    return host.phases.records


# Digits hosts started one by one (as `nodeox launch` would)

DIGITS = [sys.executable, str(FORKED), str(HOSTS / "digits_host.py")]


def start_host(host: str, url: str, out: Path, *args: str, token: str | None = None) -> subprocess.Popen:
    """A digits host process (as `nodeox launch` would start it; ``token``: its NODEOX_TOKEN), its output in
    OUT/hostH-N.log."""
    out.mkdir(parents=True, exist_ok=True)
    n = len(list(out.glob(f"host{host}-*.log")))
    log = open(out / f"host{host}-{n}.log", "w")  # noqa: SIM115 - the child writes it; closed when the test ends
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", NODEOX_HOST_ID=host, NODEOX_COORDINATOR_URL=url,
               **({"NODEOX_TOKEN": token} if token else {}))
    return Process([*DIGITS, "--out", str(out), *args], cwd=REPO, env=env, stdout=log,
                            stderr=subprocess.STDOUT)


def run_hosts(coord: Coordinator, out: Path, hosts: str, *args: str, timeout: float) -> None:
    """Start a digits host process for each id in ``hosts`` (with ``args``) and wait until each, then the
    coordinator, exits 0 (the logs' tails in the failure); whatever still runs is stopped."""
    procs = [start_host(h, coord.url, out, *args) for h in hosts]
    try:
        for p in procs:
            assert p.wait(timeout) == 0, [f.read_text()[-4000:] for f in sorted(out.glob("host*.log"))]
        assert coord.wait(30) == 0, coord.log_path.read_text()[-4000:]
    finally:
        stop(procs)
        coord.stop()


def wait_for(predicate, timeout: float, what: str) -> None:
    """Poll ``predicate`` until it holds, failing the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def published(run_dir: Path) -> dict[int, dict]:
    """The sync_prepare record of every round published so far (the coordinator's own: not those a relay forwards)."""
    path = run_dir / "events.jsonl"
    if not path.exists():
        return {}
    return {e["round"]: e for e in map(json.loads, path.read_text().splitlines())
            if e["phase"] == "sync_prepare" and e["host"] == "coordinator"}


def received(run_dir: Path) -> list[dict]:
    """The deltas the coordinator of RUN_DIR took (its own receive records: not those a relay forwards)."""
    return [e for e in read_events(run_dir) if e["phase"] == "receive" and e["host"] == "coordinator"]


def assert_identical(out: Path, hosts: list[str]) -> str:
    """Every host's final model holds the same bytes and hash; returns the hash."""
    t0, m0 = load(out / f"host{hosts[0]}_final.safetensors")
    for h in hosts[1:]:
        t, m = load(out / f"host{h}_final.safetensors")
        assert m["model_hash"] == m0["model_hash"], (h, m["model_hash"], m0["model_hash"])
        assert all(torch.equal(bits(t0[k]), bits(t[k])) for k in t0), h
    return m0["model_hash"]


def stop(procs: list[subprocess.Popen]) -> None:
    """Kill the processes still running."""
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def terminate(proc: subprocess.Popen, grace: float) -> None:
    """SIGTERM ``proc`` if it still runs, and kill it if it has not ended within ``grace`` seconds."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# Hosts of several ranks started by torchrun

def torchrun(*args: str) -> list[str]:
    """``torchrun ARGS`` as this interpreter runs it."""
    return [sys.executable, "-m", "torch.distributed.run", *args]


def free_port() -> int:
    """A local port nothing listens on now (torchrun's rendezvous binds it)."""
    with socket_closed_port() as port:
        return port


def run_together(commands: dict[str, tuple[list[str], dict[str, str]]], logs: Path, timeout: float) -> dict[str, int]:
    """Start every ``name: (command, environment additions)`` at once (in the repository, with this tree first on
    PYTHONPATH and one CPU thread each), output in LOGS/name.log; their exit codes once all ended (those still
    running after ``timeout`` seconds are killed)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    logs.mkdir(parents=True, exist_ok=True)
    procs: dict[str, subprocess.Popen] = {}
    try:
        for name, (command, extra) in commands.items():
            with open(logs / f"{name}.log", "w") as log:
                procs[name] = Process(forked(command), env=dict(env, **extra), cwd=REPO, stdout=log,
                                               stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        return {name: p.wait(max(0.1, deadline - time.monotonic())) for name, p in procs.items()}
    finally:
        stop(list(procs.values()))


def logs_of(logs: Path, names, tail: int = 4000) -> str:
    """The last ``tail`` characters of each LOGS/name.log, for an assertion's message."""
    return "\n".join(f"== {name}\n{(logs / f'{name}.log').read_text()[-tail:]}" for name in names)
