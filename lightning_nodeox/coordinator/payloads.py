"""Payloads through the run's store (``--store``): each round's sync written there once, piece by piece as the
round's close makes it, and the full model once per round when a host first asks for it; hosts are told where to
read them (:class:`Place`) instead of being sent the bytes, so the coordinator's outbound bytes per round no longer
grow with the number of hosts.

A sync is one object a part: its header, each piece (its CRC inside), its trailer (the new model's hash), under a
prefix of its own (``syncs/R/<id>/``) so that a sync made again after a failed close never mixes with the first. A
host reads the parts in order as they appear (a part not written yet is read again until ``Place.within`` passes).
The model is one object (a multipart upload) under ``models/R/<id>.safetensors``, written while θ is kept as it was
(copy-on-publish, as a direct download). Objects of rounds no host can still need are deleted after each publish:
the syncs of rounds before the previous one, and models of earlier rounds.

A store that fails is said once (:class:`~lightning_nodeox.core.trouble.Trouble`); meanwhile the coordinator sends
the payloads itself as it does without a store, and so it does for a host that asks (``direct``: it could not
read the store). What the store costs is recorded per round: a ``store`` record of the bytes and requests of each
upload.
"""

from __future__ import annotations

import asyncio
import logging
import re
import threading
import time
import uuid
import zlib
from dataclasses import dataclass, field
from typing import Protocol

from ..core.logs import Named
from ..core.phases import COORDINATOR, STORE, PhaseRecord
from ..core.stores import Store, StoreError
from ..core.trouble import Trouble
from ..core.wire import Message
from .making import SyncBroken, SyncInMaking
from .model import ModelStream
from .runstate import RunState

log = logging.getLogger(__name__)

UPLOADS_AT_ONCE = 4  # parts of one sync uploaded at once
MODEL_CHUNK = 8 << 20
MIN_URL_SECONDS = 3600.0  # a presigned URL lives at least this long (a host that reads late asks again anyway)


class Theta(Protocol):
    """What keeps θ as it was for a model being written (the run's
    :class:`~lightning_nodeox.coordinator.rounds.Rounds`)."""

    downloads: set[ModelStream]  # full-model transfers in flight, kept by copy-on-publish

    async def wait_stable(self) -> None:
        """Return once no round's close is changing θ."""


@dataclass
class Place:
    """Where a payload is in the store: its parts in order (a URL each and its size); ``within``: seconds a part
    not written yet may take to appear; ``complete``: the run completes with it (a sync)."""

    size: int
    parts: list[tuple[str, int]]
    within: float
    complete: bool = False

    def to_json(self) -> dict:
        return {"size": self.size, "complete": self.complete, "within": self.within,
                "parts": [{"url": url, "size": size} for url, size in self.parts]}


@dataclass
class Upload:
    """One payload's objects in the store: their keys and ranges, and how the upload goes."""

    round: int
    keys: list[str]
    ranges: list[tuple[int, int]]
    task: asyncio.Future | None = None
    failed: bool = False
    bytes: int = 0
    requests: int = 0
    start: float = field(default_factory=time.time)
    crc: int = 0  # CRC-32 of the payload's bytes, once written
    finished: threading.Event = field(default_factory=threading.Event)  # written (or failed): another thread waits


class StorePayloads:
    """The run's payloads in ``store``, for the run whose rounds are ``rounds``; ``own_credentials``: hosts read
    the objects' own addresses with credentials of their own instead of presigned URLs."""

    def __init__(self, store: Store, state: RunState, rounds: Theta, *, own_credentials: bool = False) -> None:
        self.store = store
        self.state = state
        self.rounds = rounds
        self.own_credentials = own_credentials
        self.log = Named(log, state.config.name)
        self.trouble = Trouble(f"to the store {store.url}", state.config.name, counts=False,
                               meanwhile="hosts are sent the payloads by the coordinator itself until it works again")
        self.syncs: dict[int, tuple[Message, Upload]] = {}
        self.models: dict[tuple[int, str], Upload] = {}
        self._uploading = asyncio.Semaphore(UPLOADS_AT_ONCE)
        self.written = {"bytes": 0, "requests": 0}  # over the run, of the uploads that completed
        self._snapshot: Upload | None = None  # the model object the run's state names as its snapshot
        try:
            self._loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()  # for the save thread's calls
        except RuntimeError:
            self._loop = None

    def status(self) -> dict:
        """The store at a glance: its URL, and the bytes and requests of the uploads done so far."""
        return {"url": self.store.url, "failing": self.trouble.failing_since is not None, **self.written}

    # -- syncs -----------------------------------------------------------------------------------------------
    def sync_begun(self, making: SyncInMaking) -> None:
        """Write ``making``'s parts to the store as the close seals them."""
        self._start_sync(making.round, making.sync, making)

    def sync_held(self, round_: int, sync: Message) -> None:
        """A whole sync (read back from the run's state) is served: write it if the store lacks it."""
        if round_ not in self.syncs or self.syncs[round_][0] is not sync:
            self._start_sync(round_, sync, None)

    def _start_sync(self, round_: int, sync: Message, making: SyncInMaking | None) -> None:
        prefix = f"syncs/{round_}/{uuid.uuid4().hex[:12]}"
        ranges = sync.part_ranges()
        upload = Upload(round_, [f"{prefix}/{i:05d}" for i in range(len(ranges))], ranges)
        self.syncs[round_] = (sync, upload)
        upload.task = asyncio.ensure_future(self._write_sync(sync, upload, making))

    async def _write_sync(self, sync: Message, upload: Upload, making: SyncInMaking | None) -> None:
        model = self.state.model
        if model is not None:
            model.reading(sync, +1)  # its buffer is not reused for a later sync while it is written
        try:
            view = sync.view()
            writes = []
            for key, (a, b) in zip(upload.keys, upload.ranges):
                if making is not None:
                    await making.reach(b)
                writes.append(asyncio.ensure_future(self._put(upload, key, view[a:b])))
            await asyncio.gather(*writes)
            upload.crc = await asyncio.to_thread(zlib.crc32, view)
            self.trouble.ok()
        except SyncBroken:
            upload.failed = True
        except StoreError as e:
            upload.failed = True
            self.trouble.failed(e)
        finally:
            if model is not None:
                model.reading(sync, -1)
            upload.finished.set()
        if not upload.failed:
            self._record(upload, "sync")

    async def _put(self, upload: Upload, key: str, data: memoryview) -> None:
        async with self._uploading:
            if upload.failed:
                return
            try:
                await asyncio.to_thread(self.store.put, key, [data])
            except StoreError:
                upload.failed = True
                raise
            upload.bytes += len(data)
            upload.requests += 1

    def sync_place(self, round_: int, sync: Message, complete: bool) -> Place | None:
        """Where hosts read round ``round_``'s sync ``sync``; None when the store does not have it (failed)."""
        held = self.syncs.get(round_)
        if held is None or held[0] is not sync or held[1].failed:
            return None
        upload = held[1]
        within = self.state.config.transfer_timeout + len(sync) / 1e6
        return Place(len(sync), self._urls(upload, len(sync)), within, complete)

    # -- the model ---------------------------------------------------------------------------------------------
    async def model_place(self) -> Place | None:
        """Where hosts read the model as it is now: written by the first host to ask in a round (from θ, kept as
        it was by copy-on-publish while it is written), awaited by the others; None when the store failed (the
        caller sends the model itself)."""
        await self.rounds.wait_stable()  # θ is not being changed by a round's close
        upload = self._model_upload()
        await asyncio.shield(upload.task)
        if upload.failed:
            return None
        size = upload.ranges[0][1]
        return Place(size, self._urls(upload, size), self.state.config.transfer_timeout)

    def _model_upload(self) -> Upload:
        """The upload of the model as it is now (started unless one is under way or done; on the loop, while θ
        does not change)."""
        state = self.state
        model = state.require_model()
        key = (state.round, model.hash)
        upload = self.models.get(key)
        if upload is None or upload.failed:
            stream = model.stream(state.round)
            upload = Upload(state.round, [f"models/{state.round}/{uuid.uuid4().hex[:12]}.safetensors"],
                            [(0, stream.size)])
            self.models[key] = upload
            upload.task = asyncio.ensure_future(self._write_model(upload, stream))
        return upload

    async def _snapshot_upload(self, round_: int) -> Upload | None:
        """The model's upload for the state's snapshot of round ``round_`` (a save holds θ as it is meanwhile)."""
        state = self.state
        return self._model_upload() if state.model is not None and state.round == round_ else None

    async def _write_model(self, upload: Upload, stream: ModelStream) -> None:
        self.rounds.downloads.add(stream)
        try:
            writer = await asyncio.to_thread(self.store.writer, upload.keys[0])
            try:
                for chunk in stream.chunks(MODEL_CHUNK):  # copied from θ on the loop, written off it
                    await asyncio.to_thread(writer.write, chunk)
                    upload.bytes += len(chunk)
                    upload.crc = zlib.crc32(chunk, upload.crc)
                await asyncio.to_thread(writer.commit)
            except BaseException:
                await asyncio.to_thread(writer.abort)
                raise
            upload.requests = -(-upload.bytes // MODEL_CHUNK) + 2  # begin, its parts, complete
            self.trouble.ok()
            self._record(upload, "model", kept_bytes=stream.kept_bytes)
        except StoreError as e:
            upload.failed = True
            self.trouble.failed(e)
        finally:
            self.rounds.downloads.discard(stream)
            upload.finished.set()

    # -- the run's state, sharing what is written already -----------------------------------------------------
    def objects_of(self, name: str, crc: int, timeout: float) -> list[str] | None:
        """The keys of the payload objects whose bytes, in order, are the state file ``name``'s (CRC-32 ``crc``):
        round R-1's sync for ``sync-R.q4``, round R's model for ``model-R.safetensors``, once written (an upload in
        flight is waited for, at most ``timeout`` seconds; a model's is started if none is, so that hosts fetching
        it in the same round read that one upload). None when no payload holds them. Called
        from the state's save thread (:mod:`~lightning_nodeox.coordinator.statecopy`), so that the state in the
        store costs no second upload of what hosts read."""
        sync, model = re.fullmatch(r"sync-(\d+)\.q4", name), re.fullmatch(r"model-(\d+)\.safetensors", name)
        if sync is not None:
            held = self.syncs.get(int(sync[1]) - 1)
            upload = None if held is None else held[1]
        elif model is not None:
            upload = next((u for (r, _), u in list(self.models.items()) if r == int(model[1])), None)
            if upload is None and self._loop is not None:  # written once, for hosts and the state alike
                upload = asyncio.run_coroutine_threadsafe(self._snapshot_upload(int(model[1])), self._loop).result()
        else:
            return None
        if upload is None or not upload.finished.wait(timeout) or upload.failed or upload.crc != crc:
            return None
        if model is not None:
            self._snapshot = upload  # kept (not trimmed) while the state's snapshot is it
        return list(upload.keys)

    # -- after a publish ---------------------------------------------------------------------------------------
    async def trim(self, published_round: int) -> None:
        """Delete the objects no host can still need: syncs before round ``published_round - 1`` (and those of the
        rounds a late host may still apply, ``--merge async``), models of rounds before the latest model written."""
        old = [r for r in self.syncs if r < published_round - 1 - self.state.config.merge.kept_back]
        latest = max((r for r, _ in self.models), default=None)
        models = [k for k, u in self.models.items() if latest is not None and k[0] < latest and u.task.done()
                  and u is not self._snapshot]
        keys = [k for r in old for k in self.syncs[r][1].keys] + [k for m in models for k in self.models[m].keys]
        for r in old:
            self.syncs.pop(r)
        for m in models:
            self.models.pop(m)
        if keys:
            try:
                await asyncio.to_thread(self.store.delete, keys)
            except StoreError as e:
                self.log.warning("could not delete %d old objects from the store (%s); a lifecycle rule removes "
                                 "them (docs/clusters.md)", len(keys), e)

    def _urls(self, upload: Upload, size: int) -> list[tuple[str, int]]:
        seconds = max(MIN_URL_SECONDS, self.state.config.transfer_timeout + size / 1e6)
        where = self.store.address if self.own_credentials else (lambda key: self.store.location(key, seconds))
        return [(where(key), b - a) for key, (a, b) in zip(upload.keys, upload.ranges)]

    def _record(self, upload: Upload, what: str, **extra) -> None:
        self.written["bytes"] += upload.bytes
        self.written["requests"] += upload.requests
        self.state.record(PhaseRecord(upload.round, COORDINATOR, STORE, upload.start, time.time(), upload.bytes,
                                      extra={"what": what, "requests": upload.requests, "objects": len(upload.keys),
                                             **extra}))
