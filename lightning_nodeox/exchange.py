"""A host's side of a round, outside Lightning: snapshot, delta, encode, upload, wait, download, apply, verify.

:class:`HostExchange` owns the round's base model (θ_r), the error-feedback residual and the reusable
message buffers. It runs on the host's exchange worker (:class:`ExchangeWorker`): the round boundary hands it
the round, training waits on the returned future (overlap is a later step on the same seam).

Memory beyond the model: the base (1x the exchanged tensors), the residual (bf16, 0.5x), two q4 messages
(about 0.14x each) and, on a GPU, a device staging area of one message.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import requests
import torch

from . import phases as P
from .client import BodyReader, CoordinatorClient, CoordinatorError, read_into
from .codec import (
    RESIDUAL_DTYPE, CodecPool, NonFiniteDeltaError, Q4Settings, apply_sync, encode_delta, load_delta, relative_error,
)
from .hashing import RowHasher, combine, model_hash
from .phases import PhaseLog
from .modelfile import ModelFileReader, model_header, read_model_into
from .wire import ModelMismatchError, PayloadError, Q4Layout, Q4Message, Q4Meta, spec_of

log = logging.getLogger(__name__)

ERROR_SAMPLE = 1 << 15  # values per round used to estimate the q4 error metric
TAKEN, LATE, REJOINED = "taken", "late", "rejoined"  # what became of a round's upload
DOWNLOAD_TRIES = 3


@dataclass
class RoundResult:
    round: int  # the round that closed
    model_hash: str
    complete: bool  # the run has completed: no more rounds
    contributed: bool  # this host's delta was part of the round


def shared_tensors(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The tensors that travel: floating-point parameters and persistent buffers, in state_dict order,
    each storage once (tied weights travel under their first name)."""
    out, seen = [], set()
    for name, tensor in module.state_dict(keep_vars=True).items():
        if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
            continue
        key = (tensor.data_ptr(), tensor.dtype, tuple(tensor.shape))
        if key in seen:
            continue
        seen.add(key)
        out.append((name, tensor.detach()))
    return out


class HostExchange:
    """One host's exchange state and the steps of a round."""

    def __init__(self, named: list[tuple[str, torch.Tensor]], client: CoordinatorClient, phases: PhaseLog, *,
                 rounding: str = "nearest", error_feedback: bool = True, codec_threads: int = 1) -> None:
        if not named:
            raise ValueError("the model has no floating-point parameters or buffers to exchange")
        self.names = [n for n, _ in named]
        self.live = [t for _, t in named]
        for name, t in named:
            if not t.is_contiguous():
                raise ValueError(f"tensor {name!r} is not contiguous; nodeox updates tensors in place")
        self.specs = spec_of(named)
        self.device = self.live[0].device
        if any(t.device != self.device for t in self.live):
            raise ValueError("all parameters and buffers must be on one device")
        self.client = client
        self.phases = phases
        self.rounding = rounding
        self.error_feedback = error_feedback
        self.codec_threads = codec_threads
        self.round = 0
        self.model_hash = ""
        self.complete = False
        self.base: list[torch.Tensor] = []
        self.residual: list[torch.Tensor] | None = None
        self.pool: CodecPool | None = None
        self.layout: Q4Layout | None = None
        self._delta: Q4Message | None = None
        self._sync_buffer: torch.Tensor | None = None
        self._staging: torch.Tensor | None = None
        self._seed = int.from_bytes(client.host.encode()[:8].ljust(8, b"\0"), "little")

    # -- setup ------------------------------------------------------------------------------------------------
    def join(self) -> None:
        """Join the run and agree on the starting model (provide it, keep ours if equal, or fetch it)."""
        reply = self.client.join([s.as_json() for s in self.specs])
        if reply.get("complete"):
            raise RuntimeError(f"the run at {self.client.url} has already completed; start a new coordinator")
        settings = Q4Settings(block_size=int(reply["block_size"]), scale_dtype=reply["scale_dtype"],
                              rounding=self.rounding, error_feedback=self.error_feedback)
        self._allocate(settings)
        self.round = int(reply["round"])
        if reply.get("provide_model"):
            self.model_hash = model_hash(list(zip(self.names, self.live)), self.pool)
            try:
                reply = self.client.put_model(ModelFileReader(model_header(self.specs, self.round, self.model_hash),
                                                              self.live))
            except CoordinatorError as e:
                if e.status != 409:
                    raise
                self.fetch_model()  # another host provided it meanwhile
                return
            if reply["model_hash"] != self.model_hash:
                raise RuntimeError(f"coordinator hashed the initial model as {reply['model_hash']}, "
                                   f"this host as {self.model_hash}; versions differ?")
            log.info("nodeox: host %s provided the initial model %s", self.client.host, self.model_hash)
        else:
            ours = model_hash(list(zip(self.names, self.live)), self.pool)
            if ours == reply["model_hash"]:
                self.model_hash = ours
            else:
                self.fetch_model()

    def _allocate(self, settings: Q4Settings) -> None:
        cuda = self.device.type == "cuda"
        self.pool = CodecPool(settings, self.device, self.codec_threads)
        self.layout = Q4Layout.of(self.specs, settings)
        self._delta = Q4Message.allocate(self.layout, pin_memory=cuda)
        self._sync_buffer = torch.empty(self.layout.total, dtype=torch.uint8, pin_memory=cuda)
        if self.device.type != "cpu":  # the codec works on the device; only packed bytes cross to host memory
            self._staging = torch.empty(self.layout.total - self.layout.data_start, dtype=torch.uint8,
                                        device=self.device)
        self.base = [t.detach().clone() for t in self.live]
        self.residual = ([torch.zeros(t.numel(), dtype=RESIDUAL_DTYPE, device=self.device) for t in self.live]
                         if settings.error_feedback else None)

    def _reset_base(self) -> None:
        with torch.no_grad():
            for b, t in zip(self.base, self.live):
                b.copy_(t)
            for r in self.residual or []:
                r.zero_()

    # -- tensors on the codec's device ---------------------------------------------------------------------------
    def _regions(self, message: Q4Message) -> tuple[Callable[[int], torch.Tensor], Callable[[int], torch.Tensor]]:
        """Where the codec reads and writes each tensor's codes and scales: the message, or device staging."""
        if self._staging is None:
            return message.codes, message.scales
        layout = self.layout

        def codes(i: int) -> torch.Tensor:
            a, b = layout.regions[i].codes
            return self._staging[a:b]

        def scales(i: int) -> torch.Tensor:
            a, b = layout.regions[i].scales
            return self._staging[a:b].view(layout.settings.torch_scale_dtype)

        return codes, scales

    # -- a round ------------------------------------------------------------------------------------------------
    def estimate_error(self) -> float:
        """Relative q4 error of a sample of this round's delta (for the ``q4_rel_error`` metric)."""
        i = max(range(len(self.live)), key=lambda j: self.live[j].numel())
        k = self.pool.kernels()
        m = min(self.live[i].numel(), ERROR_SAMPLE, k.chunk)
        res = None if self.residual is None else self.residual[i][:m]
        load_delta(k, self.live[i].view(-1)[:m], self.base[i].view(-1)[:m], res, m)
        x = k.x[:m].clone()
        mp = k.padded(m)
        codes = torch.empty(mp // 2, dtype=torch.uint8, device=self.device)
        scales = torch.empty(mp // self.layout.settings.block_size, dtype=self.layout.settings.torch_scale_dtype,
                             device=self.device)
        k.quantize(m, codes, scales)
        return relative_error(x, k.dequantize(codes, scales, mp)[:m])

    def encode(self, samples: int, final: bool) -> Q4Message:
        """q4 of (live - base + residual) into the delta message; the residual keeps what q4 could not carry."""
        message = self._delta
        codes_of, scales_of = self._regions(message)
        seed = None if self.layout.settings.rounding == "nearest" else hash((self._seed, self.round)) & (2**62 - 1)
        tasks = []
        for i, (t, base) in enumerate(zip(self.live, self.base)):
            flat, res = t.view(-1), None if self.residual is None else self.residual[i]
            codes, scales = codes_of(i), scales_of(i)
            for start, stop in self.pool.split(flat.numel()):
                tasks.append(lambda k, f=flat, b=base.view(-1), r=res, c=codes, s=scales, a=start, e=stop:
                             encode_delta(k, f, b, r, c, s, start=a, stop=e,
                                          seed=None if seed is None else seed + i))
        with torch.no_grad():
            self.pool.run(tasks)
        if self._staging is not None:
            cuda = self.device.type == "cuda"
            message.data.copy_(self._staging, non_blocking=cuda)
            if cuda:
                torch.cuda.current_stream(self.device).synchronize()
        self._check_finite(message)
        message.write_header(Q4Meta("delta", self.round, self.client.host, self.model_hash, samples=samples,
                                    final=final))
        return message

    def _check_finite(self, message: Q4Message) -> None:
        for i, (name, peak) in enumerate(zip(self.names, message.scale_maxima())):
            if math.isfinite(peak):
                continue
            delta_finite = bool(torch.isfinite(self.live[i]).all())
            if delta_finite and self.layout.settings.scale_dtype == "fp16":
                raise NonFiniteDeltaError(
                    f"the delta of parameter {name!r} in round {self.round} is too large for fp16 scales; "
                    "start the coordinator with --scale-dtype fp32, or lower the learning rate")
            raise NonFiniteDeltaError(
                f"the delta of parameter {name!r} in round {self.round} holds NaN or Inf: training diverged on "
                f"host {self.client.host}. Lower the learning rate or clip gradients "
                "(Trainer(gradient_clip_val=1.0)); nothing was sent")

    def upload(self, message: Q4Message) -> str:
        """Send the delta. Returns TAKEN; LATE when the round closed without it but its sync can still be
        applied; or REJOINED when this host had to fetch the model and take part in the current round anew
        (with an empty delta). Either way this round's local work is dropped."""
        with self.phases.timed(self.round, P.UPLOAD) as rec:
            rec.bytes = len(message)
            try:
                self.client.post_delta(self.round, message.view())
                return TAKEN
            except CoordinatorError as e:
                if e.body.get("duplicate"):
                    return TAKEN  # a retry of a delta the coordinator already has
                if e.status != 409:
                    raise
                log.warning("nodeox: host %s: delta of round %d not taken: %s", self.client.host, self.round, e)
                rec.extra["rejected"] = str(e.body.get("error", e))
                late = bool(e.body.get("late")) and not e.body.get("base_mismatch")
        if late:
            return LATE
        self.fetch_model()
        self._send_empty(message.meta.final)
        return REJOINED

    def _send_empty(self, final: bool) -> None:
        """Take part in the current round without a contribution (base == live: an all-zero delta)."""
        with self.phases.timed(self.round, P.UPLOAD, empty=True) as rec:
            message = self.encode(samples=0, final=final)
            rec.bytes = len(message)
            self.client.post_delta(self.round, message.view())

    def synchronize(self, *, follow_to_end: bool = False) -> RoundResult:
        """Wait for the round's sync, apply it and verify the model hash (fetching the model if needed).
        With ``follow_to_end`` keep applying later rounds' syncs until the run completes."""
        while True:
            result = self._sync_once()
            if result.complete or not follow_to_end:
                return result

    def _sync_once(self) -> RoundResult:
        round_ = self.round
        for attempt in range(1, DOWNLOAD_TRIES + 1):
            with self.phases.timed(round_, P.WAIT):
                try:
                    response = self.client.wait_sync(round_)
                except CoordinatorError as e:
                    if e.status != 410:
                        raise
                    response = None  # the sync is gone: this host fell more than a round behind
            if response is None:
                self.fetch_model()
                return RoundResult(round_, self.model_hash, self.complete, False)
            if response.status_code == 204:  # the run completed before this round closed
                self.complete = True
                return RoundResult(round_, self.model_hash, True, False)
            complete = response.headers.get("X-Nodeox-Complete") == "1"
            with self.phases.timed(round_, P.DOWNLOAD) as rec:
                try:
                    self._sync_buffer = read_into(response, self._sync_buffer)
                except (OSError, requests.RequestException) as e:  # a download that broke off: ask again
                    if attempt == DOWNLOAD_TRIES:
                        raise
                    log.warning("nodeox: host %s: sync download of round %d failed (%s); retrying",
                                self.client.host, round_, e)
                    continue
                rec.bytes = self._sync_buffer.numel()
                try:
                    sync = Q4Message.parse(self._sync_buffer)
                except PayloadError as e:
                    log.warning("nodeox: host %s: sync of round %d unusable (%s); fetching the model",
                                self.client.host, round_, e)
                    sync = None
            break
        if sync is None or sync.meta.base_hash != self.model_hash or sync.meta.round != round_:
            self.fetch_model()
            self.complete = complete
            return RoundResult(round_, self.model_hash, complete, False)
        with self.phases.timed(round_, P.APPLY):
            hashers = self._apply(sync)  # digests the new model while applying, where chunks allow
        with self.phases.timed(round_, P.VERIFY):
            self.pool.run([t for h in hashers if not h.fusable(self.pool.chunk) for t in h.tasks()])
            got = combine(list(zip(self.names, self.live)), hashers)
        if got != sync.meta.model_hash:
            log.warning("nodeox: host %s: model hash %s after round %d differs from the coordinator's %s; "
                        "fetching the model", self.client.host, got, round_, sync.meta.model_hash)
            self.round = round_ + 1
            self.fetch_model()
        else:
            self.model_hash = got
            self.round = round_ + 1
        self.complete = complete
        return RoundResult(round_, self.model_hash, complete, True)

    def _apply(self, sync: Q4Message) -> list[RowHasher]:
        """Apply the sync to every tensor; returns their row hashers (filled where the chunks allowed)."""
        codes_of, scales_of = self._regions(sync)
        if self._staging is not None:
            self._staging.copy_(sync.data)
        hashers = [RowHasher(t) for t in self.live]
        tasks = []
        for i, (t, base) in enumerate(zip(self.live, self.base)):
            flat, codes, scales = t.view(-1), codes_of(i), scales_of(i)
            hasher = hashers[i] if hashers[i].fusable(self.pool.chunk) else None
            for start, stop in self.pool.split(flat.numel()):
                tasks.append(lambda k, f=flat, b=base.view(-1), c=codes, s=scales, a=start, e=stop, h=hasher:
                             apply_sync(k, c, s, b, f, start=a, stop=e, hasher=h))
        with torch.no_grad():
            self.pool.run(tasks)
        return hashers

    def fetch_model(self) -> None:
        """Replace this host's model with the coordinator's (the fallback when a sync cannot be applied),
        streamed straight into the model's tensors; a download that breaks off is asked for again."""
        with self.phases.timed(self.round, P.FALLBACK_FETCH) as rec:
            for attempt in range(1, DOWNLOAD_TRIES + 1):
                response = self.client.get_model()
                rec.bytes = int(response.headers.get("Content-Length", 0))
                try:
                    with torch.no_grad():
                        round_, remote_hash = read_model_into(BodyReader(response), self.specs, self.live)
                    break
                except ModelMismatchError:
                    raise
                except (OSError, requests.RequestException, PayloadError) as e:
                    if attempt == DOWNLOAD_TRIES:
                        raise
                    log.warning("nodeox: host %s: model download failed (%s); retrying", self.client.host, e)
                finally:
                    response.close()
            self._reset_base()
            got = model_hash(list(zip(self.names, self.live)), self.pool)
            if got != remote_hash:
                raise RuntimeError(f"the fetched model hashes to {got}, not the coordinator's {remote_hash}")
            self.round, self.model_hash = round_, got
        log.info("nodeox: host %s fetched the model of round %d (%s)", self.client.host, round_, got)

    def run_round(self, samples: int, final: bool) -> RoundResult:
        """One whole exchange: encode, upload, then sync (following later rounds if this is the final one)."""
        error = self.estimate_error() if samples > 0 else None
        with self.phases.timed(self.round, P.ENCODE, samples=samples, q4_rel_error=error) as rec:
            message = self.encode(samples, final)
            rec.bytes = len(message)
        outcome = self.upload(message)
        result = self.synchronize(follow_to_end=final and outcome != LATE)
        if final and outcome == LATE and not self.complete:
            self._send_empty(final=True)  # so the coordinator knows this host has finished
            result = self.synchronize(follow_to_end=True)
        result.contributed = outcome == TAKEN and result.contributed
        return result

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()


class ExchangeWorker:
    """Runs a host's exchanges on a thread of their own; the round boundary hands over and gets a future."""

    def __init__(self, exchange: HostExchange) -> None:
        self.exchange = exchange
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="nodeox-exchange")

    def submit(self, samples: int, final: bool = False) -> Future:
        return self._executor.submit(self.exchange.run_round, samples, final)

    def close(self, wait: bool = True) -> None:
        self._executor.shutdown(wait=wait, cancel_futures=True)
        if wait:
            self.exchange.close()
