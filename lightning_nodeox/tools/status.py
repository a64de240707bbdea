"""``nodeox status URL|RUN_DIR [--watch]``: the run's live state in a terminal, for people on SSH.

Given a run directory, it asks the coordinator whose URL the directory records (``coordinator.json``); once that
coordinator has exited, it reads the run's saved state (``state/run.json``) instead: a completed run is said in one
line (exit 0), a run stopped before its end too, with how to resume it (exit 1).

One table from ``GET /v1/status`` (its ``live`` part, :mod:`lightning_nodeox.coordinator.watch`): the run's
state, round and model hash, the coordinator's memory and link throughput, and per host its state, lease age,
last round, wait share, bytes per round, last loss and sync_dist values (and with the coordinator's
``--gpu-hour-price``, what its waiting cost). A run whose hosts let the coordinator share out their data adds the
data ledger (``GET /v1/status``'s ``data``): the epoch and its progress, its units committed, held and free, and per
host the samples leased, committed, in flight and returned, and the units it holds. A run under ``--merge async``
adds the merge's line (``merge``: the quorum, the late deltas merged, how the last round closed). ``--watch`` redraws it every
``--interval`` seconds until the run completes or fails (Ctrl-C stops watching). The token comes from
``--token-file`` (else ``NODEOX_TOKEN``), a CA from ``NODEOX_CA_FILE``.

Exit status: 0 while the run runs or once it completed, 1 when it failed (every host left before the end, or
a run directory's run stopped unfinished), 2 when the coordinator cannot be reached or refuses (a wrong token).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from ..core.protocol import Refusal, Unreachable
from ..core.settings import ENV_CA_FILE, ENV_TOKEN, RUN_DIR_TOKEN
from ..core.transport import HostClient
from ..host.client import HttpClient
from .columns import aligned, human_bytes

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
    lines.append("")
    lines += aligned(rows)
    if status.get("data"):
        lines += ["", *render_data(status["data"])]
    if status.get("merge"):
        lines += ["", render_merge(status["merge"])]
    return "\n".join(lines)


def render_merge(merge: dict) -> str:
    """The async merge's line (``GET /v1/status``'s ``merge``, ``Quorum.status()``): its settings, then how the
    last round closed."""
    line = (f"merge: async, quorum {merge['min_quorum']}, grace {merge['grace_s']:.2f} s, max staleness "
            f"{merge['max_staleness']} ({merge['staleness_rule']}); {merge['late_deltas']} late deltas merged")
    last = merge["last"]
    if last:
        stale = ", ".join(f"{h} ({s} round{'s' if s != 1 else ''} late)" for h, s in last["stale"].items()) or "none"
        line += (f"; round {last['round']} closed without {', '.join(last['late']) or 'no host'}, late deltas in it: "
                 f"{stale}")
    return line


def render_data(data: dict) -> list[str]:
    """The data ledger's lines (``GET /v1/status``'s ``data``, ``DataLedger.status()``): the epoch's progress, then
    a row per host, its counts in samples over the run."""
    lines = [f"data: epoch {data['epoch']}, {data['epoch_committed_samples']} of {data['samples']} samples committed "
             f"({data['epoch_committed_fraction']:.0%}); units of {data['unit_size']}: {data['units_committed']} "
             f"committed, {data['units_held']} held, {data['units_free']} free of {data['units']}"]
    rows = [["data host", "leased", "committed", "in flight", "returned", "units held"]]
    for name, h in data["hosts"].items():
        rows.append([name if h["present"] else f"{name} (gone)", *(str(h[k]) for k in (
            "leased", "committed", "in_flight", "returned", "units_held"))])
    return lines + aligned(rows)


def main(target: str, *, token: str | None = None, watch: bool = False, interval: float = 2.0) -> int:
    """``nodeox status URL|RUN_DIR``: over HTTP(S) to the coordinator (or relay) at the URL, or the one a run
    directory records (its saved state once it has exited)."""
    token = token or os.environ.get(ENV_TOKEN) or None
    if Path(target).is_dir():
        return from_run_dir(Path(target), token=token, watch=watch, interval=interval)
    if not target.startswith(("http://", "https://")):
        print(f"nodeox status: {target} is neither a URL (http://HOST:PORT, as the coordinator printed) nor a run "
              "directory", file=sys.stderr)
        return 2
    return from_url(target, token=token, watch=watch, interval=interval)


def from_run_dir(run_dir: Path, *, token: str | None, watch: bool, interval: float) -> int:
    """The run in ``run_dir``: live from its coordinator while it serves, else from its saved state."""
    try:
        url = json.loads((run_dir / "coordinator.json").read_text())["url"]
    except (OSError, ValueError, KeyError):
        url = None
    token_file = run_dir / RUN_DIR_TOKEN
    if token is None and token_file.exists():
        token = token_file.read_text().strip() or None
    if url is not None:
        client = _client(url, token)
        try:
            client.status()
        except Unreachable:
            pass  # exited: its saved state says how the run stands
        else:
            return show(client, watch=watch, interval=interval)
    return saved(run_dir)


def saved(run_dir: Path) -> int:
    """One line from ``run_dir``'s ``state/run.json``: 0 for a completed run, 1 for one stopped unfinished, 2 for
    none."""
    try:
        run = json.loads((run_dir / "state" / "run.json").read_text())
        round_, model, complete = int(run["round"]), str(run["model_hash"]), bool(run["complete"])
    except (OSError, ValueError, KeyError, TypeError):
        print(f"nodeox status: {run_dir} holds no coordinator that answers and no saved run (state/run.json); "
              "give the coordinator's URL", file=sys.stderr)
        return 2
    if complete:
        print(f"{run_dir}: run complete after {round_} rounds, model {model} (the coordinator has exited; "
              f"nodeox report {run_dir} for its figures)")
        return 0
    print(f"{run_dir}: run stopped unfinished at round {round_}, model {model}, saved; start its coordinator "
          "(or the same nodeox launch) again on this run directory to resume it")
    return 1


def _client(url: str, token: str | None) -> HttpClient:
    return HttpClient(url, host="status", token=token, ca_file=os.environ.get(ENV_CA_FILE), retry_for=0.0,
                      read_timeout=10.0, check="Check the URL and that the coordinator is running there.")


def from_url(url: str, *, token: str | None, watch: bool, interval: float) -> int:
    """The run served at ``url``."""
    return show(_client(url, token), watch=watch, interval=interval)


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
