"""The codecs by name. A new codec is a module here with its :class:`~.base.Codec` and kernels, named in
:data:`~.registry.REGISTRY` by module (imported on first use, so that the ``nodeox`` command checks its flags without
importing torch; this module imports nothing heavy)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from .registry import REGISTRY

if TYPE_CHECKING:
    from ..settings import CodecSettings
    from .base import Codec, Kernels

__all__ = ["REGISTRY", "Codec", "Kernels", "codec_class", "codec_for"]


def codec_class(name: str) -> type[Codec]:
    """The codec registered as ``name`` (one of the package is imported here, the first time)."""
    kind = REGISTRY[name]
    if isinstance(kind, str):
        module, _, attr = kind.partition(":")
        kind = REGISTRY[name] = getattr(importlib.import_module(module), attr)
    return kind


def codec_for(settings: CodecSettings) -> Codec:
    """The codec ``settings.codec`` names, under those settings."""
    return codec_class(settings.codec)(settings)


def __getattr__(name: str):
    if name in ("Codec", "Kernels"):  # the interface, imported (with torch) only when asked for
        from . import base

        return getattr(base, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
