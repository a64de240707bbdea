"""The last few values made for a key, kept for when the key comes back: message layouts and tensor positions,
one per set of tensors (a set that changes back, as a backbone frozen again, finds its own)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class Recent(Generic[K, V]):
    """At most ``size`` values, the least recently used forgotten first."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"Recent keeps at least one value, got size {size}")
        self.size = size
        self._values: OrderedDict[K, V] = OrderedDict()

    def get(self, key: K, make: Callable[[], V]) -> V:
        """The value kept for ``key``, else ``make()`` kept for it."""
        value = self._values.pop(key, None)
        if value is None:
            value = make()
        self._values[key] = value
        while len(self._values) > self.size:
            self._values.popitem(last=False)
        return value
