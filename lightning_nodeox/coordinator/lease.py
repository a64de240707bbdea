"""One coordinator per run across machines: a lease object, ``lease.json``, in the run's store (``--store``).

A coordinator takes the lease at start (after its run directory's lock, before it takes the run up): it creates
the object only if absent. When another coordinator's lease is there and has not expired (its ``renewed_at`` plus
its ``ttl`` by this machine's clock) the coordinator refuses at once (exit status 2), naming the holder and when
its lease expires; an expired lease is taken over by replacing it only if it is still the object read (two
taking it over at once: one wins, the other refuses the same way). The holder renews it every ``ttl/3`` seconds
(off the event loop). A renewal that finds the lease taken by another stops the coordinator at once; so does a
store that cannot be reached for renewals until the coordinator's own lease would expire (another may take it
then). A clean shutdown deletes the lease if it is still this coordinator's, so that a successor need not wait.

Safe stores: those whose conditional writes are atomic: S3-compatible services with conditional writes
(``If-None-Match``/``If-Match`` on PUT: AWS S3, Cloudflare R2, recent MinIO), and ``file://`` through POSIX locks
(a local disk; NFSv4 or Lustre mounted with locking). A store that ignores them (an NFSv3 mount without locking,
an S3 service without conditional writes) cannot keep two coordinators apart.

Clocks: a lease expires by the wall clock of the machine that reads it, against the time its holder wrote, so the
machines' clocks must agree to well within the lease's ``ttl`` (NTP does); a holder judges its own lease by its
monotonic clock from the start of its last renewal that worked.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import time
from dataclasses import asdict, dataclass

from ..core.logs import Named
from ..core.stores import Store, StoreError, StoreMissing
from ..core.trouble import Trouble

log = logging.getLogger(__name__)

LEASE_KEY = "lease.json"


class LeaseRefused(ValueError):
    """Another coordinator holds the run's lease."""


class LeaseLost(Exception):
    """The lease is no longer this coordinator's."""


@dataclass(frozen=True)
class Holder:
    """Who holds the lease, as ``lease.json`` says."""

    pid: int
    host: str
    started: float
    renewed_at: float
    ttl: float
    url: str | None = None

    @classmethod
    def of_this_process(cls, ttl: float, started: float, url: str | None = None) -> Holder:
        return cls(os.getpid(), socket.gethostname(), started, time.time(), ttl, url)

    @classmethod
    def from_bytes(cls, data: bytes) -> Holder | None:
        """The holder written in ``data``; None when it cannot be read (taken as expired)."""
        try:
            d = json.loads(data)
            return cls(int(d["pid"]), str(d["host"]), float(d["started"]), float(d["renewed_at"]), float(d["ttl"]),
                       None if d.get("url") is None else str(d["url"]))
        except (ValueError, KeyError, TypeError):
            return None

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @property
    def expires_at(self) -> float:
        return self.renewed_at + self.ttl

    def describe(self) -> str:
        at = self.url or "its URL not known yet"
        return f"pid {self.pid} on {self.host} ({at}), started {_clock(self.started)}"


class Lease:
    """This coordinator's lease on the run in ``store``, for ``ttl`` seconds from each renewal."""

    def __init__(self, store: Store, ttl: float) -> None:
        self.store = store
        self.ttl = ttl
        self.url: str | None = None  # this coordinator's address, written at the next renewal once known
        self.started = time.time()
        self._tag: str | None = None  # the tag of the lease object this coordinator wrote last

    @property
    def held(self) -> bool:
        return self._tag is not None

    def acquire(self) -> None:
        """Take the lease; :class:`LeaseRefused` naming the holder when another coordinator holds it."""
        mine = self._mine()
        tag = self.store.create(LEASE_KEY, mine)
        if tag is None:
            tag = self._ours()[0]
        if tag is None:
            try:
                data, old = self.store.get_tagged(LEASE_KEY)
            except StoreMissing:  # released between the two calls: try once more
                data, old = b"", None
            holder = Holder.from_bytes(data)
            if holder is not None and holder.expires_at > time.time():
                raise self._refused(holder)
            tag = self.store.create(LEASE_KEY, mine) if old is None else self.store.replace(LEASE_KEY, mine, old)
            if tag is None:  # another coordinator took it over first
                raise self._refused(self._holder())
        self._tag = tag

    def renew(self) -> None:
        """Write the lease again (its ``renewed_at`` now); :class:`LeaseLost` when it is no longer ours, a
        :class:`StoreError` when the store fails."""
        if self._tag is None:
            raise LeaseLost("this coordinator holds no lease")
        tag = self.store.replace(LEASE_KEY, self._mine(), self._tag)
        if tag is None:
            tag, holder = self._ours()
        if tag is None:
            self._tag = None
            raise LeaseLost("the lease was deleted" if holder is None else f"another coordinator took the run over: "
                                                                           f"{holder.describe()}")
        self._tag = tag

    def _ours(self) -> tuple[str | None, Holder | None]:
        """The lease's tag if it is this coordinator's after all (a write the client retried had gone through
        the first time, so the retry found its condition changed), and its holder."""
        try:
            data, tag = self.store.get_tagged(LEASE_KEY)
        except StoreMissing:
            return None, None
        holder = Holder.from_bytes(data)
        mine = holder is not None and (holder.pid, holder.host, holder.started) == (os.getpid(), socket.gethostname(),
                                                                                     self.started)
        return (tag if mine else None), holder

    def release(self) -> None:
        """Delete the lease if it is still ours (a successor need not wait for it to expire)."""
        if self._tag is None:
            return
        try:
            _, tag = self.store.get_tagged(LEASE_KEY)
        except StoreMissing:
            tag = None
        if tag == self._tag:
            self.store.delete([LEASE_KEY])
        self._tag = None

    def _mine(self) -> bytes:
        return Holder.of_this_process(self.ttl, self.started, self.url).to_bytes()

    def _holder(self) -> Holder | None:
        try:
            return Holder.from_bytes(self.store.get(LEASE_KEY))
        except StoreMissing:
            return None

    def _refused(self, holder: Holder | None) -> LeaseRefused:
        where = f"{self.store.url}/{LEASE_KEY}"
        if holder is None:
            return LeaseRefused(f"another coordinator took the run's lease ({where}) at the same moment; start this "
                                "one again once it is gone")
        return LeaseRefused(f"another coordinator holds the run in {self.store.url}: {holder.describe()}; its lease "
                            f"({where}) expires at {_clock(holder.expires_at)} unless renewed. Stop it first, or start "
                            "this one again once its machine is gone")


class LeaseKeeper:
    """Renews ``lease`` every ``ttl/3`` seconds from the coordinator's periodic work, on a thread; sets
    :attr:`lost` (saying why) when the lease is another's, or cannot be renewed before it would expire."""

    def __init__(self, lease: Lease, name: str) -> None:
        self.lease = lease
        self.log = Named(log, name)
        self.lost = asyncio.Event()
        self.trouble = Trouble(f"the run's lease in {lease.store.url}", name, counts=False,
                               meanwhile=f"it is tried again every {lease.ttl / 3:g} s; the coordinator stops if it "
                                         f"cannot be renewed within {lease.ttl:g} s of the last renewal")
        self._renewed = time.monotonic()  # when the last renewal that worked began
        self._started = self._renewed  # when the renewal in flight (or the last one) began
        self._renewal: asyncio.Future | None = None
        self._due = False  # renew at the next tick (the lease has news: this coordinator's address)

    def announce(self, url: str) -> None:
        """This coordinator's address, written into the lease at the next tick."""
        self.lease.url = url
        self._due = True

    async def tick(self) -> None:
        """Look at the renewal in flight, and start the next one when it is due."""
        if self.lost.is_set():
            return
        if self._renewal is not None:
            if not self._renewal.done():
                self._expired()
                return
            self._finished(self._renewal)
            self._renewal = None
            if self.lost.is_set():
                return
        now = time.monotonic()
        if self._due or now - self._started >= self.lease.ttl / 3:
            self._started, self._due = now, False
            self._renewal = asyncio.ensure_future(asyncio.to_thread(self.lease.renew))

    def _finished(self, renewal: asyncio.Future) -> None:
        error = renewal.exception()
        if error is None:
            self._renewed = self._started
            self.trouble.ok()
        elif isinstance(error, LeaseLost):
            self._lose(f"{error}; this coordinator stops at once (it must not serve the run beside another)")
        else:
            self.trouble.failed(error)
            self._expired()

    def _expired(self) -> None:
        """The store has not renewed the lease for as long as it lasts: another coordinator may hold it now."""
        held = time.monotonic() - self._renewed
        if held >= self.lease.ttl:
            self._lose(f"the run's lease in {self.lease.store.url} could not be renewed for {held:.0f} s (its "
                       f"--store-lease is {self.lease.ttl:g} s), so another coordinator may take the run; this one "
                       "stops. Start it again once the store answers")

    def _lose(self, why: str) -> None:
        self.log.error("%s", why)
        self.lost.set()

    def release(self) -> None:
        """Delete the lease if it is still ours (a clean shutdown); a store that fails is said, not raised."""
        try:
            self.lease.release()
        except StoreError as e:
            self.log.warning("the run's lease in %s could not be released (%s); a successor waits until it expires "
                             "(%g s)", self.lease.store.url, e, self.lease.ttl)


def _clock(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))
