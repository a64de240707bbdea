"""How the package's own log lines look, wherever it sets logging up (the ``nodeox`` command; a host whose
application did not configure logging): the message alone, as Lightning's own lines are. Each message names its
source (``nodeox coordinator: ...``, ``nodeox relay siteA: ...``, ``NodeoxStrategy: ...``; a coordinator's run
names itself through :class:`Named`, from its config), ``nodeox launch`` prefixes each line with its process
(``[coordinator]``, ``[host 0]``), and the run's times are in its events.jsonl."""

from __future__ import annotations

import logging

FORMAT = "%(message)s"


def handler() -> logging.Handler:
    """A handler to stderr in :data:`FORMAT`."""
    h = logging.StreamHandler()
    h.setFormatter(logging.Formatter(FORMAT))
    return h


class Named(logging.LoggerAdapter):
    """``logger`` with every message starting ``SOURCE: `` (``nodeox coordinator: ...``, ``nodeox relay siteA:
    ...``): the code that logs is shared (a relay runs the coordinator's), the name is its run's."""

    def __init__(self, logger: logging.Logger, source: str) -> None:
        super().__init__(logger, {})
        self.source = source

    def process(self, msg, kwargs):
        return f"{self.source}: {msg}", kwargs
