"""What the coordinator accepts from the network, and its limits: JSON bodies, joins, phase records, and each
host's telemetry budget. Anything else is a :class:`Refusal` naming what was wrong, before it reaches a round,
the run log or TensorBoard.

- JSON: UTF-8, at most ``MAX_JSON_BYTES`` (joins) or ``MAX_EVENTS_BYTES`` (events); no NaN, Infinity or numbers
  that overflow a float; nesting is bounded by the parser's recursion limit (refused, never a crash) and the
  accepted shapes are flat.
- Joins: a valid host id and the model's tensor specs (at most ``MAX_MODEL_BYTES`` of tensors).
- Phase records: at most ``MAX_RECORDS`` a batch, only the sender's own host id, only host phases, finite times,
  at most ``MAX_EXTRA_FIELDS`` extra fields of plain values (strings up to ``MAX_TEXT`` characters). A record that
  breaks these is dropped and counted in the answer; the rest of its batch is kept.
- Telemetry: at most ``TELEMETRY_BYTES_PER_MINUTE`` per host, refused with ``RATE_LIMITED`` beyond it.
"""

from __future__ import annotations

import json
import logging
import math
import re
import time
from dataclasses import dataclass

from ..core.logs import Named
from ..core.phases import COORDINATOR_PHASES, HOST_PHASES, RESTART, RSS, PhaseRecord
from ..core.protocol import MAX_VALUES_BYTES, VALUES_KEY, DataSpec, Reason, Refusal
from ..core.settings import check_host_id
from ..core.specs import PayloadError, TensorSpec, specs_from_json
from .config import NAME

MAX_JSON_BYTES = 16 << 20
MAX_EVENTS_BYTES = 4 << 20
MAX_MODEL_BYTES = 1 << 40
MAX_SAMPLES = 1 << 24  # per delta: a round's samples on one host (batch size x local steps)
MAX_RECORDS = 10_000
MAX_EXTRA_FIELDS = 16
MAX_TEXT = 256
MAX_INT = 1 << 62
TELEMETRY_BYTES_PER_MINUTE = 4 << 20
log = logging.getLogger(__name__)
_FIELD_NAME = re.compile(r"[a-z][a-z0-9_]{0,63}")
_RECORD_FIELDS = ("round", "host", "phase", "start", "end", "bytes")


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a number JSON allows")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} overflows a float")
    return value


def decode_json(body: bytes, what: str):
    """The JSON value of a request body, or INVALID naming the problem."""
    try:
        return json.loads(body.decode("utf-8"), parse_constant=_refuse_constant, parse_float=_finite_float)
    except RecursionError:
        raise Refusal(Reason.INVALID, f"{what}: JSON nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise Refusal(Reason.INVALID, f"{what}: not valid JSON: {e}") from None


def host_id(value: object, what: str = "host id") -> str:
    try:
        return check_host_id(value, what)
    except ValueError as e:
        raise Refusal(Reason.INVALID, f"{e}; set NODEOX_HOST_ID") from None


def model_bytes(specs: tuple[TensorSpec, ...]) -> int:
    return sum(s.nbytes for s in specs)


def parse_join(body: bytes) -> tuple[str, tuple[TensorSpec, ...], tuple[str | None, int | None]]:
    """The host id and tensor specs of a join request, and the model hash and round the host says it holds
    (both None on a first join; a resumed run takes its model back from such a host)."""
    usage = 'join needs a JSON body {"host": ID, "tensors": [[NAME, DTYPE, SHAPE], ...]}'
    value = decode_json(body, "join")
    if not isinstance(value, dict) or not isinstance(value.get("tensors"), list):
        raise Refusal(Reason.INVALID, f"{usage} (the model's tensor specs are required)")
    host = host_id(value.get("host"))
    try:
        specs = specs_from_json(value["tensors"])
    except PayloadError as e:
        raise Refusal(Reason.INVALID, f"join: {e}") from None
    size = model_bytes(specs)
    if not specs or size > MAX_MODEL_BYTES:
        raise Refusal(Reason.INVALID, f"join: a model of {len(specs)} tensors and {size} bytes is not supported "
                                      f"(1 to {MAX_MODEL_BYTES} bytes)")
    model_hash, round_ = value.get("model_hash"), value.get("round")
    if model_hash is None:
        return host, specs, (None, None)
    if not isinstance(model_hash, str) or len(model_hash) > MAX_TEXT:
        raise Refusal(Reason.INVALID, "join: model_hash must be a string (the hash of the model the host holds)")
    try:
        return host, specs, (model_hash, None if round_ is None else _int(round_, "join: round"))
    except ValueError as e:
        raise Refusal(Reason.INVALID, str(e)) from None


def parse_join_data(body: bytes) -> DataSpec | None:
    """The data a joining host declares (``"data"``: :class:`~lightning_nodeox.core.protocol.DataSpec`), or None."""
    value = decode_json(body, "join")
    data = value.get("data") if isinstance(value, dict) else None
    if data is None:
        return None
    try:
        return DataSpec.from_json(data)
    except ValueError as e:
        raise Refusal(Reason.INVALID, f"join: {e}") from None


MAX_LEASE_UNITS = 1024  # units one lease call may ask for


def parse_lease(body: bytes) -> tuple[int | None, int, int | None]:
    """A lease call's ``{"epoch": E or null, "units": K, "seq": N}`` (K: 1 when absent; N, the call's number, the
    same on a retry: optional)."""
    value = decode_json(body or b"{}", "lease")
    usage = 'a lease needs a JSON body {"epoch": E (the ledger epoch the host reads; null: the current one), "units": K}'
    if not isinstance(value, dict):
        raise Refusal(Reason.INVALID, usage)
    epoch, units, seq = value.get("epoch"), value.get("units", 1), value.get("seq")
    try:
        epoch = None if epoch is None else _int(epoch, "lease: epoch")
        units = _int(units, "lease: units")
        seq = None if seq is None else _int(seq, "lease: seq")
    except ValueError as e:
        raise Refusal(Reason.INVALID, f"{e}; {usage}") from None
    if not 1 <= units <= MAX_LEASE_UNITS:
        raise Refusal(Reason.INVALID, f"lease: units must be 1 to {MAX_LEASE_UNITS}, got {units}")
    return epoch, units, seq


def _int(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < MAX_INT:
        raise ValueError(f"{what} must be an integer in [0, 2^62), got {str(value)[:40]}")
    return value


def _time(value: object, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{what} must be a finite number of seconds, got {str(value)[:40]}")
    return float(value)


def _extra(key: str, value: object) -> object:
    if not _FIELD_NAME.fullmatch(key):
        raise ValueError(f"extra field name {key[:40]!r} is not lower_case_with_underscores of at most 64 characters")
    if value is None or isinstance(value, (bool, float)):
        return value  # floats are finite: the parser refuses the others
    if isinstance(value, int):
        if abs(value) >= MAX_INT:
            raise ValueError(f"extra field {key!r} is out of range")
        return value
    if isinstance(value, str) and len(value) <= MAX_TEXT:
        return value
    raise ValueError(f"extra field {key!r} must be a number, a boolean, null or a string of at most {MAX_TEXT} "
                     "characters")


SITE_PHASES = (*HOST_PHASES, *COORDINATOR_PHASES, RSS, RESTART)  # what a relay forwards of its site


def of_sender(named: object, sender: str) -> bool:
    """Whether a record naming host ``named`` may come from host ``sender``: its own, or (a site relay forwarding
    its site's records) ``SENDER/HOST``, each part a host id (``coordinator``: the relay's own coordinator side)."""
    if named == sender:
        return True
    if not isinstance(named, str) or not named.startswith(f"{sender}/"):
        return False
    parts = named[len(sender) + 1 :].split("/")
    try:
        for part in parts[:-1]:
            check_host_id(part)
        return parts[-1] == "coordinator" or check_host_id(parts[-1]) == parts[-1]
    except ValueError:
        return False


def phase_record(d: object, host: str) -> PhaseRecord:
    """One phase record sent by host ``host`` (its own, or its site's when it is a relay), checked field by field."""
    named = d.get("host") if isinstance(d, dict) else None
    if not of_sender(named, host):
        raise ValueError(f"a record must be an object naming its host ({host})")
    phase = d.get("phase")
    phases = HOST_PHASES if named == host else SITE_PHASES
    if phase not in phases:
        raise ValueError(f"phase {str(phase)[:40]!r} is not one of {', '.join(phases)}")
    start, end = _time(d.get("start"), "start"), _time(d.get("end"), "end")
    if end < start:
        raise ValueError(f"record ends ({end}) before it starts ({start})")
    size = d.get("bytes")
    extra = {k: v for k, v in d.items() if k not in _RECORD_FIELDS}
    if len(extra) > MAX_EXTRA_FIELDS:
        raise ValueError(f"a record has {len(extra)} extra fields; at most {MAX_EXTRA_FIELDS}")
    return PhaseRecord(_int(d.get("round"), "round"), named, phase, start, end,
                       None if size is None else _int(size, "bytes"), {k: _extra(k, v) for k, v in extra.items()})


@dataclass
class Batch:
    """An events batch: the records that passed, and how many were dropped (with the first one's reason)."""

    records: list[PhaseRecord]
    dropped: int = 0
    first_error: str = ""

    def answer(self) -> dict:
        return {"written": len(self.records), "dropped": self.dropped,
                **({"error": self.first_error} if self.dropped else {})}


def parse_records(body: bytes, host: str, name: str = NAME) -> Batch:
    """The phase records of an events request sent by ``host``: a bad record is dropped and counted, the others
    kept; the whole batch is refused only when it is malformed (not JSON, not a list of records, too many,
    another host's records) or none of its records passes. ``name``: what a line about dropped records starts
    with (its run's)."""
    usage = 'events need {"records": [{round, host, phase, start, end[, bytes, ...]}, ...]}'
    value = decode_json(body, "events")
    records = value.get("records") if isinstance(value, dict) else None
    if not isinstance(records, list):
        raise Refusal(Reason.INVALID, usage)
    if len(records) > MAX_RECORDS:
        raise Refusal(Reason.INVALID, f"{len(records)} records in one batch; send at most {MAX_RECORDS}")
    for d in records:
        if isinstance(d, dict) and not of_sender(d.get("host", host), host):
            raise Refusal(Reason.FORBIDDEN, f"record of host {str(d.get('host'))[:70]!r} sent by host {host}: a host "
                                            "sends only its own records")
    batch = Batch([])
    for d in records:
        try:
            batch.records.append(phase_record(d, host))
        except ValueError as e:
            batch.dropped += 1
            batch.first_error = batch.first_error or f"events refused: {e}"
    if batch.dropped and not batch.records:
        raise Refusal(Reason.INVALID, batch.first_error)
    if batch.dropped:
        _report_dropped(host, batch, name)
    return batch


_dropped_reported: dict[str, float] = {}  # host -> when its dropped records were last logged


def _report_dropped(host: str, batch: Batch, name: str, every: float = 60.0) -> None:
    now = time.monotonic()
    if now - _dropped_reported.get(host, -every) >= every:
        _dropped_reported[host] = now
        Named(log, name).warning("host %s sent %d bad phase records among %d (dropped; the first: %s)", host,
                                 batch.dropped, batch.dropped + len(batch.records), batch.first_error)


class TelemetryBudget:
    """A byte budget per host and minute (a token bucket: it refills continuously)."""

    def __init__(self, bytes_per_minute: int = TELEMETRY_BYTES_PER_MINUTE) -> None:
        self.capacity = bytes_per_minute
        self._left: dict[str, tuple[float, float]] = {}  # host -> (bytes left, when)

    def charge(self, host: str, size: int, now: float | None = None) -> None:
        """Take ``size`` bytes from ``host``'s budget, or refuse with RATE_LIMITED (nothing taken)."""
        now = time.monotonic() if now is None else now
        left, then = self._left.get(host, (float(self.capacity), now))
        left = min(float(self.capacity), left + (now - then) * self.capacity / 60.0)
        if size > left:
            self._left[host] = (left, now)
            raise Refusal(Reason.RATE_LIMITED, f"host {host} sent more than {self.capacity} bytes of phase records "
                                               "in a minute; the rest waits (records are batched once a second)")
        self._left[host] = (left - size, now)


def values_key(key: str) -> str:
    """A values key as a path names it, or INVALID."""
    if not VALUES_KEY.fullmatch(key):
        raise Refusal(Reason.INVALID, f"values key {key[:64]!r} must be 1 to 200 of A-Z a-z 0-9 _ . : = -")
    return key


def parse_values(body: bytes) -> object:
    """The payload of a values post (``{"payload": ...}``, at most ``MAX_VALUES_BYTES``), or INVALID."""
    if len(body) > MAX_VALUES_BYTES:
        raise Refusal(Reason.TOO_LARGE, f"values payload of {len(body)} bytes is larger than {MAX_VALUES_BYTES}",
                      limit=MAX_VALUES_BYTES)
    d = decode_json(body, "values")
    if not isinstance(d, dict) or "payload" not in d:
        raise Refusal(Reason.INVALID, 'values: expected {"payload": ...}')
    return d["payload"]


def parse_sizes(body: bytes) -> list[int]:
    """The part sizes of a delta-place request (``{"sizes": [bytes, ...]}``), or INVALID."""
    d = decode_json(body, "delta-place")
    sizes = d.get("sizes") if isinstance(d, dict) else None
    if not isinstance(sizes, list) or not all(type(n) is int and 0 < n <= MAX_MODEL_BYTES for n in sizes):
        raise Refusal(Reason.INVALID, 'delta-place: expected {"sizes": [bytes of each part, ...]}')
    return sizes


def parse_place(body: bytes) -> str:
    """The place id of a delta written to the store (``{"id": ...}``), or INVALID."""
    d = decode_json(body, "delta")
    place = d.get("id") if isinstance(d, dict) else None
    if not isinstance(place, str) or not 0 < len(place) <= MAX_TEXT:
        raise Refusal(Reason.INVALID, 'a delta in the store is posted as {"id": PLACE_ID}, the id its delta-place '
                                      "returned")
    return place
