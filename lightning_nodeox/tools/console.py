"""``nodeox launch``'s console: every child's output as whole lines with the child's prefix, and the lines every
host prints alike shown once per launch.

Each child's stdout and stderr are read apart and played on a screen of their own (:mod:`.screen`), so a log line
on stderr never runs into a progress bar on stdout, and no escape sequence reaches the console; lines are written
whole, one at a time.

Once per launch: a line of Lightning's start-up chatter or a Python warning (the patterns in ``ONCE_PER_LAUNCH``)
is shown the first time any child prints it, with that child's prefix; the same text again, from any child, is
dropped, together with the indented source line Python prints under a warning. Everything else is shown as it
comes.
"""

from __future__ import annotations

import codecs
import re
import sys
import threading
from typing import BinaryIO, TextIO

from .screen import Screen

ONCE_PER_LAUNCH = tuple(re.compile(p) for p in (
    r"^💡 Tip: ",  # Lightning's advertising tips
    r"^(GPU|TPU|HPU|IPU) available: ",  # the accelerators found
    r"^`Trainer[(.]",  # `Trainer(limit_train_batches=1.0)` was configured so ..., `Trainer.fit` stopped: ...
    r"^Using .*Automatic Mixed Precision",
    r"^You are using a CUDA device .* that has Tensor Cores",
    r"^Seed set to ",
    r"^\S+\.py:\d+: ",  # a Python warning: FILE:LINE: [Category:] message (LeafSpec's deprecation, FutureWarnings)
))
_SOURCE_LINE = re.compile(r"^\s+\S")  # the source line Python prints under a warning


class OncePerLaunch:
    """Decides, line by line and per source (a child's stream), whether a line is shown."""

    def __init__(self) -> None:
        self._seen: set[str] = set()
        self._dropping: set[object] = set()  # sources whose last line was a dropped warning (its source line next)

    def shown(self, source: object, line: str) -> bool:
        if source in self._dropping:
            self._dropping.discard(source)
            if _SOURCE_LINE.match(line):
                return False
        if not any(p.search(line) for p in ONCE_PER_LAUNCH):
            return True
        if line in self._seen:
            self._dropping.add(source)
            return False
        self._seen.add(line)
        return True


class Console:
    """Where launch writes: its children's lines (``follow``) and its own (``say``), one whole line at a time."""

    def __init__(self, out: TextIO | None = None) -> None:
        self.out = out
        self.once = OncePerLaunch()
        self._lock = threading.RLock()  # re-entrant: launch says its lines from a signal handler too

    def say(self, line: str) -> None:
        with self._lock:
            out = self.out or sys.stdout
            out.write(line + "\n")
            out.flush()

    def line(self, source: object, prefix: str, line: str) -> None:
        with self._lock:
            if self.once.shown(source, line):
                out = self.out or sys.stdout
                out.write(f"{prefix} {line}\n")
                out.flush()

    def follow(self, prefix: str, pipe: BinaryIO) -> None:
        """Show one of a child's streams until it ends (a thread's work)."""
        source = object()
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        screen = Screen()
        while chunk := pipe.read1(1 << 16):
            for line in screen.feed(decoder.decode(chunk)):
                self.line(source, prefix, line)
        for line in screen.feed(decoder.decode(b"", final=True)) + screen.close():
            self.line(source, prefix, line)
        pipe.close()
