"""``nodeox report --plot FILE.png``: the run as a picture, readable at any number of rounds.

Each phase has a colour of its own (:data:`PHASE_COLOURS`, every host and coordinator phase) and a legend entry.
A run of at most :data:`WINDOW` rounds (or the rounds of ``--rounds A:B``) is drawn whole as a timeline: one lane
per host and one for the coordinator, a bar per phase record, a dotted line where each round's sync was
published (labelled, at most :data:`LABELS` of them). A longer run gets two panels: above, every round (in at most
:data:`BINS` bars of consecutive rounds) as each host phase's mean seconds across hosts, stacked, with the slowest
host's seconds in each bar's slowest round as a line (the aggregate); below, the timeline of its last
:data:`WINDOW` rounds (or of ``--rounds``). Bars are drawn without antialiasing, so each phase's pixels hold
exactly its colour.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from ..core import phases as P
from .summary import host_key

PHASE_COLOURS = {
    P.TRAIN: "#9ecae1", P.ENCODE: "#e6550d", P.UPLOAD: "#fd8d3c", P.WAIT: "#bdbdbd", P.POLL: "#dadaeb",
    P.DOWNLOAD: "#31a354", P.APPLY: "#74c476", P.VERIFY: "#a1d99b", P.FOLD: "#006d2c", P.PROVIDE_MODEL: "#fdd0a2",
    P.FALLBACK_FETCH: "#de2d26",
    P.RECEIVE: "#756bb1", P.AGGREGATE: "#9e9ac8", P.SYNC_PREPARE: "#3182bd", P.MODEL_MATERIALIZE: "#636363",
    P.PERSIST: "#8c6d31", P.STORE: "#e7ba52",
}
OTHER = "#000000"  # a phase this version does not know (a newer host's)
WINDOW = 40  # rounds a timeline shows at most
LABELS = 25  # round labels at most
BINS = 250  # bars of the aggregate at most


def plot(records: list[dict], path: Path, *, window: tuple[int | None, int | None] | None = None) -> list[str]:
    """Draw the picture to ``path``; returns the phases of its legend, in its order."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    timed = [r for r in records if r["phase"] not in (P.RSS, P.DATA)]  # data: the ledger's marks (no duration)
    if not timed:
        raise ValueError("no phase records to plot")
    rounds = sorted({r["round"] for r in timed})
    lo, hi = window or (None, None)
    if lo is None and hi is None and len(rounds) > WINDOW:
        lo = rounds[-WINDOW]
    shown = [r for r in timed if (lo is None or r["round"] >= lo) and (hi is None or r["round"] <= hi)]
    if not shown:
        raise ValueError(f"no records in rounds {lo}:{hi} (the run has rounds {rounds[0]} to {rounds[-1]})")
    aggregate = len({r["round"] for r in shown}) < len(rounds)
    hosts = sorted({str(r["host"]) for r in timed if r["host"] != P.COORDINATOR}, key=host_key)
    lanes = [P.COORDINATOR, *hosts]
    height = 1.2 + 0.55 * len(lanes)
    if aggregate:
        fig, (top, ax) = plt.subplots(2, 1, figsize=(14, height + 2.6), dpi=110,
                                      gridspec_kw={"height_ratios": [2.4, height]})
        _aggregate(top, timed, shown)
    else:
        fig, ax = plt.subplots(figsize=(14, height), dpi=110)
    present = _timeline(ax, shown, lanes)
    if aggregate:
        present = [ph for ph in PHASE_COLOURS if ph in present or ph in _host_phases(timed)]
    ax.legend(handles=[Patch(color=PHASE_COLOURS.get(ph, OTHER), label=ph) for ph in present], loc="upper center",
              bbox_to_anchor=(0.5, -0.28 if len(lanes) < 4 else -0.15), ncol=min(len(present), 8), fontsize=8,
              frameon=False)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return present


def _host_phases(timed: list[dict]) -> set[str]:
    return {r["phase"] for r in timed if r["host"] != P.COORDINATOR and "/" not in str(r["host"])}


def _timeline(ax, shown: list[dict], lanes: list[str]) -> list[str]:
    """The timeline of ``shown``; returns the phases drawn, in the legend's order."""
    t0 = min(r["start"] for r in shown)
    bars = defaultdict(list)  # (lane, phase) -> [(start, length)]: one draw call each
    for r in shown:
        bars[(lanes.index(str(r["host"])), r["phase"])].append((r["start"] - t0, max(r["end"] - r["start"], 1e-4)))
    for (lane, phase), ranges in bars.items():
        high, offset = (0.35, 0.2) if phase == P.RECEIVE else (0.7, 0.0)
        ax.broken_barh(ranges, (lane - 0.35 + offset, high), facecolors=PHASE_COLOURS.get(phase, OTHER),
                       edgecolors="none", antialiased=False)
    published = sorted((r["end"] - t0, r["round"]) for r in shown
                       if r["host"] == P.COORDINATOR and r["phase"] == P.SYNC_PREPARE)
    every = max(1, -(-len(published) // LABELS))
    for i, (x, rnd) in enumerate(published):
        ax.axvline(x, color="black", linewidth=0.6, linestyle=":")
        if i % every == 0:
            ax.text(x, len(lanes) - 0.45, f" r{rnd}", fontsize=7, va="bottom")
    ax.set_yticks(range(len(lanes)), [lane if lane == P.COORDINATOR else f"host {lane}" for lane in lanes])
    ax.set_ylim(-0.6, len(lanes) - 0.2)
    ax.invert_yaxis()
    rounds = sorted({r["round"] for r in shown})
    ax.set_xlabel(f"rounds {rounds[0]}–{rounds[-1]}: seconds since their first record (coordinator clock); "
                  "dotted: sync published")
    ax.grid(axis="x", alpha=0.3)
    drawn = {phase for _, phase in bars}
    return [ph for ph in PHASE_COLOURS if ph in drawn] + sorted(drawn - set(PHASE_COLOURS))


def _aggregate(ax, timed: list[dict], shown: list[dict]) -> None:
    """Every round, in at most :data:`BINS` bins of consecutive rounds: each host phase's mean seconds per round
    and host, stacked; a line at the slowest host's seconds in the bin's slowest round; the window shaded."""
    seconds = defaultdict(lambda: defaultdict(float))  # phase -> round -> seconds summed over hosts
    per_host = defaultdict(float)  # (round, host) -> seconds
    for r in timed:
        host = str(r["host"])
        if host == P.COORDINATOR or "/" in host:
            continue
        d = r["end"] - r["start"]
        seconds[r["phase"]][r["round"]] += d
        per_host[(r["round"], host)] += d
    hosts = defaultdict(int)
    slowest = defaultdict(float)
    for (rnd, _), d in per_host.items():
        hosts[rnd] += 1
        slowest[rnd] = max(slowest[rnd], d)
    rounds = sorted(hosts)
    size = -(-len(rounds) // BINS)
    bins = [rounds[i:i + size] for i in range(0, len(rounds), size)]
    left = [b[0] for b in bins]
    width = [b[-1] - b[0] + 1 for b in bins]
    bottom = [0.0] * len(bins)
    for ph in [ph for ph in PHASE_COLOURS if ph in seconds] + sorted(set(seconds) - set(PHASE_COLOURS)):
        height = [sum(seconds[ph].get(rnd, 0.0) / hosts[rnd] for rnd in b) / len(b) for b in bins]
        ax.bar(left, height, width, bottom, align="edge", color=PHASE_COLOURS.get(ph, OTHER), linewidth=0,
               antialiased=False)
        bottom = [x + y for x, y in zip(bottom, height)]
    peaks = [max(slowest[rnd] for rnd in b) for b in bins]
    ax.step([*left, left[-1] + width[-1]], [*peaks, peaks[-1]], where="post", color="black", linewidth=0.7,
            label="slowest host, slowest round of the bin")
    window = sorted({r["round"] for r in shown})
    ax.axvspan(window[0], window[-1] + 1, color="black", alpha=0.08, linewidth=0)
    ax.set_xlim(rounds[0], rounds[-1] + 1)
    ax.set_ylabel("s per round\n(mean over hosts)")
    ax.set_xlabel(f"round (all {len(rounds)}" + (f", {size} a bar" if size > 1 else "") +
                  "; line: the slowest host in the bar's slowest round; shaded: the timeline below)")
    ax.grid(axis="y", alpha=0.3)
