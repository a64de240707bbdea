"""The figures benchmarks/convergence.py reads from one run's events (defined in its docstring, under
"Definitions"): a host's phase records, its wait share, the bytes of its deltas and its largest exchange, and the
bytes one DDP rank sends."""

from __future__ import annotations

from convergence_modes import HOSTS


def wait_share(records: list[dict], first_round: int = 1) -> float | None:
    """Share of one host's time in which its trainer did not train.

    ``records``: the host's phase records from events.jsonl; only rounds from ``first_round`` on count (round 0
    absorbs the hosts' different start-up times: the first host to join waits there for the others to start).
    Total time runs from the host's first counted ``train`` start to its last record's end; trained time is its
    ``train`` records less its ``fold`` records (with overlap, a fold stops training inside a round).
    """
    records = [r for r in records if r["round"] >= first_round]
    trains = [r for r in records if r["phase"] == "train"]
    if not trains:
        return None
    start = min(r["start"] for r in trains)
    end = max(r["end"] for r in records)
    trained = sum(r["end"] - r["start"] for r in trains) - sum(r["end"] - r["start"] for r in records
                                                             if r["phase"] == "fold")
    return max(0.0, 1.0 - trained / (end - start)) if end > start else None


def host_records(events: list[dict], host: str) -> list[dict]:
    """Host ``host``'s phase records in the root's events.jsonl: its own, or forwarded by its relay (``RELAY/HOST``)."""
    return [e for e in events if str(e.get("host")).rsplit("/", 1)[-1] == host and e.get("phase") not in ("rss", None)]


def ddp_bytes_per_host(param_bytes: int, steps: int, ranks: int = HOSTS) -> int:
    """Bytes one rank sends in ``steps`` ring all-reduces of every fp32 gradient: 2(N-1)/N x gradient bytes each."""
    return int(steps * param_bytes * 2 * (ranks - 1) / ranks)


def nodeox_bytes_sent(records: list[dict]) -> int:
    """Bytes a host sent in its deltas: the ``bytes`` of its ``upload`` records."""
    return sum(int(r.get("bytes") or 0) for r in records if r["phase"] == "upload")


def peak_exchange_bytes(records: list[dict]) -> tuple[int, int]:
    """A host's largest delta before its last round, and its last round's (with fragments: every tensor)."""
    uploads = [r for r in records if r["phase"] == "upload" and r.get("bytes") and not r.get("empty")]
    if not uploads:
        return 0, 0
    last = max(r["round"] for r in uploads)
    before = [int(r["bytes"]) for r in uploads if r["round"] != last]
    return max(before, default=0), max(int(r["bytes"]) for r in uploads if r["round"] == last)
