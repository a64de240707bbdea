"""``nodeox report``: per-round phase tables of a run directory (filled in by issue 4)."""

from __future__ import annotations

import json
from pathlib import Path


def main(run_dir: Path, *, as_json: bool = False, plot: Path | None = None) -> int:
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines() if line.strip()]
    print(json.dumps({"records": len(events)}) if as_json else f"{len(events)} records")
    return 0
