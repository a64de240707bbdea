"""What both sides agree on, free of heavy imports: the ``NODEOX_*`` environment names that ``nodeox launch`` sets
for hosts, and the checks of values that hosts and the coordinator both take. (A codec's settings are its own:
:mod:`lightning_nodeox.core.codecs.settings`.)"""

from __future__ import annotations

import re

ROUNDINGS = ("nearest", "stochastic")

ENV_URL = "NODEOX_COORDINATOR_URL"
ENV_HOST_ID = "NODEOX_HOST_ID"
ENV_TOKEN = "NODEOX_TOKEN"
RUN_DIR_TOKEN = "token"  # in a run directory: the bearer token `nodeox launch` made for its coordinator
ENV_TELEMETRY_URL = "NODEOX_TELEMETRY_URL"
ENV_NUM_HOSTS = "NODEOX_NUM_HOSTS"
ENV_RUN_DIR = "NODEOX_RUN_DIR"
ENV_CA_FILE = "NODEOX_CA_FILE"
ENV_LOCAL_RANK = "NODEOX_LOCAL_HOST_RANK"  # the host's position among the hosts on its machine (0 first)

HOST_ID_RULE = "1 to 64 of A-Z a-z 0-9 _ . - (not '.', '..' or 'coordinator')"
_HOST_ID = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_RESERVED_IDS = (".", "..", "coordinator")  # path segments, and the coordinator's own records


def check_rounding(rounding: str) -> None:
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding={rounding!r} is not supported; use 'nearest' or 'stochastic'")


def check_host_id(host_id: object, what: str = "host id") -> str:
    """A valid host id (returned), or a ValueError naming the rule."""
    if not isinstance(host_id, str) or not _HOST_ID.fullmatch(host_id) or host_id in _RESERVED_IDS:
        raise ValueError(f"{what} {host_id!r} is not valid: use {HOST_ID_RULE}")
    return host_id


def check_url(url: str, what: str) -> None:
    """A URL a host can reach, or a ValueError saying how to write one."""
    if not url.startswith(("http://", "https://")) or len(url.split("://", 1)[1]) == 0:
        raise ValueError(f"{what} {url!r} must look like http://HOST:8470 (or https://)")
