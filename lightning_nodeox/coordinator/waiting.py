"""Why the run has not moved on, in one line naming whom it waits for (the coordinator logs it every
``status_interval`` seconds of a round that has not closed, so no combination of settings waits silently)."""

from __future__ import annotations

import logging
import time

from .recovery import Recovery
from .rounds import Rounds
from .runstate import RunState


def waiting_for(state: RunState, rounds: Rounds, recovery: Recovery, provider: str | None) -> tuple[int, str] | None:
    """A log level and a line saying why the run waits (None when it does not); ``provider``: the host asked for
    the model, if any."""
    if state.complete or rounds.closing:
        return None
    config = state.config
    if state.alone_since is not None:
        left = config.no_hosts_timeout - (time.monotonic() - state.alone_since)
        return logging.WARNING, (f"no host is live at round {state.round}: waiting for {state.hosts.absent()} to "
                                 f"come back, {max(left, 0):.0f} s more (--no-hosts-timeout "
                                 f"{config.no_hosts_timeout:g}); then the coordinator stops and the run resumes "
                                 "when it is started again")
    if state.model is None:
        if recovery.resumed is not None:
            return logging.WARNING, recovery.waits_for()
        if provider is None:
            return logging.INFO, "waiting for the first host to join: it provides the initial model"
        return logging.INFO, (f"host {provider} joined and uploads the initial model (another host is asked if it "
                              f"has not within --provider-timeout {config.provider_timeout:g} s)")
    hosts, received = state.hosts, rounds.received
    if not recovery.durable:
        return logging.WARNING, (f"round {state.round} does not close until the run's state is saved: "
                                 f"{recovery.store.dir} cannot be written (free space there; it is tried again "
                                 f"every {recovery.RETRY_S:g} s, and nothing published is lost meanwhile)")
    if rounds.open.joins_awaited():
        return logging.INFO, (f"round {state.round} waits for {rounds.open.joins_awaited()} more host(s) to join "
                              f"(--hosts {config.hosts}); joined: {', '.join(sorted(hosts)) or 'none'}")
    missing = rounds.open.missing()
    got = f"deltas from {', '.join(sorted(received)) or 'no host'}"
    needed = rounds.open.needed()
    if len(received) + len(missing) < needed:
        return logging.WARNING, (
            f"round {state.round} cannot close: it needs {needed} deltas (--min-hosts) and has {got}; live hosts "
            f"still to send: {', '.join(missing) or 'none'}; dropped: {hosts.dropped()}. Start the missing hosts "
            "again, or stop this coordinator and start it with a lower --min-hosts (the run resumes)")
    if missing:
        has = f"; it has those of {', '.join(sorted(received))}" if received else ""
        dropped = hosts.dropped()
        return logging.INFO, (f"round {state.round} waits for deltas from {_hosts(missing)}{has}"
                              + (f"; dropped: {dropped}" if dropped != "none" else ""))
    return None


def _hosts(ids: list[str]) -> str:
    return ("host " if len(ids) == 1 else "hosts ") + ", ".join(ids)
