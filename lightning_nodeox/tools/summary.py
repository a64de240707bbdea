"""The run's summary that ``nodeox report`` prints by default: one screen, however many rounds.

- With ``--gpu-hour-price P``, first what the run cost and what its waiting cost.
- Per host (every host that trains; a site's as ``SITE/HOST``): its GPUs (the ``ranks`` of its ``train``
  records), GPU time (one unit for the table: GPU-seconds, or GPU-hours from an hour on) training (``train``),
  waiting (``wait``: its training stood still for a sync) and exchanging (the rest of its span, from its first
  record to its last: encoding, uploading, applying syncs, fetching the model, joining), its mean wait share,
  bytes up and down, and with a price what its waiting cost.
- The run's totals (rounds, hosts, wall time, bytes, coordinator memory, full-model fetches), each site's.
- Quantiles (p50, p90, p99, max) of every phase over every round and host, of the coordinator's phases, of
  aggregation-to-sync and of the round time (from the previous round's sync published to this round's). With
  relays these are the root's senders' (the relays', and hosts straight to the root), and ``train`` is every
  host's, in the sites too. An aggregation-to-sync below 0 (a streamed round's overlap) is said so under them.
- The slowest rounds, each with what made it slow: the phases furthest above their median, on a host or on the
  coordinator. A host's ``wait`` (and ``poll``) is what the others' slowness costs it, so it is never the reason.
"""

from __future__ import annotations

import heapq
import statistics
from collections import defaultdict

from ..core import phases as P
from .columns import HOST_COLUMNS

SLOWEST = 5  # slowest rounds listed
NOT_A_CAUSE = (P.WAIT, P.POLL, "sync")  # effects of others' slowness (sync: the sum of its parts, listed apart)
OFF_THE_PATH = (P.PERSIST, P.RECEIVE)  # coordinator phases no round waits for (a receive overlaps training)
QUANTILES = (0.5, 0.9, 0.99)
EVERY_HOST_TRAIN = "train (every host)"  # with relays: the root's rows are its senders', this row every host's
OVERLAP_NOTE = ("  (aggregation-to-sync below 0: the round was streamed, the hosts' sync downloads started before "
                "its aggregation ended; the seconds below 0 are that overlap)")


def quantile(ordered: list[float], q: float) -> float:
    """The ``q`` quantile of sorted ``ordered`` (linear between the closest ranks)."""
    pos = q * (len(ordered) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _coordinator(host: str) -> bool:
    return host == P.COORDINATOR or host.endswith("/" + P.COORDINATOR)


def per_host(records: list[dict]) -> dict[str, dict]:
    """Each training host's totals (a relay, a host of its upstream, is not one: its site's hosts are)."""
    acc: dict[str, dict] = {}
    for r in records:
        host, phase = str(r["host"]), r["phase"]
        if phase == P.RSS or _coordinator(host):
            continue
        a = acc.get(host)
        if a is None:
            a = acc[host] = {"first": r["start"], "last": r["end"], "train_s": 0.0, "wait_s": 0.0, "gpus": 1,
                             "up_bytes": 0, "down_bytes": 0, "rounds": set(), "fallback_fetches": 0}
        a["first"], a["last"] = min(a["first"], r["start"]), max(a["last"], r["end"])
        d = r["end"] - r["start"]
        if phase == P.TRAIN:
            a["train_s"] += d
            a["rounds"].add(r["round"])
            a["gpus"] = max(a["gpus"], int(r.get("ranks") or 1))
        elif phase == P.WAIT:
            a["wait_s"] += d
        elif phase == P.UPLOAD:
            a["up_bytes"] += r.get("bytes") or 0
        elif phase in (P.DOWNLOAD, P.FALLBACK_FETCH):
            a["down_bytes"] += r.get("bytes") or 0
            a["fallback_fetches"] += phase == P.FALLBACK_FETCH
    relays = {h.rsplit("/", 1)[0] for h in acc if "/" in h}
    relays |= {p for h in relays for p in _prefixes(h)}
    out = {}
    for host in sorted((h for h in acc if h not in relays), key=host_key):
        a = acc[host]
        span = a.pop("first"), a.pop("last")
        a["span_s"] = span[1] - span[0]
        a["exchange_s"] = max(0.0, a["span_s"] - a["train_s"] - a["wait_s"])
        a["rounds"] = len(a["rounds"])
        out[host] = a
    return out


def _prefixes(host: str) -> list[str]:
    parts = host.split("/")
    return ["/".join(parts[:i]) for i in range(1, len(parts))]


def host_key(h: str) -> tuple:
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in h.split("/"))


def _wait_shares(summary: dict, prefix: str = "") -> dict[str, float]:
    shares = {prefix + h: v for h, v in summary.get("mean_wait_share", {}).items()}
    for name, site in summary.get("sites", {}).items():
        shares.update(_wait_shares(site, f"{prefix}{name}/"))
    return shares


def samples(rnd: dict, prefix: str = "") -> list[tuple[tuple[str, str], str, float]]:
    """A round's timed values, ``((site, what), host, seconds)`` each (``host`` "" for the coordinator's own):
    host phases per host, the coordinator's phases (receive per host), aggregation-to-sync per host; its sites'
    too (``site`` their path, ``SITE/``)."""
    out = [((prefix, ph), h, v) for ph, s in rnd["host_phases"].items() for h, v in s["per_host"].items()]
    for ph, v in rnd["coordinator_phases"].items():
        if ph == P.RECEIVE:
            out += [((prefix, "coordinator receive"), h, x) for h, x in v["per_host"].items()]
        else:
            out.append(((prefix, "coordinator " + ph), "", v))
    out += [((prefix, "aggregation-to-sync"), h, v) for h, v in rnd["aggregation_to_sync"]["per_host"].items()]
    for name, site in rnd.get("sites", {}).items():
        out += samples(site, f"{prefix}{name}/")
    return out


def label(key: tuple[str, str], host: str) -> str:
    """What a sample of :func:`samples` is, in words (``train on host A/0``, ``relay A: coordinator aggregate``)."""
    site, what = key
    on = f"relay {site[:-1]}: " if site else ""
    if what == "coordinator receive":
        return f"{on}receive from {site}{host}"
    if what == "aggregation-to-sync":
        return f"{on}aggregation-to-sync of host {site}{host}"
    return f"{on}{what}" if not host else f"{what} on host {site}{host}"


def round_times(records: list[dict]) -> dict[int, float]:
    """Each published round's time: from the previous round's sync published to its own (round 0 from its first
    ``train`` start), on the root coordinator's clock."""
    published, first_train = {}, None
    for r in records:
        if r["host"] == P.COORDINATOR and r["phase"] == P.SYNC_PREPARE:
            published[r["round"]] = max(published.get(r["round"], r["end"]), r["end"])
        elif r["phase"] == P.TRAIN and r["round"] == 0 and "/" not in str(r["host"]):
            first_train = r["start"] if first_train is None else min(first_train, r["start"])
    times, before = {}, None
    for rnd in sorted(published):
        start = published.get(rnd - 1, first_train if rnd == 0 else None)
        if start is None:
            start = before
        if start is not None:
            times[rnd] = published[rnd] - start
        before = published[rnd]
    return times


def extend(report: dict, records: list[dict], price: float | None = None) -> dict:
    """Add the summary's parts to ``report["summary"]`` (``per_host``, ``quantiles_s``, ``slowest_rounds``,
    ``round_time_median_s``, with a price ``cost``); returns the summary."""
    summary = report["summary"]
    hosts = per_host(records)
    shares = _wait_shares(summary)
    for h, a in hosts.items():
        a["mean_wait_share"] = shares.get(h)
    summary["per_host"] = hosts

    by_key: dict[tuple[str, str], list[float]] = defaultdict(list)
    per_round = {}
    for rnd in report["rounds"]:
        got = samples(rnd)
        per_round[rnd["round"]] = got
        for key, _, v in got:
            by_key[key].append(v)
    times = round_times(records)
    ordered = {key: sorted(v) for key, v in by_key.items()}
    summary["quantiles_s"] = phase_quantiles(ordered)
    if times:
        summary["quantiles_s"]["round time"] = _quantiles(sorted(times.values()))
    medians = {key: quantile(v, 0.5) for key, v in ordered.items()}
    summary["round_time_median_s"] = statistics.median(times.values()) if times else None
    slowest = []
    for rnd in heapq.nlargest(SLOWEST, times, key=times.get):
        causes = heapq.nlargest(2, ((v - medians[key], key, host) for key, host, v in per_round.get(rnd, ())
                                    if key[1] not in NOT_A_CAUSE
                                    and key[1].removeprefix("coordinator ") not in OFF_THE_PATH))
        slowest.append({"round": rnd, "seconds": times[rnd], "causes": [
            {"what": label(key, host), "above_median_s": x} for x, key, host in causes if x > 0]})
    summary["slowest_rounds"] = slowest
    if price is not None:
        summary["cost"] = cost(hosts, price)
    return summary


def phase_quantiles(ordered: dict[tuple[str, str], list[float]]) -> dict[str, dict]:
    """The quantiles of the root's rows (its senders' phases: with relays, the relays' mostly), in the report's
    column order. With relays, ``train`` is every host's, in the sites too (:data:`EVERY_HOST_TRAIN`)."""
    order = [*HOST_COLUMNS, *(f"coordinator {ph}" for ph in P.COORDINATOR_PHASES), "aggregation-to-sync"]
    root = sorted((what for site, what in ordered if not site),
                  key=lambda w: (order.index(w) if w in order else len(order), w))
    rows = {what: _quantiles(ordered[("", what)]) for what in root}
    if any(site for site, _ in ordered):
        trained = sorted(v for (_, what), values in ordered.items() if what == P.TRAIN for v in values)
        rows.pop(P.TRAIN, None)
        rows = {EVERY_HOST_TRAIN: _quantiles(trained), **rows} if trained else rows
    return rows


def _quantiles(ordered: list[float]) -> dict:
    return {"n": len(ordered), **{f"p{round(q * 100)}": quantile(ordered, q) for q in QUANTILES},
            "max": ordered[-1]}


def cost(hosts: dict[str, dict], price: float) -> dict:
    """GPU-hours training, waiting and exchanging per host and in all, and what they cost at ``price`` a
    GPU-hour."""
    out: dict = {"price_per_gpu_hour": price, "per_host": {}}
    total = defaultdict(float)
    for h, a in hosts.items():
        gpu_h = {k: a[f"{k}_s"] * a["gpus"] / 3600 for k in ("train", "wait", "exchange")}
        out["per_host"][h] = {"gpus": a["gpus"], **{f"{k}_gpu_hours": v for k, v in gpu_h.items()},
                              "wait_cost": gpu_h["wait"] * price}
        for k, v in gpu_h.items():
            total[k] += v
    hours = sum(total.values())
    out.update({f"{k}_gpu_hours": v for k, v in total.items()}, gpu_hours=hours, cost=hours * price,
               wait_cost=total["wait"] * price)
    return out


def gpu_time_unit(hosts: dict[str, dict]) -> tuple[str, float, str]:
    """The GPU time table's one unit, by its largest value: GPU-hours from an hour on, else GPU-seconds; its name,
    its seconds and how a value is written."""
    largest = max((a[f"{k}_s"] * a["gpus"] for a in hosts.values() for k in ("train", "wait", "exchange")),
                  default=0.0)
    return ("GPU-hours", 3600.0, "{:.3f}") if largest >= 3600 else ("GPU-seconds", 1.0, "{:.1f}")


def overlap_note(values: list[float]) -> list[str]:
    """The line that says what an aggregation-to-sync below 0 means, when one is shown."""
    if not any(v < 0 for v in values):
        return []
    return [OVERLAP_NOTE]


def _amount(x: float) -> str:
    """Money or GPU-hours: cents, or four decimals below 1."""
    return f"{x:,.2f}" if abs(x) >= 1 else f"{x:.4f}"


def render(report: dict, run_line: list[str], *, size=lambda n: f"{n} B") -> str:
    """The summary's lines; ``run_line``: the run's totals as :func:`~lightning_nodeox.tools.report.totals`
    writes them; ``size``: how bytes are written."""
    s = report["summary"]
    lines = []
    c = s.get("cost")
    if c is not None:
        share = c["wait_gpu_hours"] / c["gpu_hours"] if c["gpu_hours"] else 0.0
        lines.append(f"cost at {c['price_per_gpu_hour']:g} per GPU-hour: {_amount(c['gpu_hours'])} GPU-hours, "
                     f"{_amount(c['cost'])}; waiting {_amount(c['wait_gpu_hours'])} GPU-hours cost "
                     f"{_amount(c['wait_cost'])} ({share:.0%}); training {_amount(c['train_gpu_hours'])}, exchanging "
                     f"{_amount(c['exchange_gpu_hours'])} GPU-hours")
    unit, seconds, form = gpu_time_unit(s["per_host"])
    lines.append(f"GPU time per host, in {unit} (its GPUs x the time of each):")
    head = f"{'host':10} {'GPUs':>4} {'training':>10} {'waiting':>10} {'exchanging':>10} {'wait share':>10}"
    lines.append(head + (f" {'waiting cost':>12}" if c else "") + "  up / down")
    for h, a in s["per_host"].items():
        share = "-" if a["mean_wait_share"] is None else f"{a['mean_wait_share']:.0%}"
        train, wait, exchange = (form.format(a[f"{k}_s"] * a["gpus"] / seconds) for k in ("train", "wait", "exchange"))
        line = f"{h:10} {a['gpus']:>4} {train:>10} {wait:>10} {exchange:>10} {share:>10}"
        if c:
            line += f" {_amount(c['per_host'][h]['wait_cost']):>12}"
        lines.append(f"{line}  {size(a['up_bytes'])} / {size(a['down_bytes'])}")
    lines += ["", *run_line, ""]
    q = s["quantiles_s"]
    lines.append(f"{'seconds, over rounds and hosts':32} {'n':>7} {'p50':>9} {'p90':>9} {'p99':>9} {'max':>9}")
    for what, v in q.items():
        lines.append(f"  {what:30} {v['n']:>7} " + " ".join(f"{v[k]:9.3f}" for k in ("p50", "p90", "p99", "max")))
    lines += overlap_note([q["aggregation-to-sync"]["p50"]] if "aggregation-to-sync" in q else [])
    if s["slowest_rounds"]:
        lines += ["", f"slowest rounds (median round {s['round_time_median_s']:.3f} s), furthest above their median:"]
        for slow in s["slowest_rounds"]:
            why = ", ".join(f"{c['what']} +{c['above_median_s']:.3f} s" for c in slow["causes"]) or "-"
            lines.append(f"  round {slow['round']:<6} {slow['seconds']:8.3f} s  {why}")
    return "\n".join(lines)
