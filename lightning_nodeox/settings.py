"""Validated settings, free of heavy imports: the q4 codec's, and a host's (given to NodeoxStrategy, or taken
from the environment that ``nodeox launch`` sets)."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass


BLOCK_SIZES = (32, 64, 128, 256)
SCALE_DTYPES = ("fp16", "fp32")
ROUNDINGS = ("nearest", "stochastic")

ENV_URL = "NODEOX_COORDINATOR_URL"
ENV_HOST_ID = "NODEOX_HOST_ID"
ENV_TOKEN = "NODEOX_TOKEN"
ENV_TELEMETRY_URL = "NODEOX_TELEMETRY_URL"


@dataclass(frozen=True)
class Q4Settings:
    """How deltas are quantized.

    Args:
        block_size: values per scale (32, 64, 128 or 256).
        scale_dtype: ``"fp16"`` (smaller payload) or ``"fp32"`` (any magnitude).
        rounding: ``"nearest"`` or ``"stochastic"`` (unbiased, noisier).
        error_feedback: carry each round's quantization residual into the next round.
    """

    block_size: int = 64
    scale_dtype: str = "fp16"
    rounding: str = "nearest"
    error_feedback: bool = True

    def __post_init__(self) -> None:
        if self.block_size not in BLOCK_SIZES:
            raise ValueError(f"block_size={self.block_size} is not supported; use one of {BLOCK_SIZES}")
        if self.scale_dtype not in SCALE_DTYPES:
            raise ValueError(f"scale_dtype={self.scale_dtype!r} is not supported; use 'fp16' or 'fp32'")
        if self.rounding not in ROUNDINGS:
            raise ValueError(f"rounding={self.rounding!r} is not supported; use 'nearest' or 'stochastic'")

    @property
    def torch_scale_dtype(self):
        import torch

        return {"fp16": torch.float16, "fp32": torch.float32}[self.scale_dtype]


@dataclass(frozen=True)
class HostSettings:
    """How one host takes part in a run. Block size and scale type come from the coordinator.

    Args:
        coordinator_url: ``http://HOST:PORT`` of ``nodeox coordinator``.
        host_id: this host's name in the run (1 to 64 characters).
        token: bearer token, if the coordinator was started with ``--token-file``.
        local_steps: optimizer steps each host takes alone between exchanges.
        rounding: ``"nearest"`` or ``"stochastic"`` rounding of the delta's codes.
        error_feedback: carry each round's quantization residual into the next round.
        codec_threads: CPU threads for encoding on a CPU host (None: the granted CPU quota).
        telemetry_url: where phase records go (None: the coordinator).
        request_timeout: seconds to wait for one answer from the coordinator.
        retry_for: seconds to keep retrying when the coordinator does not answer.
    """

    coordinator_url: str
    host_id: str
    token: str | None = None
    local_steps: int = 20
    rounding: str = "nearest"
    error_feedback: bool = True
    codec_threads: int | None = None
    telemetry_url: str | None = None
    request_timeout: float = 120.0
    retry_for: float = 60.0

    def __post_init__(self) -> None:
        if not self.coordinator_url.startswith(("http://", "https://")):
            raise ValueError(f"coordinator_url={self.coordinator_url!r} must look like http://HOST:8470; "
                             f"pass NodeoxStrategy(coordinator_url=...) or set {ENV_URL}")
        if not 1 <= len(self.host_id) <= 64:
            raise ValueError(f"host_id must be 1 to 64 characters, got {self.host_id!r}; set {ENV_HOST_ID}")
        if self.local_steps < 1:
            raise ValueError(f"local_steps must be at least 1, got {self.local_steps}")
        if self.rounding not in ROUNDINGS:
            raise ValueError(f"rounding={self.rounding!r} is not supported; use 'nearest' or 'stochastic'")
        if self.codec_threads is not None and self.codec_threads < 1:
            raise ValueError(f"codec_threads must be at least 1 (or None for the CPU quota), got {self.codec_threads}")
        if self.request_timeout <= 0 or self.retry_for < 0:
            raise ValueError("request_timeout must be positive and retry_for non-negative seconds")

    @classmethod
    def resolve(cls, *, coordinator_url: str | None = None, host_id: str | None = None, token: str | None = None,
                telemetry_url: str | None = None, **rest) -> HostSettings:
        """Settings from the arguments given, then the environment, then defaults."""
        url = coordinator_url or os.environ.get(ENV_URL)
        if not url:
            raise ValueError(
                "NodeoxStrategy needs the coordinator's URL: pass NodeoxStrategy(coordinator_url='http://HOST:8470') "
                f"or set {ENV_URL} (`nodeox launch` sets it for the hosts it starts)")
        return cls(
            coordinator_url=url,
            host_id=host_id or os.environ.get(ENV_HOST_ID) or socket.gethostname(),
            token=token or os.environ.get(ENV_TOKEN) or None,
            telemetry_url=telemetry_url or os.environ.get(ENV_TELEMETRY_URL) or None,
            **rest,
        )
