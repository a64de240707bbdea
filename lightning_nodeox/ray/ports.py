"""A free port on this machine, for a server (:mod:`.server_actor`) or a host's DDP rendezvous (:mod:`.hosts`)."""

from __future__ import annotations

import socket


def free_port(host: str) -> int:
    """A port nothing listens on now at ``host`` (``""``: any address)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
