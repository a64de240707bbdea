"""The codecs. Each codec's settings, and the registry of codec names, are in :mod:`.settings` (free of heavy
imports); its :class:`~.base.Codec` and kernels are a module here, which its settings class names and which is
imported on first use (so that the ``nodeox`` command checks its flags without importing torch)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from .settings import REGISTRY, CodecSettings

if TYPE_CHECKING:
    from .base import Codec, Kernels

__all__ = ["REGISTRY", "Codec", "CodecSettings", "Kernels", "codec_class", "codec_for"]

_IMPLEMENTATIONS: dict[str, type[Codec]] = {}


def codec_class(name: str) -> type[Codec]:
    """The codec registered as ``name`` (its module is imported here, the first time)."""
    kind = _IMPLEMENTATIONS.get(name)
    if kind is None:
        module, _, attr = REGISTRY[name].implementation.partition(":")
        kind = _IMPLEMENTATIONS[name] = getattr(importlib.import_module(module), attr)
    return kind


def codec_for(settings: CodecSettings) -> Codec:
    """The codec of ``settings``, under those settings."""
    return codec_class(settings.name)(settings)


def __getattr__(name: str):
    if name in ("Codec", "Kernels"):  # the interface, imported (with torch) only when asked for
        from . import base

        return getattr(base, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
