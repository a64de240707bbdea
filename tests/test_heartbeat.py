"""A host's heartbeat: a beat that fails once (a race with a join that replaced its credential) says nothing; two in
a row say so once, under the name of what beats (a site relay's: its own)."""

from __future__ import annotations

import logging
import time

import pytest

from lightning_nodeox.host import heartbeat
from lightning_nodeox.host.heartbeat import Heartbeat


@pytest.fixture(autouse=True)
def short_interval(monkeypatch) -> None:
    """The beat after a failure comes MAX_INTERVAL (2 s) later, not a share of the lease it has not learnt: 10 ms
    here, so that four failures in a row take 40 ms of the suite, not 8 s."""
    monkeypatch.setattr(heartbeat, "MAX_INTERVAL", 0.01)


class Beats:
    """A client whose beats fail as ``script`` says (True: fails), then answer."""

    host = "siteA"
    joined = True

    def __init__(self, script: list[bool]) -> None:
        self.script = list(script)
        self.calls = 0

    def heartbeat(self) -> float:
        self.calls += 1
        if self.script and self.script.pop(0):
            raise ConnectionError("403: missing or wrong credential")
        return 0.04  # a lease of 40 ms: beats every 10 ms


def beat(script: list[bool], caplog) -> tuple[Beats, str]:
    client = Beats(script)
    with caplog.at_level(logging.INFO, logger="lightning_nodeox.host.heartbeat"):
        hb = Heartbeat(client, name="nodeox relay siteA")
        deadline = time.monotonic() + 10
        while client.calls < len(script) + 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        hb.stop()
    return client, caplog.text


def test_one_failed_beat_is_not_worth_a_line(caplog) -> None:
    client, said = beat([True, False, True, False], caplog)
    assert client.calls >= 7 and "heartbeat not answered" not in said


def test_failures_in_a_row_say_so_once_under_the_relays_name(caplog) -> None:
    client, said = beat([True, True, True, True], caplog)
    assert client.calls >= 7
    assert said.count("nodeox relay siteA: host siteA: heartbeat not answered (403: missing or wrong credential)") == 1
