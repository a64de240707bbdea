"""The status page's files and names: what the coordinator (and every relay, for its site) serves at ``/``.

Plain HTML, CSS and a small script shipped in the package (``static/``: no build step, nothing fetched from
elsewhere, so it works on an air-gapped cluster). The page polls ``GET /v1/status`` (its ``live`` part,
:mod:`~lightning_nodeox.coordinator.watch`) and changes nothing in the run. It is behind the run's token: the
coordinator prints a link that carries it once (:func:`link`); opened, the page keeps it in a cookie named for
the coordinator's port (:func:`cookie_name`: two coordinators on one machine keep theirs apart), HttpOnly, path
``/``, sent back only with the page's own reads.
"""

from __future__ import annotations

from functools import cache
from importlib import resources
from urllib.parse import quote

PAGE = "/"
FILES = "/static/"
ASSETS = {"index.html": "text/html", "page.js": "text/javascript", "page.css": "text/css"}


@cache
def asset(name: str) -> bytes:
    """One of :data:`ASSETS`, as shipped in the package."""
    return resources.files(__package__).joinpath("static", name).read_bytes()


def cookie_name(port: int | None) -> str:
    return f"nodeox_token_{port or 0}"


def link(url: str, token: str | None) -> str:
    """The page's address, carrying ``token`` when the run has one."""
    return f"{url}{PAGE}" + (f"?token={quote(token, safe='')}" if token else "")
