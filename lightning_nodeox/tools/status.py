"""``nodeox status URL [--watch]``: the run's live state in a terminal, for people on SSH.

One table from ``GET /v1/status`` (its ``live`` part, :mod:`lightning_nodeox.coordinator.watch`): the run's
state, round and model hash, the coordinator's memory and link throughput, and per host its state, lease age,
last round, wait share, bytes per round, last loss and sync_dist values (and with the coordinator's
``--gpu-hour-price``, what its waiting cost). ``--watch`` redraws it every ``--interval`` seconds until the run
completes or fails (Ctrl-C stops watching). The token comes from ``--token-file`` (else ``NODEOX_TOKEN``), a CA
from ``NODEOX_CA_FILE``.

Exit status: 0 while the run runs or once it completed, 1 when it failed (every host left before the end),
2 when the coordinator cannot be reached or refuses (a wrong token).
"""

from __future__ import annotations

import os
import sys
import time

from ..core.protocol import Refusal, Unreachable
from ..core.settings import ENV_CA_FILE, ENV_TOKEN
from ..core.transport import HostClient
from ..host.client import HttpClient
from .columns import human_bytes

FAILED = ("hosts gone",)
DONE = ("complete", *FAILED)
CLEAR = "\x1b[H\x1b[2J"


def _value(x: float | None) -> str:
    return "-" if x is None else f"{x:.4g}"


def render(status: dict) -> str:
    """The table of one ``GET /v1/status`` answer."""
    live = status["live"]
    memory = live.get("coordinator") or {}
    published = live["published_round"]
    link = live.get("link_bytes_per_s")
    lines = [(f"{live['name']}: {live['state']}, round {live['round']}"
              f" (published {published if published >= 0 else '-'}), model {live['model_hash'] or '-'}"),
             (f"coordinator RSS {human_bytes(memory.get('rss_bytes'))} (peak {human_bytes(memory.get('peak_rss_bytes'))}); "
              f"links {human_bytes(link) + '/s' if link is not None else '-'}")]
    if "relay" in status:  # a site relay's page: its site's hosts, under its upstream
        lines[0] += f"; relay {status['relay']} under {status['upstream']}"
    priced = live.get("gpu_hour_price") is not None
    if priced:
        lines.append(f"waiting has cost {live['wait_cost']:.2f} at {live['gpu_hour_price']:g} per GPU-hour")
    rows = [["host", "state", "lease age", "last round", "wait share", "bytes/round", "last loss",
             *(["waiting cost"] if priced else []), "sync_dist values"]]
    for h in live["hosts"]:
        rows.append([h["id"], h["state"], "-" if h["lease_age_s"] is None else f"{h['lease_age_s']:.1f} s",
                     "-" if h["last_round"] is None else str(h["last_round"]),
                     "-" if h["wait_share"] is None else f"{h['wait_share']:.0%}", human_bytes(h["bytes_per_round"]),
                     _value(h["loss"]), *([f"{h['wait_cost']:.2f}"] if priced else []),
                     ", ".join(f"{k} {_value(v)}" for k, v in h["metrics"].items()) or "-"])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines.append("")
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join(lines)


def main(url: str, *, token: str | None = None, watch: bool = False, interval: float = 2.0) -> int:
    """``nodeox status URL``: over HTTP(S) to the coordinator (or relay) at ``url``."""
    token = token or os.environ.get(ENV_TOKEN) or None
    client = HttpClient(url, host="status", token=token, ca_file=os.environ.get(ENV_CA_FILE), retry_for=0.0,
                        read_timeout=10.0, check="Check the URL and that the coordinator is running there.")
    return show(client, watch=watch, interval=interval)


def show(client: HostClient, *, watch: bool = False, interval: float = 2.0) -> int:
    """Print the run's status as ``client`` reads it, once or (``watch``) until the run has ended; the exit status
    says how it stands (0 running or complete, 1 failed, 2 unreachable or refused)."""
    clear = watch and sys.stdout.isatty()
    try:
        while True:
            try:
                status = client.status()
            except Unreachable as e:
                print(f"nodeox status: {e}", file=sys.stderr)
                return 2
            except Refusal as e:
                print(f"nodeox status: {e}; pass --token-file with the coordinator's token", file=sys.stderr)
                return 2
            print((CLEAR if clear else "") + render(status), flush=True)
            state = status["live"]["state"]
            if not watch or state in DONE:
                return 1 if state in FAILED else 0
            time.sleep(interval)
            if not clear:
                print()
    except KeyboardInterrupt:
        return 0
