"""What both sides agree on, free of heavy imports: the codec's settings, the ``NODEOX_*`` environment names that
``nodeox launch`` sets for hosts, and the checks of values that hosts and the coordinator both take."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .codecs.registry import REGISTRY

if TYPE_CHECKING:
    import torch

CODECS = tuple(REGISTRY)  # q4, q2; bf16 and fp32: unquantized, for ablations; sparse, sparse3: top-k 1% and 3%
BLOCK_SIZES = (32, 64, 128, 256)
SCALE_DTYPES = ("fp16", "fp32")
ROUNDINGS = ("nearest", "stochastic")

ENV_URL = "NODEOX_COORDINATOR_URL"
ENV_HOST_ID = "NODEOX_HOST_ID"
ENV_TOKEN = "NODEOX_TOKEN"
ENV_TELEMETRY_URL = "NODEOX_TELEMETRY_URL"
ENV_NUM_HOSTS = "NODEOX_NUM_HOSTS"
ENV_RUN_DIR = "NODEOX_RUN_DIR"
ENV_CA_FILE = "NODEOX_CA_FILE"
ENV_LOCAL_RANK = "NODEOX_LOCAL_HOST_RANK"  # the host's position among the hosts on its machine (0 first)

HOST_ID_RULE = "1 to 64 of A-Z a-z 0-9 _ . - (not '.', '..' or 'coordinator')"
_HOST_ID = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_RESERVED_IDS = (".", "..", "coordinator")  # path segments, and the coordinator's own records


def check_rounding(rounding: str) -> None:
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding={rounding!r} is not supported; use 'nearest' or 'stochastic'")


def check_host_id(host_id: object, what: str = "host id") -> str:
    """A valid host id (returned), or a ValueError naming the rule."""
    if not isinstance(host_id, str) or not _HOST_ID.fullmatch(host_id) or host_id in _RESERVED_IDS:
        raise ValueError(f"{what} {host_id!r} is not valid: use {HOST_ID_RULE}")
    return host_id


def check_url(url: str, what: str) -> None:
    """A URL a host can reach, or a ValueError saying how to write one."""
    if not url.startswith(("http://", "https://")) or len(url.split("://", 1)[1]) == 0:
        raise ValueError(f"{what} {url!r} must look like http://HOST:8470 (or https://)")


@dataclass(frozen=True)
class CodecSettings:
    """How deltas are quantized.

    Args:
        codec: ``"q4"``; ``"q2"`` (2-bit, about half of q4's bytes, a coarser delta); ``"bf16"`` or ``"fp32"``
            send deltas unquantized (an ablation: what q4 costs); ``"sparse"`` and ``"sparse3"`` the top 1% or 3%
            of each chunk of 4096 values with 2-bit values (rounding to nearest only).
        block_size: values per scale (32, 64, 128 or 256).
        scale_dtype: ``"fp16"`` (smaller payload) or ``"fp32"`` (any magnitude).
        rounding: ``"nearest"`` or ``"stochastic"`` (unbiased, noisier).
        error_feedback: carry each round's quantization residual into the next round.
    """

    block_size: int = 64
    scale_dtype: str = "fp16"
    rounding: str = "nearest"
    error_feedback: bool = True
    codec: str = "q4"

    def __post_init__(self) -> None:
        if self.codec not in REGISTRY:
            raise ValueError(f"codec={self.codec!r} is not supported; use one of {tuple(REGISTRY)}")
        if self.block_size not in BLOCK_SIZES:
            raise ValueError(f"block_size={self.block_size} is not supported; use one of {BLOCK_SIZES}")
        if self.scale_dtype not in SCALE_DTYPES:
            raise ValueError(f"scale_dtype={self.scale_dtype!r} is not supported; use 'fp16' or 'fp32'")
        check_rounding(self.rounding)

    @property
    def torch_scale_dtype(self) -> torch.dtype:
        import torch  # here, so that the ``nodeox`` command checks its flags without importing torch

        return {"fp16": torch.float16, "fp32": torch.float32}[self.scale_dtype]
