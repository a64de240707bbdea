"""The codecs' names, each with where its class is defined (``module:Class``, replaced by the class once
:func:`~lightning_nodeox.core.codecs.codec_class` imported it). It imports nothing, so that ``core/settings.py``
checks a codec's name without the codecs, which take their settings from it."""

from __future__ import annotations

# a name's Codec subclass, or where it is (typed as ``type``: the codecs take their settings from core/settings.py,
# which imports this module)
REGISTRY: dict[str, type | str] = {
    "q4": f"{__package__}.q4:Q4",
    "q2": f"{__package__}.q2:Q2",
    "bf16": f"{__package__}.raw:BF16",
    "fp32": f"{__package__}.raw:FP32",
    "sparse": f"{__package__}.sparse:Sparse",
    "sparse3": f"{__package__}.sparse:Sparse3",
}
