"""Each codec's settings: the knobs of its wire format, one frozen dataclass a codec, free of heavy imports (the
``nodeox`` command checks its flags without importing torch).

A codec's settings travel whole, as :meth:`CodecSettings.to_json` writes them and :func:`settings_from_json`
reads them: in every message's header, in ``run.json`` and in the join reply. A new knob is a field of its codec's
class here (validated in ``__post_init__``, described in its ``help`` metadata, which ``nodeox coordinator``
turns into a flag); nothing else changes. A new codec is a class here, named in :data:`REGISTRY`, with its
:class:`~.base.Codec` in its own module (:attr:`CodecSettings.implementation`, imported on first use).

Knobs of how a host encodes, not of what is sent (``rounding``, ``error_feedback``), are host settings
(:class:`~lightning_nodeox.host.settings.HostSettings`): hosts of one run may differ in them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar

BLOCK_SIZES = (32, 64, 128, 256)
SCALE_DTYPES = ("fp16", "fp32")
DENSITY_RANGE = (0.001, 0.25)  # a sparse delta's share of each chunk; above 1/4, q4 sends fewer bytes
CHUNKINGS, LEVELS, MEANS = ("tiles", "runs"), ("centroids", "q2"), ("senders", "deltas")  # the sparse codec's


def _check_scale_dtype(scale_dtype: str) -> None:
    if scale_dtype not in SCALE_DTYPES:
        raise ValueError(f"scale_dtype={scale_dtype!r} is not supported; use 'fp16' or 'fp32'")


@dataclass(frozen=True)
class CodecSettings:
    """A codec's settings (a subclass a codec): equal settings make identical messages.

    ``str(settings)`` reads ``q4 (block_size 64, scale_dtype fp16)``, as error messages say it.
    """

    name: ClassVar[str]  # the codec's name (``--codec``)
    implementation: ClassVar[str]  # "module:Class" of its Codec, imported on first use
    written_before: ClassVar[dict[str, Any]] = {}  # knobs added since settings travelled whole, at what their
    # absence means (a file written before them)

    def to_json(self) -> dict[str, Any]:
        """The settings whole: ``{"name": ..., field: value, ...}`` (read back by :func:`settings_from_json`)."""
        return {"name": self.name, **asdict(self)}

    def __str__(self) -> str:
        knobs = ", ".join(f"{f.name} {getattr(self, f.name)}" for f in fields(self))
        return f"{self.name} ({knobs})" if knobs else self.name


def _scale_dtype_field() -> Any:
    return field(default="fp16", metadata={"help": "scale type, fp16 (smaller messages) or fp32 (any magnitude)"})


@dataclass(frozen=True)
class BlockwiseSettings(CodecSettings):
    """The settings of a blockwise codec (q4, q2, int8, fp8).

    Args:
        block_size: values per scale (32, 64, 128 or 256): larger blocks, fewer bytes and a coarser delta.
        scale_dtype: ``"fp16"`` (smaller messages) or ``"fp32"`` (any magnitude: for deltas too large for fp16).
    """

    block_size: int = field(default=64, metadata={"help": "values per scale (32, 64, 128 or 256)"})
    scale_dtype: str = _scale_dtype_field()

    def __post_init__(self) -> None:
        if type(self.block_size) is not int or self.block_size not in BLOCK_SIZES:  # 64.0 and True are not sizes
            raise ValueError(f"block_size={self.block_size} is not supported; use one of {BLOCK_SIZES}")
        _check_scale_dtype(self.scale_dtype)


@dataclass(frozen=True)
class Q4Settings(BlockwiseSettings):
    """q4's settings: 4-bit codes (the default codec)."""

    name = "q4"
    implementation = f"{__package__}.q4:Q4"


@dataclass(frozen=True)
class Q2Settings(BlockwiseSettings):
    """q2's settings: 2-bit codes, about half of q4's bytes, a coarser delta."""

    name = "q2"
    implementation = f"{__package__}.q2:Q2"


@dataclass(frozen=True)
class Int8Settings(BlockwiseSettings):
    """int8's settings: one signed byte a value, scale absmax / 127 (1.94x q4's bytes at block size 64)."""

    name = "int8"
    implementation = f"{__package__}.int8:Int8"


@dataclass(frozen=True)
class FP8Settings(BlockwiseSettings):
    """fp8's settings: one e4m3 byte a value, scale absmax / 448 (1.94x q4's bytes at block size 64)."""

    name = "fp8"
    implementation = f"{__package__}.fp8:FP8"


@dataclass(frozen=True)
class SparseSettings(CodecSettings):
    """The sparse codec's settings: by default SparseLoCo's recipe (arXiv 2508.15706; docs/algorithms.md compares it
    ingredient by ingredient) with its chunks as runs of 4096 values, the best found on the language model
    (``chunking="tiles"`` is the recipe as written); each ingredient a knob, so that the codec's earlier form stays
    one setting away (``density=0.01, levels="q2", error_decay=1.0, mean="deltas"``).

    Args:
        density: the share of each chunk of 4096 values a delta sends, in [0.001, 0.25] (default 64 of 4096,
            SparseLoCo's top-k of a 64x64 chunk: 0.053x q4's bytes; 1% sends 0.036x, 3% 0.10x; above 1/4 q4 is smaller).
        scale_dtype: ``"fp16"`` or ``"fp32"``: the scales of each chunk.
        chunking: ``"runs"`` (default): every tensor into runs of 4096 consecutive values; ``"tiles"``: a matrix
            whose rows hold a power of two of at least 64 values (up to 4096) is cut into 64x64 tiles (its rows past
            the last whole 64 into runs), SparseLoCo's chunks.
        levels: how a sent value is coded in 2 bits: ``"centroids"``, its sign and the nearer of two magnitudes of
            its chunk (the centroids of the chunk's sent magnitudes); ``"q2"``, q2's levels of one scale.
        error_decay: β of the host's error feedback, ``e <- β e + Δ`` before the top-k (in (0, 1]; SparseLoCo's 0.95
            makes the residual play the outer momentum's part; 1: plain error feedback). How hosts encode, not what
            they send; a codec setting all the same, so that every host of a run decays alike.
        mean: the sync's value at each position: ``"senders"``, the mean over the deltas that sent it (SparseLoCo's
            aggregation); ``"deltas"``, over every delta of the round (a value sent by one host of two is halved).
    """

    name = "sparse"
    implementation = f"{__package__}.sparse:Sparse"
    written_before = {"chunking": "runs", "levels": "q2", "error_decay": 1.0, "mean": "deltas"}
    density: float = field(default=64 / 4096, metadata={"help": "share of each chunk of 4096 values a sparse delta "
                                                                f"sends, in [{DENSITY_RANGE[0]}, {DENSITY_RANGE[1]}]"})
    scale_dtype: str = _scale_dtype_field()
    chunking: str = field(default="runs", metadata={"help": "runs (of 4096 consecutive values) or tiles (64x64 "
                                                            "chunks of a matrix, SparseLoCo's)"})
    levels: str = field(default="centroids", metadata={"help": "a sent value's 2 bits: centroids (sign and one of "
                                                               "two magnitudes a chunk) or q2 (q2's levels)"})
    error_decay: float = field(default=0.95, metadata={"help": "the error feedback's decay, e <- decay e + delta, "
                                                               "in (0, 1]"})
    mean: str = field(default="senders", metadata={"help": "each synced value's mean: over the deltas that sent "
                                                           "it (senders) or over all of the round's (deltas)"})

    def __post_init__(self) -> None:
        low, high = DENSITY_RANGE
        if type(self.density) not in (int, float) or not low <= self.density <= high:
            raise ValueError(f"density={self.density!r} is outside [{low}, {high}]: use a share of each chunk in that "
                             "range (0.01 sends 1%)")
        object.__setattr__(self, "density", float(self.density))
        _check_scale_dtype(self.scale_dtype)
        for knob, choices in (("chunking", CHUNKINGS), ("levels", LEVELS), ("mean", MEANS)):
            if getattr(self, knob) not in choices:
                raise ValueError(f"{knob}={getattr(self, knob)!r} is not supported; use one of {choices}")
        if type(self.error_decay) not in (int, float) or not 0 < self.error_decay <= 1:
            raise ValueError(f"error_decay={self.error_decay!r} is outside (0, 1]: use 0.95 (SparseLoCo's) or 1 "
                             "(error feedback without decay)")
        object.__setattr__(self, "error_decay", float(self.error_decay))


@dataclass(frozen=True)
class BF16Settings(CodecSettings):
    """bf16's settings (none): deltas sent unquantized in bf16, an ablation of what quantization costs."""

    name = "bf16"
    implementation = f"{__package__}.raw:BF16"


@dataclass(frozen=True)
class FP32Settings(CodecSettings):
    """fp32's settings (none): deltas sent unquantized in fp32, an ablation of what quantization costs."""

    name = "fp32"
    implementation = f"{__package__}.raw:FP32"


REGISTRY: dict[str, type[CodecSettings]] = {
    cls.name: cls for cls in (Q4Settings, Q2Settings, Int8Settings, FP8Settings, BF16Settings, FP32Settings,
                               SparseSettings)}
ALIASES: dict[str, tuple[str, dict[str, Any]]] = {  # older names: a codec at set knobs
    "sparse3": ("sparse", {"density": 0.03}),
}
CODEC_NAMES = (*REGISTRY, *ALIASES)


def setting_names(name: str) -> tuple[str, ...]:
    """The settings codec ``name`` takes."""
    return tuple(f.name for f in fields(REGISTRY[name]))


def settings_for(name: str, **knobs: Any) -> CodecSettings:
    """The settings of codec ``name`` (or an alias) with ``knobs`` (the rest at their defaults); a ValueError
    naming the fix for an unknown codec, a knob the codec does not take, or a value out of range."""
    if name in ALIASES:
        base, preset = ALIASES[name]
        clash = sorted(set(preset) & set(knobs))
        if clash:
            raise ValueError(f"codec {name!r} is {base} at {', '.join(f'{k} {preset[k]}' for k in clash)}: "
                             f"for another value use codec {base!r}")
        name, knobs = base, {**preset, **knobs}
    if name not in REGISTRY:
        raise ValueError(f"codec={name!r} is not supported; use one of {CODEC_NAMES}")
    taken = setting_names(name)
    foreign = sorted(set(knobs) - set(taken))
    if foreign:
        takes = f"it takes {', '.join(taken)}" if taken else "it takes none"
        raise ValueError(f"codec {name!r} has no setting {', '.join(foreign)}: leave it out ({takes})")
    return REGISTRY[name](**knobs)


def settings_from_json(d: Any) -> CodecSettings:
    """The settings :meth:`CodecSettings.to_json` wrote (a ValueError for anything else)."""
    if not isinstance(d, dict) or not isinstance(d.get("name"), str):
        raise ValueError(f'codec settings must be {{"name": CODEC, ...its settings}}, got {d!r}')
    knobs = dict(d)
    name = knobs.pop("name")
    return settings_for(name, **{**_written_before(name), **knobs})


def _written_before(name: str) -> dict[str, Any]:
    """The knobs codec ``name`` (or an alias) has gained since settings travelled whole, at the values that a file
    written before them means (the codec's form then)."""
    cls = REGISTRY.get(ALIASES.get(name, (name, {}))[0])
    return dict(cls.written_before) if cls is not None else {}


def settings_from_old_keys(d: dict[str, Any]) -> CodecSettings:
    """The settings that files written before settings travelled whole hold as loose keys (a version-2 message
    header, an older ``run.json``'s ``q4``: ``codec``, ``block_size``, ``scale_dtype``, perhaps as text), keeping
    those its codec takes; the host knobs once kept beside them (``rounding``, ``error_feedback``) are dropped."""
    name = str(d.get("codec", "q4"))
    base = ALIASES.get(name, (name, {}))[0]
    if base not in REGISTRY:
        raise ValueError(f"codec={name!r} is not supported; use one of {CODEC_NAMES}")
    kinds = {"block_size": int, "scale_dtype": str}  # the knobs settings had then
    return settings_for(name, **_written_before(name),
                        **{k: kind(d[k]) for k, kind in kinds.items() if k in d and k in setting_names(base)})
