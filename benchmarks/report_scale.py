"""`nodeox report` at scale: a synthetic run directory of 10,000 rounds x 8 hosts, then the summary timed.

The run directory holds an ``events.jsonl`` in the coordinator's own format (lightning_nodeox/coordinator/runlog.py):
per round and host ``train`` (with ``steps``, ``samples``, ``ranks``), ``encode``, ``upload`` (``bytes``),
``wait``, ``download`` (``bytes``), ``apply`` and ``verify``; the coordinator's ``receive`` per host
(``from_host``), ``aggregate``, ``sync_prepare``, ``persist`` and an ``rss`` sample. Hosts train 2.0 s a round
± 5%, host 3 is slower by 0.3 s, and every 997th round one host trains 6 s longer (the slowest rounds the summary
should name). Prints the summary's line count and the seconds it took (`nodeox report DIR` in a subprocess, as a
user runs it; with ``--plot`` the timeline too).

    python benchmarks/report_scale.py [--rounds 10000] [--hosts 8] [--run-dir DIR] [--plot FILE.png] [--json]
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DELTA_BYTES = 2_958_036
T0 = 1_796_000_000.0


def write_run(run_dir: Path, rounds: int, hosts: int, seed: int = 0) -> int:
    """Write the synthetic ``events.jsonl``; returns its records."""
    rng = random.Random(seed)
    run_dir.mkdir(parents=True, exist_ok=True)
    lines, n, start = [], 0, T0
    dumps = json.JSONEncoder(separators=(",", ":")).encode
    with open(run_dir / "events.jsonl", "w") as f:
        for r in range(rounds):
            ends = {}
            for h in range(hosts):
                train = 2.0 * rng.uniform(0.95, 1.05) + (0.3 if h == 3 else 0.0)
                if r % 997 == 0 and r and h == r % hosts:
                    train += 6.0
                t = start + rng.uniform(0, 0.01)
                lines.append({"round": r, "host": str(h), "phase": "train", "start": t, "end": t + train,
                              "steps": 20, "samples": 640, "ranks": 1})
                t += train
                enc = rng.uniform(0.05, 0.07)
                lines.append({"round": r, "host": str(h), "phase": "encode", "start": t, "end": t + enc,
                              "bytes": DELTA_BYTES, "samples": 640, "q4_rel_error": 0.055})
                t += enc
                up = rng.uniform(0.01, 0.04)
                lines.append({"round": r, "host": str(h), "phase": "upload", "start": t, "end": t + up,
                              "bytes": DELTA_BYTES})
                ends[h] = t + up
            close = max(ends.values())
            for h, e in ends.items():
                lines.append({"round": r, "host": "coordinator", "phase": "receive", "start": e - 0.02, "end": e,
                              "bytes": DELTA_BYTES, "from_host": str(h)})
            agg_end = close + 0.0005
            lines.append({"round": r, "host": "coordinator", "phase": "aggregate", "start": close, "end": agg_end,
                          "hosts": [str(h) for h in range(hosts)], "samples": 640 * hosts})
            published = agg_end + rng.uniform(0.04, 0.06)
            lines.append({"round": r, "host": "coordinator", "phase": "sync_prepare", "start": agg_end,
                          "end": published, "bytes": DELTA_BYTES, "model_hash": f"{r:032x}"})
            lines.append({"round": r, "host": "coordinator", "phase": "persist", "start": published,
                          "end": published + 0.03, "bytes": DELTA_BYTES + 12_000, "snapshot": r % 100 == 0})
            lines.append({"round": r + 1, "host": "coordinator", "phase": "rss", "start": published,
                          "end": published, "rss_bytes": 600_000_000 + rng.randrange(1 << 20),
                          "peak_rss_bytes": 620_000_000, "cpu_s": 1.5 + r * 0.1})
            after = published
            for h, e in ends.items():
                lines.append({"round": r, "host": str(h), "phase": "wait", "start": e, "end": published + 0.001})
                t = published + 0.001
                for phase, d in (("download", 0.003), ("apply", 0.05), ("verify", 0.001)):
                    rec = {"round": r, "host": str(h), "phase": phase, "start": t, "end": t + d}
                    if phase == "download":
                        rec["bytes"] = DELTA_BYTES
                    lines.append(rec)
                    t += d
                after = max(after, t)
            start = after
            if len(lines) >= 50_000:
                f.write("".join(dumps(rec) + "\n" for rec in lines))
                n += len(lines)
                lines = []
        f.write("".join(dumps(rec) + "\n" for rec in lines))
    return n + len(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=10_000)
    p.add_argument("--hosts", type=int, default=8)
    p.add_argument("--run-dir", type=Path, help="where to write the run (default: a temporary directory)")
    p.add_argument("--plot", type=Path, help="also draw the timeline (timed with the summary)")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = args.run_dir or Path(tmp) / "run"
        t = time.perf_counter()
        records = write_run(run_dir, args.rounds, args.hosts)
        written_s = time.perf_counter() - t
        command = [sys.executable, "-m", "lightning_nodeox", "report", str(run_dir), "--gpu-hour-price", "2.5"]
        if args.plot:
            command += ["--plot", str(args.plot)]
        t = time.perf_counter()
        out = subprocess.run(command, check=False, capture_output=True, text=True, timeout=600)
        took = time.perf_counter() - t
        if out.returncode != 0:
            print(out.stderr, file=sys.stderr)
            return 1
        lines = out.stdout.rstrip("\n").count("\n") + 1
        size = (run_dir / "events.jsonl").stat().st_size
    figures = {"rounds": args.rounds, "hosts": args.hosts, "records": records, "events_bytes": size,
               "written_s": written_s, "report_s": took, "summary_lines": lines}
    if args.json:
        print(json.dumps(figures))
    else:
        print(out.stdout)
        print(f"{args.rounds} rounds x {args.hosts} hosts: {records} records ({size / 1e6:.0f} MB) written in "
              f"{written_s:.1f} s; `nodeox report` took {took:.1f} s and printed {lines} lines")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
