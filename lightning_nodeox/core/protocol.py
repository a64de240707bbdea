"""The protocol between hosts and the coordinator: routes, headers, typed replies, and the outcome of each call.

The round logic on both sides speaks only in these terms. A refusal is a :class:`Refusal` with a
:class:`Reason`; an upload ends in an :class:`Upload` outcome; waiting for a sync ends in a :class:`SyncReply`.
HTTP lives only in the host's client (``host/client.py``) and the coordinator's server
(``coordinator/server.py``), which translate with :data:`HTTP_STATUS`; a new transport is a new pair of those.

    GET  /v1/health                          liveness (no token needed)
    GET  /v1/status                          round, hosts, model hash
    POST /v1/join                            {"host", "tensors", "model_hash", "round"} -> JoinReply (with the
                                             host's credential)
    PUT  /v1/model?host=H                    the initial model (only the host told to provide it)
    GET  /v1/model?host=H                    the full model, materialized only on this request
    POST /v1/rounds/{r}/delta?host=H         a delta (accepted once checked; aggregation goes on behind)
    GET  /v1/rounds/{r}/sync?wait=S&host=H   round r's sync (not ready within S seconds: try again)
         (both: &training=1 when the host's training goes on meanwhile, its round overlapped; absent: it waits)
    POST /v1/events?host=H                   {"records": [...]} phase records of host H only
    POST /v1/hosts/{h}/leave                 the host takes no further part
    POST /v1/hosts/{h}/heartbeat             the host is alive -> {"lease": seconds}
    POST /v1/values/{key}?wait=S&host=H      {"payload": ...} this host's values under key -> ValuesReply once
                                             answered (not within S seconds: post again, idempotent)
    POST /v1/data/lease?host=H               {"epoch": E or null, "units": K, "seq": N} -> a ledger reply (lease,
                                             wait or epoch_end: core.ledger_terms), for a host that declared its
                                             data; N numbers the call (a retry, the same N: the same reply)

The data ledger (docs/ledger.md): a host that lets the coordinator share out its epochs declares its data at
join (``"data": DataSpec.to_json()``; every host of a run must declare the same); the run's unit size is the
coordinator's ``--data-unit``, not the host's (spans carry their positions, so a host never needs it). A delta
of such a host says what it trained in its metadata (``covered``: :class:`~.ledger_terms.Covered`, optional).
A covered report under a void lease is refused as ``LEASE_VOID`` (the host drops its spans and leases again);
a report that names a unit never leased to it, or one already committed, as ``INVALID``.

With a store (``--store``), a sync or model reply may instead be a :data:`PLACE`: where its parts are in the store
(``{"size", "complete", "within", "parts": [{"url", "size"}]}``), read in order; ``&direct=1`` on either asks for
the bytes (the host could not read the store). With ``--store-deltas`` (the join reply's ``store_deltas``) a host
asks ``POST /v1/rounds/{r}/delta-place?host=H`` ``{"sizes": [...]}`` where to write its delta's parts (header,
pieces, trailer) -> ``{"id", "parts": [{"url", "size"}]}``, writes them (a PUT each), then posts the delta as a
:data:`PLACE` body ``{"id"}``; the coordinator reads the parts from the store.

Every call but health carries the run's bearer token when one is configured; every call that names a host
(all but health, status and a first join) also carries that host's credential, which its join returned, in
``X-Nodeox-Credential``: a token holder cannot act as another host.
"""

from __future__ import annotations

import enum
import re
from dataclasses import asdict, dataclass
from typing import Protocol

from .codecs.settings import CodecSettings, settings_from_json

API = "/v1"
HEALTH = f"{API}/health"
STATUS = f"{API}/status"
JOIN = f"{API}/join"
MODEL = f"{API}/model"
DELTA = API + "/rounds/{round}/delta"
DELTA_PLACE = API + "/rounds/{round}/delta-place"
SYNC = API + "/rounds/{round}/sync"
EVENTS = f"{API}/events"
LEAVE = API + "/hosts/{host}/leave"
HEARTBEAT = API + "/hosts/{host}/heartbeat"
VALUES = API + "/values/{key}"
DATA_LEASE = f"{API}/data/lease"
VALUES_KEY = re.compile(r"[A-Za-z0-9_.:=-]{1,200}")  # what a values key may be (it travels in a path)
MAX_VALUES_BYTES = 1 << 20  # one host's values payload, as JSON

TIME_HEADER = "X-Nodeox-Time"  # the coordinator's clock, on every response (hosts align their records to it)
CREDENTIAL_HEADER = "X-Nodeox-Credential"  # the host's credential, from its join reply
COMPLETE_HEADER = "X-Nodeox-Complete"  # "1" on a sync reply: the run completed with this round (or before it)
HELD_HEADER = "X-Nodeox-Held"  # on a sync reply: the later round whose sync carries the host's delta (--merge async)
OCTETS = "application/octet-stream"
PLACE = "application/vnd.nodeox.place+json"  # a sync or model reply saying where it is in the run's store


class Reason(enum.Enum):
    """Why the coordinator refused a call."""

    INVALID = "invalid"  # malformed or inconsistent request: the caller's bug, not retried
    UNAUTHORIZED = "unauthorized"  # missing or wrong token
    FORBIDDEN = "forbidden"  # missing or wrong credential of the host named: only that host may act for it
    ID_IN_USE = "id_in_use"  # another live process joined with this host id
    FULL = "full"  # the run already has its --hosts hosts (and is not --elastic)
    NOT_JOINED = "not_joined"  # the host must join first
    NO_MODEL = "no_model"  # the run has no model yet
    HAS_MODEL = "has_model"  # an initial model was offered but the run already has one
    NOT_PROVIDER = "not_provider"  # another host provides the initial model
    NOT_OPEN = "not_open"  # the round named is not open
    LATE = "late"  # the round closed without this delta; its sync can still be applied
    STALE_BASE = "stale_base"  # the delta was computed against another model: fetch the model
    DUPLICATE = "duplicate"  # the coordinator already has this delta (a retry)
    GONE = "gone"  # the sync asked for was replaced: fetch the model
    NO_DELTA = "no_delta"  # the coordinator holds no delta of this host for the open round (it restarted): send it again
    BUSY = "busy"  # too many transfers in flight (or one of this host's already): try again shortly
    TOO_SLOW = "too_slow"  # a transfer took longer than its time limit (base + size at 1 MB/s)
    LENGTH_REQUIRED = "length_required"
    TOO_LARGE = "too_large"
    RATE_LIMITED = "rate_limited"  # over a budget (telemetry bytes per minute): send less, later
    LEASE_VOID = "lease_void"  # the delta's data lease is void (core.ledger_terms.LeaseVoid): drop it, lease again


HTTP_STATUS = {
    Reason.INVALID: 400, Reason.UNAUTHORIZED: 401, Reason.NOT_JOINED: 409, Reason.NO_MODEL: 409,
    Reason.HAS_MODEL: 409, Reason.NOT_PROVIDER: 409, Reason.NOT_OPEN: 409, Reason.LATE: 409,
    Reason.STALE_BASE: 409, Reason.DUPLICATE: 409, Reason.GONE: 410, Reason.LENGTH_REQUIRED: 411,
    Reason.TOO_LARGE: 413, Reason.NO_DELTA: 409, Reason.BUSY: 503, Reason.TOO_SLOW: 408,
    Reason.FORBIDDEN: 403, Reason.ID_IN_USE: 409, Reason.FULL: 409, Reason.RATE_LIMITED: 429,
    Reason.LEASE_VOID: 409,
}


class Refusal(Exception):
    """The coordinator refused a call; ``reason`` says why, ``extra`` carries what the caller may need."""

    def __init__(self, reason: Reason, message: str, **extra) -> None:
        super().__init__(message)
        self.reason = reason
        self.extra = extra


class Unreachable(ConnectionError):
    """The coordinator did not answer within the retry budget."""


class TlsMismatch(Unreachable):
    """The coordinator cannot be talked to as configured (``http://`` for a TLS coordinator, ``https://`` for a
    plain one, a certificate this host does not trust): no retry mends it, the message names the fix."""


class TransferBroken(OSError):
    """A download broke off half-way; asking again may succeed."""


class Cancelled(RuntimeError):
    """This host stopped waiting for the coordinator (its training was interrupted)."""


@dataclass(frozen=True)
class JoinReply:
    """What a host learns when it joins: the round, the model's hash, the codec, whether it must provide
    the initial model (``provide_model``) or ask again later (``retry``: another host is providing it), and the
    ``credential`` its later calls must carry (empty on ``retry``: it has not joined yet)."""

    round: int
    model_hash: str | None
    codec: CodecSettings
    provide_model: bool = False
    retry: bool = False
    complete: bool = False
    credential: str = ""
    store_deltas: bool = False  # write deltas to the run's store (``DELTA_PLACE``) instead of posting their bytes

    def to_json(self) -> dict:
        return {**asdict(self), "codec": self.codec.to_json()}

    @classmethod
    def from_json(cls, d: dict) -> JoinReply:
        return cls(round=int(d["round"]), model_hash=d.get("model_hash"), codec=settings_from_json(d["codec"]),
                   provide_model=bool(d.get("provide_model")), retry=bool(d.get("retry")),
                   complete=bool(d.get("complete")), credential=str(d.get("credential") or ""),
                   store_deltas=bool(d.get("store_deltas")))


@dataclass(frozen=True)
class DataSpec:
    """The data a host trains on, declared at join when the coordinator shares out its epochs (the data ledger):
    the dataset's length, the order's seed, whether it is shuffled. Every host of a run declares the same."""

    samples: int
    seed: int = 0
    shuffle: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.samples, bool) or not isinstance(self.samples, int) or not 0 < self.samples < 2**62:
            raise ValueError(f"a dataset's length must be a positive integer, got {self.samples!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**63:
            raise ValueError(f"the data order's seed must be an integer in [0, 2^63), got {self.seed!r}")

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: object) -> DataSpec:
        if not isinstance(d, dict) or "samples" not in d:
            raise ValueError('data must be {"samples": N, "seed": S, "shuffle": true|false}')
        return cls(samples=d["samples"], seed=d.get("seed", 0), shuffle=bool(d.get("shuffle", True)))


class Upload(enum.Enum):
    """What became of a delta. Every outcome but ``TAKEN`` also voids the host's data lease, if it holds one (the
    coordinator gave its units back): the host drops its spans and leases again."""

    TAKEN = "taken"  # part of the round (also a retry of a delta already taken)
    LATE = "late"  # the round closed without it; its sync can still be applied
    STALE_BASE = "stale_base"  # computed against another model: the host must fetch the model
    LEASE_VOID = "lease_void"  # it reported data under a void lease: refused; its sync can still be applied


class ByteStream(Protocol):
    """A body being received: ``size`` bytes, read with ``readinto``; ``close`` when done."""

    size: int

    def readinto(self, view: memoryview) -> int: ...

    def close(self) -> None: ...


@dataclass
class SyncReady:
    """Round ``round``'s sync, streaming; ``complete``: the run completed with this round; ``held``: the later
    round whose sync carries this host's latest delta (a late delta, merged there: the host applies the syncs up
    to that one), None when it is this one's or an earlier one's."""

    round: int
    body: ByteStream
    complete: bool
    held: int | None = None


@dataclass
class RunComplete:
    """The run completed before the round asked for closed: there is no sync to apply."""


@dataclass
class SyncGone:
    """The sync asked for was replaced by a later one: the host fell behind and must fetch the model."""


SyncReply = SyncReady | RunComplete | SyncGone


@dataclass(frozen=True)
class ValuesReply:
    """A values key answered: the hosts whose payloads it holds (in host order), and those payloads."""

    key: str
    hosts: list[str]
    payloads: list

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> ValuesReply:
        return cls(key=str(d["key"]), hosts=[str(h) for h in d["hosts"]], payloads=list(d["payloads"]))


def read_fully(body: ByteStream, view: memoryview) -> None:
    """Fill ``view`` from ``body``; :class:`TransferBroken` if it ends early."""
    pos = 0
    while pos < len(view):
        n = body.readinto(view[pos:])
        if not n:
            raise TransferBroken(f"transfer broke off after {pos} of {len(view)} bytes")
        pos += n

