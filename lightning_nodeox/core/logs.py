"""How the package's own log lines look, wherever it sets logging up (the ``nodeox`` command; a host whose
application did not configure logging): the message alone, as Lightning's own lines are. Each message names its
source (``nodeox coordinator: ...``, ``NodeoxStrategy: ...``), ``nodeox launch`` prefixes each line with its
process (``[coordinator]``, ``[host 0]``), and the run's times are in its events.jsonl."""

from __future__ import annotations

import logging

FORMAT = "%(message)s"


def handler() -> logging.Handler:
    """A handler to stderr in :data:`FORMAT`."""
    h = logging.StreamHandler()
    h.setFormatter(logging.Formatter(FORMAT))
    return h
