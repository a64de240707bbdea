"""Tensor specs: the name, dtype and shape of each exchanged tensor, in order, as hosts, messages and model
files describe them; and the errors raised when something received does not fit.

Floating-point tensors are averaged through the run's codec; integer and boolean tensors (BatchNorm's
``num_batches_tracked``, any counter or mask) are *raw*: they travel as their own bytes and are taken from one
host (see :mod:`lightning_nodeox.coordinator.model`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

_FLOAT_DTYPES = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64,
}
_RAW_DTYPES = {
    "int64": torch.int64, "int32": torch.int32, "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8,
    "bool": torch.bool,
}
_DTYPES = {**_FLOAT_DTYPES, **_RAW_DTYPES}


class PayloadError(ValueError):
    """A q4 message that cannot be used: truncated, corrupted, of another version, or not fitting the model."""


class ModelMismatchError(PayloadError):
    """A message, file or host whose tensors (names, dtypes, shapes) are not the run's model."""


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # torch dtype name without the "torch." prefix
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def raw(self) -> bool:
        """An integer or boolean tensor: it travels as its own bytes, taken from one host, never averaged."""
        return self.dtype in _RAW_DTYPES

    @property
    def coded(self) -> int:
        """Values the codec works on: every value of a floating-point tensor, none of a raw one."""
        return 0 if self.raw else self.numel

    @property
    def nbytes(self) -> int:
        return self.numel * self.torch_dtype.itemsize

    def as_json(self) -> list:
        return [self.name, self.dtype, list(self.shape)]


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"nodeox exchanges floating-point, integer and boolean tensors ({', '.join(_DTYPES)}), "
                         f"not {dtype}")
    return name


def spec_of(named) -> tuple[TensorSpec, ...]:
    """Specs of ``(name, tensor)`` pairs, in order."""
    return tuple(TensorSpec(n, dtype_name(t.dtype), tuple(t.shape)) for n, t in named)


def specs_from_json(items) -> tuple[TensorSpec, ...]:
    try:
        specs = tuple(TensorSpec(str(n), str(d), tuple(int(x) for x in s)) for n, d, s in items)
    except (TypeError, ValueError) as e:
        raise PayloadError(f"tensor list in the header is malformed: {e}") from None
    for s in specs:
        if s.dtype not in _DTYPES or any(d < 0 for d in s.shape):
            raise PayloadError(f"tensor {s.name!r} has an invalid dtype or shape: {s.dtype} {list(s.shape)}")
    return specs


def check_same_model(expected: tuple[TensorSpec, ...], got: tuple[TensorSpec, ...], what: str) -> None:
    """Raise PayloadError naming the first tensor where ``got`` differs from ``expected``."""
    if len(expected) != len(got):
        raise ModelMismatchError(f"{what} has {len(got)} tensors but the model has {len(expected)}")
    for e, g in zip(expected, got):
        if e != g:
            raise ModelMismatchError(
                f"{what}: tensor {g.name!r} {g.dtype} {list(g.shape)} does not match the model's "
                f"{e.name!r} {e.dtype} {list(e.shape)}; every host must train the same model"
            )


def positions_in(model: tuple[TensorSpec, ...], got: tuple[TensorSpec, ...], what: str,
                 index: dict[str, int] | None = None) -> tuple[int, ...]:
    """The model's index of each tensor of ``got``: some of the model's tensors (a delta or sync of the tensors
    that moved), in the model's order; ModelMismatchError naming the first that is not. ``index``: the model's
    ``{name: index}``, when the caller keeps one."""
    if got == model:
        return tuple(range(len(model)))
    index = {s.name: i for i, s in enumerate(model)} if index is None else index
    out, last = [], -1
    for g in got:
        i = index.get(g.name)
        if i is None:
            raise ModelMismatchError(f"{what}: tensor {g.name!r} is not one of the model's {len(model)} tensors; "
                                     "every host must train the same model")
        e = model[i]
        if e != g:
            raise ModelMismatchError(
                f"{what}: tensor {g.name!r} {g.dtype} {list(g.shape)} does not match the model's "
                f"{e.name!r} {e.dtype} {list(e.shape)}; every host must train the same model")
        if i <= last:
            raise ModelMismatchError(f"{what}: tensor {g.name!r} is listed twice or out of the model's order")
        out.append(i)
        last = i
    return tuple(out)
