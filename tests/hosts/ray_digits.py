"""The digits test host (digits_host.py) as a training function for ``lightning_nodeox.ray``: it runs in the host's
Ray actor with ``config`` as its command line, and returns what the host wrote after fit (its model hash, last
round and steps)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import digits_host


def train(args: list[str]) -> dict:
    """``digits_host.py ARGS`` in this process (``--out`` among ARGS); the host's after-fit record."""
    sys.argv = ["digits_host.py", *args]
    digits_host.main()
    out = Path(args[args.index("--out") + 1])
    return json.loads((out / f"host{os.environ['NODEOX_HOST_ID']}_after_fit.json").read_text())
