"""The codecs by name. A new codec is a module here with its :class:`~.base.Codec` and kernels, listed below."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .base import Codec, Kernels
from .q4 import Q4
from .raw import BF16, FP32

if TYPE_CHECKING:
    from ..settings import Q4Settings

REGISTRY: dict[str, type[Codec]] = {c.name: c for c in (Q4, BF16, FP32)}

__all__ = ["REGISTRY", "Codec", "Kernels", "codec_for"]


def codec_for(settings: Q4Settings) -> Codec:
    """The codec ``settings.codec`` names, under those settings."""
    return REGISTRY[settings.codec](settings)
