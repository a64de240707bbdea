"""``nodeox report DIR``: what every second of every round was spent on, from ``DIR/events.jsonl``.

By default a summary of the run (:mod:`~lightning_nodeox.tools.summary`: per-host totals, phase quantiles, the
slowest rounds and what made them slow, with ``--gpu-hour-price`` what the waiting cost); with ``--rounds [A:B]``
the per-round tables (of rounds A to B, both included). Per round: each host phase as its range across hosts
(``17.8–22.3 s``, as in the study), the coordinator's phases, aggregation-to-sync (aggregation end to each host's
download start), bytes up and down, each host's wait share (the fraction of its round its trainer spent waiting on
the exchange), and coordinator memory after the round, then the run's totals. ``--json`` gives the same, machine-readable (every round, or those of
``--rounds``, and the summary); ``--plot`` draws a timeline (:mod:`~lightning_nodeox.tools.timeline`).

A run with site relays is grouped by site: the records a relay forwarded (``SITE/HOST``, ``SITE/coordinator``) make
a report of their own (the same tables, nested sites too) under ``sites`` of each round and of the summary, the
relay itself (host ``SITE``, its upload, wait and sync) is a row of the root's tables, and the bytes over the links
into the root (``far_bytes``: the relays' and any host's straight to the root) stand apart from those inside the
sites (``site_bytes``).

A run whose hosts let the coordinator share out their data has the ledger's part (``summary["data"]``,
:mod:`~lightning_nodeox.tools.ledger_report`): where each epoch ended, what each host committed in it, and each
host's samples leased, committed, returned and in flight. A run under ``--merge async`` has the merge's part
(``summary["merge"]``, :mod:`~lightning_nodeox.tools.merge_report`): the rounds closed without every host, and
each host's rounds missed and late deltas with their staleness.
"""

from __future__ import annotations

import bisect
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from ..core import phases as P
from . import ledger_report, merge_report, summary, timeline
from .columns import HOST_COLUMNS, SYNC, host_columns, human_bytes  # noqa: F401 - host_columns: part of what report offers


def load(run_dir: Path) -> list[dict]:
    path = run_dir / "events.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: pass the --run-dir of a nodeox coordinator")
    lines = path.read_text().splitlines()
    try:  # one parse when every line is whole (the usual case): 3x faster than a parse per line
        return json.loads("[" + ",".join(line for line in lines if line.strip()) + "]")
    except json.JSONDecodeError:
        pass
    records = []
    for n, line in enumerate(lines, 1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                print(f"nodeox report: skipping malformed line {n} of {path}", file=sys.stderr)
    return records


def span(values: list[float]) -> dict:
    return {"min": min(values), "max": max(values)} if values else {}


def by_site(records: list[dict]) -> tuple[list[dict], dict[str, list[dict]]]:
    """The records of the root's own tables, and those each relay forwarded (``SITE/...``) under SITE, with the
    prefix taken off (``SITE/0`` -> ``0``, ``SITE/coordinator`` -> ``coordinator``; ``SITE/B/0`` -> ``B/0``)."""
    own, sites = [], defaultdict(list)
    for r in records:
        site, sep, rest = str(r["host"]).partition("/")
        if sep:
            sites[site].append({**r, "host": rest})
        else:
            own.append(r)
    return own, dict(sorted(sites.items()))


def _moved(rnd: dict) -> dict:
    """Bytes up and down over every link of a round's report: its hosts' and, inside its sites, theirs."""
    inside = [_moved(site) for site in rnd.get("sites", {}).values()]
    return {k: sum(b[k] for b in rnd["bytes"].values()) + sum(b[k] for b in inside) for k in ("up", "down")}


def build(records: list[dict]) -> dict:
    """The report as a dict (what ``--json`` prints), grouped by site when relays forwarded records."""
    own, sites = by_site(records)
    report = _build(own)
    if not sites:
        return report
    nested = {name: build(site_records) for name, site_records in sites.items()}
    site_rounds = {name: {r["round"]: r for r in sub["rounds"]} for name, sub in nested.items()}
    for rnd in report["rounds"]:
        rnd["sites"] = {name: rounds[rnd["round"]] for name, rounds in site_rounds.items() if rnd["round"] in rounds}
        rnd["far_bytes"] = {k: sum(b[k] for b in rnd["bytes"].values()) for k in ("up", "down")}
        within = [_moved(site_rnd) for site_rnd in rnd["sites"].values()]
        rnd["site_bytes"] = {k: sum(b[k] for b in within) for k in ("up", "down")}
    summary = report["summary"]
    timed = [r for r in records if r["phase"] != P.RSS]  # the run's wall time over every site's records too
    summary["wall_s"] = max(r["end"] for r in timed) - min(r["start"] for r in timed)
    summary["sites"] = {name: sub["summary"] for name, sub in nested.items()}
    for key in ("far_bytes", "site_bytes"):
        summary[key] = {k: sum(rnd[key][k] for rnd in report["rounds"]) for k in ("up", "down")}
    return report


class _Tally:
    """One coordinator's records summed up by round: each phase's seconds per host, the first record of each
    (round, host, phase), the bytes each host moved, the coordinator's own phases, and its memory readings."""

    def __init__(self, records: list[dict]) -> None:
        self.seconds = defaultdict(lambda: defaultdict(lambda: defaultdict(float)))  # round -> phase -> host -> s
        self.first = {}  # (round, host, phase) -> earliest record
        self.bytes_moved = defaultdict(lambda: defaultdict(lambda: {"up": 0, "down": 0}))  # round -> host
        self.coordinator = defaultdict(lambda: defaultdict(float))
        self.receive = defaultdict(dict)
        self.store = defaultdict(lambda: {"bytes": 0, "requests": 0})  # round -> what was written to the store
        self.last_end: dict[tuple[int, str], float] = {}  # (round, host) -> end of its last phase
        self.rss = []
        for r in records:
            self._add(r)
        self.rss.sort(key=lambda s: s["start"])
        self._rss_starts = [s["start"] for s in self.rss]

    def _add(self, r: dict) -> None:
        rnd, host, phase = r["round"], str(r["host"]), r["phase"]
        if phase == P.RSS:
            self.rss.append(r)
            return
        if phase in (P.DATA, P.RESTART):  # marks, not timed phases (the data ledger's: ledger_report)
            return
        d = r["end"] - r["start"]
        self.first.setdefault((rnd, host, phase), r)
        if host == P.COORDINATOR:
            if phase == P.RECEIVE:
                self.receive[rnd][str(r.get("from_host", "?"))] = d
            else:
                if phase == P.STORE:
                    self.store[rnd]["bytes"] += r.get("bytes") or 0
                    self.store[rnd]["requests"] += r.get("requests") or 0
                self.coordinator[rnd][phase] += d
            return
        self.seconds[rnd][phase][host] += d
        self.last_end[(rnd, host)] = max(self.last_end.get((rnd, host), r["end"]), r["end"])
        if phase in P.SYNC_PARTS:
            self.seconds[rnd][SYNC][host] += d
        if phase == P.UPLOAD:
            self.bytes_moved[rnd][host]["up"] += r.get("bytes") or 0
        if phase in (P.DOWNLOAD, P.FALLBACK_FETCH):
            self.bytes_moved[rnd][host]["down"] += r.get("bytes") or 0

    def rounds(self) -> list[int]:
        return sorted(set(self.seconds) | set(self.coordinator))

    def round(self, rnd: int) -> dict:
        """Round ``rnd``'s part of the report."""
        seconds, receive = self.seconds[rnd], self.receive[rnd]
        hosts = sorted({h for phase in seconds.values() for h in phase}, key=_host_key)
        host_phases = {ph: {"per_host": dict(seconds[ph]), **span(list(seconds[ph].values()))}
                       for ph in HOST_COLUMNS if seconds.get(ph)}
        to_sync = self._aggregation_to_sync(rnd, hosts)
        close = self.first.get((rnd, P.COORDINATOR, P.SYNC_PREPARE))
        after = [] if close is None else self.rss[bisect.bisect_left(self._rss_starts, close["end"]):]
        return {
            "round": rnd, "hosts": hosts, "host_phases": host_phases,
            "coordinator_phases": {**dict(self.coordinator[rnd]),
                                   **({"receive": {"per_host": receive, **span(list(receive.values()))}}
                                      if receive else {})},
            "aggregation_to_sync": {"per_host": to_sync, **span(list(to_sync.values()))},
            "bytes": {h: self.bytes_moved[rnd][h] for h in hosts},
            "wait_share": self._wait_share(rnd, hosts),
            "coordinator_rss_after_bytes": after[0]["rss_bytes"] if after else None,
            **({"store": dict(self.store[rnd])} if rnd in self.store else {}),
        }

    def _aggregation_to_sync(self, rnd: int, hosts: list[str]) -> dict[str, float]:
        """Each host's seconds from the round's aggregation to its sync's download."""
        agg = self.first.get((rnd, P.COORDINATOR, P.AGGREGATE))
        if agg is None:
            return {}
        downloads = {h: self.first.get((rnd, h, P.DOWNLOAD)) for h in hosts}
        return {h: dl["start"] - agg["end"] for h, dl in downloads.items() if dl is not None}

    def _wait_share(self, rnd: int, hosts: list[str]) -> dict[str, float]:
        """The share of the round (train start to next train start) each host's trainer did not train."""
        out = {}
        for h in hosts:
            train = self.first.get((rnd, h, P.TRAIN))
            following = self.first.get((rnd + 1, h, P.TRAIN))
            end = following["start"] if following is not None else self.last_end.get((rnd, h))
            if train is not None and end is not None and end > train["start"]:
                out[h] = max(0.0, 1.0 - (train["end"] - train["start"]) / (end - train["start"]))
        return out


def _build(records: list[dict]) -> dict:
    """The report of one coordinator's records (a flat run's, or the root's or one site's own)."""
    tally = _Tally(records)
    rounds = [tally.round(rnd) for rnd in tally.rounds()]
    summary = summarize(records, rounds, tally.rss)
    for key, part in (("data", ledger_report), ("merge", merge_report)):
        built = part.build(records)
        if built is not None:
            summary[key] = built
    return {"rounds": rounds, "summary": summary}


def summarize(records: list[dict], rounds: list[dict], rss: list[dict]) -> dict:
    timed = [r for r in records if r["phase"] != P.RSS]
    hosts = sorted({h for rnd in rounds for h in rnd["hosts"]}, key=_host_key)
    medians = {}
    for ph in HOST_COLUMNS:
        maxima = [rnd["host_phases"][ph]["max"] for rnd in rounds if ph in rnd["host_phases"]]
        if maxima:
            medians[ph] = statistics.median(maxima)
    for ph in (P.AGGREGATE, P.SYNC_PREPARE):
        values = [rnd["coordinator_phases"][ph] for rnd in rounds if ph in rnd["coordinator_phases"]]
        if values:
            medians[ph] = statistics.median(values)
    to_sync = [rnd["aggregation_to_sync"]["max"] for rnd in rounds if rnd["aggregation_to_sync"].get("max") is not None]
    return {
        "rounds": len(rounds), "hosts": hosts,
        "wall_s": (max(r["end"] for r in timed) - min(r["start"] for r in timed)) if timed else 0.0,
        "median_of_slowest_host_s": medians,
        "aggregation_to_sync_median_s": statistics.median(to_sync) if to_sync else None,
        "bytes_up": sum(b["up"] for rnd in rounds for b in rnd["bytes"].values()),
        "bytes_down": sum(b["down"] for rnd in rounds for b in rnd["bytes"].values()),
        "mean_wait_share": {h: statistics.mean(rnd["wait_share"][h] for rnd in rounds if h in rnd["wait_share"])
                            for h in hosts if any(h in rnd["wait_share"] for rnd in rounds)},
        "coordinator_peak_rss_bytes": max((s.get("peak_rss_bytes", s["rss_bytes"]) for s in rss), default=None),
        "fallback_fetches": sum(1 for r in records if r["phase"] == P.FALLBACK_FETCH),
        **({"store": {k: sum(rnd["store"][k] for rnd in rounds if "store" in rnd) for k in ("bytes", "requests")}}
           if any("store" in rnd for rnd in rounds) else {}),
    }


def _host_key(h: str):
    return (0, int(h), "") if h.isdigit() else (1, 0, h)


def _seconds(s: dict) -> str:
    if "min" not in s:  # no value (a per-host dict with no host in it)
        return "-"
    lo, hi = s["min"], s["max"]
    return f"{lo:.3f} s" if abs(hi - lo) < 5e-4 else f"{lo:.3f}–{hi:.3f} s"


def _round_lines(rnd: dict, indent: str = "  ") -> list[str]:
    """One round's table (a site's nested under its relay's row, further indented)."""
    lines = [f"{indent}{'host phase':22} across hosts"]
    for ph, s in rnd["host_phases"].items():
        lines.append(f"{indent}{ph:22} {_seconds(s)}")
    cp = rnd["coordinator_phases"]
    if "receive" in cp:
        lines.append(f"{indent}{'coordinator receive':22} {_seconds(cp['receive'])}")
    for ph in P.COORDINATOR_PHASES:
        if ph != P.RECEIVE and ph in cp:
            lines.append(f"{indent}{'coordinator ' + ph:22} {cp[ph]:.3f} s")
    lines.append(f"{indent}{'aggregation-to-sync':22} {_seconds(rnd['aggregation_to_sync'])}")
    up = [b["up"] for b in rnd["bytes"].values()]
    down = [b["down"] for b in rnd["bytes"].values()]
    lines.append(f"{indent}{'bytes up / down':22} {human_bytes(sum(up))} / {human_bytes(sum(down))}"
                 f"  (per host {human_bytes(min(up, default=0))}–{human_bytes(max(up, default=0))} up)")
    if "far_bytes" in rnd:
        far, near = rnd["far_bytes"], rnd["site_bytes"]
        lines.append(f"{indent}{'far links / in sites':22} {human_bytes(far['up'])} / {human_bytes(far['down'])} across "
                     f"the links into this coordinator; {human_bytes(near['up'])} / {human_bytes(near['down'])} inside the sites")
    if "store" in rnd:
        lines.append(f"{indent}{'written to the store':22} {human_bytes(rnd['store']['bytes'])} in "
                     f"{rnd['store']['requests']} requests")
    share = ", ".join(f"host {h} {v:.0%}" for h, v in rnd["wait_share"].items())
    lines.append(f"{indent}{'wait share':22} {share or '-'}")
    lines.append(f"{indent}{'coordinator RSS after':22} {human_bytes(rnd['coordinator_rss_after_bytes'])}")
    for name, site in rnd.get("sites", {}).items():
        lines.append(f"{indent}site {name} (relay {name}; hosts {', '.join(site['hosts']) or '-'})")
        lines += _round_lines(site, indent + "  ")
    return lines


def totals(report: dict) -> list[str]:
    """The run's totals: rounds, hosts, wall time, bytes, coordinator memory, full-model fetches; each site's."""
    s = report["summary"]
    inside = sum(len(site["hosts"]) for site in s.get("sites", {}).values())
    who = f"{len(s['hosts'])} hosts" + (f" at the root ({len(s['sites'])} relays), {inside} in the sites"
                                        if inside else "")
    lines = [(f"run: {s['rounds']} rounds, {who}, {s['wall_s']:.1f} s; "
              f"{human_bytes(s['bytes_up'])} up, {human_bytes(s['bytes_down'])} down; "
              f"coordinator peak RSS {human_bytes(s['coordinator_peak_rss_bytes'])}; "
              f"{s['fallback_fetches']} full-model fetches")]
    if "store" in s:
        lines.append(f"store: {human_bytes(s['store']['bytes'])} written in {s['store']['requests']} requests "
                     f"({human_bytes(s['store']['bytes'] / max(s['rounds'], 1))} a round)")
    if "far_bytes" in s:
        lines.append(f"far links: {human_bytes(s['far_bytes']['up'])} up, {human_bytes(s['far_bytes']['down'])} down; inside "
                     f"the sites: {human_bytes(s['site_bytes']['up'])} up, {human_bytes(s['site_bytes']['down'])} down")
    for name, site in s.get("sites", {}).items():
        lines.append(f"site {name}: {site['rounds']} rounds, hosts {', '.join(site['hosts']) or '-'}; relay peak RSS "
                     f"{human_bytes(site['coordinator_peak_rss_bytes'])}; {site['fallback_fetches']} full-model fetches")
    return lines


def render_rounds(report: dict) -> str:
    """The per-round tables (``--rounds``), then the run's totals and medians."""
    lines = []
    for rnd in report["rounds"]:
        lines.append(f"round {rnd['round']}  (hosts {', '.join(rnd['hosts']) or '-'})")
        lines += _round_lines(rnd)
        lines.append("")
    s = report["summary"]
    lines += totals(report)
    lines.append("median over rounds of the slowest host: " + ", ".join(
        f"{ph} {v:.3f} s" for ph, v in s["median_of_slowest_host_s"].items()))
    if s["aggregation_to_sync_median_s"] is not None:
        lines.append(f"aggregation-to-sync, median of the slowest host: {s['aggregation_to_sync_median_s']:.3f} s")
    lines += summary.overlap_note([v for rnd in report["rounds"] for (_, what), _, v in summary.samples(rnd)
                                   if what == "aggregation-to-sync"])
    lines.append("mean wait share: " + (", ".join(f"host {h} {v:.0%}" for h, v in s["mean_wait_share"].items()) or "-"))
    for key, part in (("data", ledger_report), ("merge", merge_report)):
        if key in s:
            lines += part.render(s[key])
    return "\n".join(lines)


def render_summary(report: dict) -> str:
    """The summary (the default; :mod:`~lightning_nodeox.tools.summary`), once :func:`summary.extend` added to it;
    then the data ledger's part (:mod:`~lightning_nodeox.tools.ledger_report`) and the async merge's
    (:mod:`~lightning_nodeox.tools.merge_report`), if the run had them."""
    lines = [summary.render(report, totals(report), size=human_bytes)]
    for key, part in (("data", ledger_report), ("merge", merge_report)):
        if key in report["summary"]:
            lines += ["", *part.render(report["summary"][key])]
    return "\n".join(lines)


def parse_window(text: str) -> tuple[int | None, int | None]:
    """``--rounds``' range: ``A:B`` (both included), ``A:``, ``:B``, ``N`` or ``""`` (every round)."""
    try:
        if ":" not in text:
            return (None, None) if text == "" else (int(text), int(text))
        a, b = text.split(":", 1)
        return (int(a) if a else None, int(b) if b else None)
    except ValueError:
        raise ValueError(f"--rounds takes A:B (rounds A to B, both included), A:, :B or N; got {text!r}") from None


def within(window: tuple[int | None, int | None], rnd: int) -> bool:
    lo, hi = window
    return (lo is None or rnd >= lo) and (hi is None or rnd <= hi)


def main(run_dir: Path, *, as_json: bool = False, plot_to: Path | None = None, rounds: str | None = None,
         price: float | None = None) -> int:
    """``nodeox report``: the summary, or with ``rounds`` (a range, "" for all) the per-round tables."""
    try:
        window = None if rounds is None else parse_window(rounds)
        if price is not None and not price >= 0:
            raise ValueError(f"--gpu-hour-price must be a price of one GPU for one hour (>= 0), got {price}")
        records = load(run_dir)
    except (FileNotFoundError, ValueError) as e:
        print(f"nodeox report: {e}", file=sys.stderr)
        return 2
    report = build(records)
    summary.extend(report, records, price)
    if window is not None:
        report["rounds"] = [r for r in report["rounds"] if within(window, r["round"])]
    if as_json:
        print(json.dumps(report, indent=2))
    else:
        print(render_summary(report) if window is None else render_rounds(report))
    if plot_to is not None:
        try:
            timeline.plot(records, plot_to, window=window)
        except ValueError as e:
            print(f"nodeox report: {e}", file=sys.stderr)
            return 2
        if not as_json:
            print(f"timeline written to {plot_to}")
    return 0
