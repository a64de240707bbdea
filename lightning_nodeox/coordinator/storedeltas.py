"""Deltas through the run's store (``--store-deltas``): a host asks where to write its delta's parts (its header,
each piece, its trailer: :meth:`~lightning_nodeox.core.wire.Message.part_ranges`), writes them (a presigned
PUT each, or a file on the shared filesystem), then posts the delta as that place; the coordinator reads the parts
from the store (:class:`StoreBody`) through the same piece loop as a delta sent over HTTP, every piece checked, and
deletes them once read. What reaches the coordinator's address is a few hundred bytes of JSON per delta.

Each host holds at most one place at a time (asking again replaces it, and the parts of the one replaced are
deleted); a place is for one round.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass

from ..core.protocol import Reason, Refusal
from ..core.stores import Store, StoreError, StoreMissing
from .runstate import RunState

MIN_URL_SECONDS = 3600.0
MAX_PARTS = 100_000


@dataclass
class DeltaPlace:
    """Where host ``host`` writes its delta of round ``round``: ``keys`` of ``sizes`` bytes each."""

    id: str
    host: str
    round: int
    keys: list[str]
    sizes: list[int]


class StoreBody:
    """A delta's parts read from the store, as the service reads a body
    (:class:`~lightning_nodeox.coordinator.service.Body`): each part fetched whole once reading reaches it."""

    def __init__(self, store: Store, place: DeltaPlace) -> None:
        self.store = store
        self.place = place
        self.size: int | None = sum(place.sizes)
        self._part = 0
        self._data = memoryview(b"")

    async def read_into(self, view: memoryview) -> None:
        at = 0
        while at < len(view):
            if not self._data:
                self._data = memoryview(await self._next_part())
            n = min(len(view) - at, len(self._data))
            view[at : at + n] = self._data[:n]
            self._data, at = self._data[n:], at + n

    async def _next_part(self) -> bytes:
        k = self._part
        if k >= len(self.place.keys):
            raise Refusal(Reason.INVALID, "the delta's parts in the store ended early")
        key = self.place.keys[k]
        try:
            data = await asyncio.to_thread(self.store.get, key)
        except StoreMissing:
            raise Refusal(Reason.INVALID, f"part {k} of the delta is not in the store ({self.store.address(key)}): "
                                          "write every part before posting the delta") from None
        except StoreError as e:
            raise Refusal(Reason.BUSY, f"the store could not be read ({e}); send the delta again") from None
        if len(data) != self.place.sizes[k]:
            raise Refusal(Reason.INVALID, f"part {k} of the delta in the store has {len(data)} bytes, not the "
                                          f"{self.place.sizes[k]} its place was asked for")
        self._part += 1
        return data

    async def read(self) -> bytes:
        raise Refusal(Reason.INVALID, "a delta in the store is read piece by piece")

    def cut(self) -> None:
        pass


class StoreDeltas:
    """The places hosts write their deltas at, in ``store``; ``own_credentials``: hosts write the objects' own
    addresses with credentials of their own."""

    def __init__(self, store: Store, state: RunState, *, own_credentials: bool = False) -> None:
        self.store = store
        self.state = state
        self.own_credentials = own_credentials
        self.places: dict[str, DeltaPlace] = {}  # host -> its place
        self.read_bytes = 0  # of the deltas taken from the store

    async def place(self, host: str, round_: int, sizes: list[int]) -> dict:
        """A place for ``host``'s delta of round ``round_`` in parts of ``sizes`` bytes: ``{"id", "parts":
        [{"url", "size"}]}``."""
        if not sizes or len(sizes) > MAX_PARTS or not all(isinstance(n, int) and n > 0 for n in sizes):
            raise Refusal(Reason.INVALID, f"sizes must be 1 to {MAX_PARTS} positive byte counts, one per part")
        id_ = uuid.uuid4().hex[:12]
        keys = [f"deltas/{round_}/{host}/{id_}/{k:05d}" for k in range(len(sizes))]
        await self.forget(host)
        self.places[host] = DeltaPlace(id_, host, round_, keys, list(sizes))
        seconds = max(MIN_URL_SECONDS, self.state.config.transfer_timeout + sum(sizes) / 1e6)
        where = self.store.address if self.own_credentials else (lambda key: self.store.upload_location(key, seconds))
        try:
            urls = await asyncio.to_thread(lambda: [where(key) for key in keys])
        except StoreError as e:
            raise Refusal(Reason.BUSY, f"the store cannot be written now ({e}); post the delta itself") from None
        return {"id": id_, "parts": [{"url": url, "size": n} for url, n in zip(urls, sizes)]}

    def body(self, host: str, round_: int, id_: str) -> StoreBody:
        """The delta ``host`` wrote at its place ``id_`` for round ``round_``."""
        place = self.places.get(host)
        if place is None or place.id != id_ or place.round != round_:
            raise Refusal(Reason.INVALID, f"host {host} holds no place {id_!r} for round {round_}: ask "
                                          "delta-place again")
        return StoreBody(self.store, place)

    async def taken(self, host: str) -> None:
        """``host``'s delta was read whole from its place: count it, delete its parts."""
        place = self.places.get(host)
        if place is not None:
            self.read_bytes += sum(place.sizes)
        await self.forget(host)

    async def forget(self, host: str) -> None:
        """Delete ``host``'s place and its parts (read, or replaced)."""
        place = self.places.pop(host, None)
        if place is not None:
            try:
                await asyncio.to_thread(self.store.delete, place.keys)
            except StoreError:
                pass  # a lifecycle rule sweeps them (docs/clusters.md)
