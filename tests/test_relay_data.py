"""A site relay's data ledger (lightning_nodeox/relay/data.py, docs/ledger.md "relays"), in process: the site's
ledger (:class:`SiteData`) against a root's real one (:class:`RunData`), the relay's calls upstream answered by the
root as the relay's HTTP client would have them answered. The hosts "train" every position they lease."""

from __future__ import annotations

import asyncio

import pytest

from lightning_nodeox.coordinator.data import RunData
from lightning_nodeox.core.ledger_order import DataOrder
from lightning_nodeox.core.ledger_terms import Covered, EpochEnd, Lease, Span, Wait
from lightning_nodeox.core.protocol import DataSpec, Reason, Refusal
from lightning_nodeox.relay.data import SiteData

SAMPLES, UNIT = 1000, 100
DATA = DataSpec(SAMPLES, seed=3, shuffle=True)
RELAY = "siteA"


class RootClient:
    """The relay's client upstream (the calls SiteData makes), answered by the root's ledger in process."""

    def __init__(self, root: RunData) -> None:
        self.root, self.data, self.joined, self.calls = root, None, False, 0
        self.refuse: Refusal | None = None  # what the root answers a lease with instead (it restarted, say)

    def join(self) -> None:  # the root's membership declares the relay's data at its join
        self.root.declare(RELAY, self.data)
        self.joined = True

    def status(self) -> dict:
        return {"data": self.root.status()}

    def lease(self, epoch: int | None, units: int = 1):
        self.calls += 1
        if self.refuse is not None:
            raise self.refuse
        return self.root.lease(RELAY, epoch, units)


class RootUpstream:
    url = "http://root.invalid"

    def __init__(self, root: RunData) -> None:
        self.client = RootClient(root)
        self.ready = asyncio.Event()  # the relay's model is the root's (the root leases nothing before)
        self.ready.set()

    async def call_data(self, fn, *args):
        return fn(*args)


class Site:
    """A root, a relay's site ledger under it, and the relay's rounds: its hosts' reports go up as its own."""

    def __init__(self) -> None:
        self.root = RunData(UNIT, "root")
        self.upstream = RootUpstream(self.root)
        self.data = SiteData(self.upstream, "relay")
        self.round = 0
        self.held: dict[str, list[Span]] = {}  # each host's spans leased and not yet reported
        self.epoch: dict[str, int | None] = {}

    def join(self, *hosts: str) -> None:
        for h in hosts:
            self.data.declare(h, DATA)
            if not self.upstream.client.joined:
                self.upstream.client.join()
            self.epoch[h] = None

    def lease(self, host: str, units: int = 1):
        reply = asyncio.run(self.data.lease_call(host, self.epoch[host], units))
        if isinstance(reply, Lease):
            self.epoch[host] = reply.epoch
            self.held.setdefault(host, []).extend(reply.spans)
        elif isinstance(reply, EpochEnd):
            self.epoch[host] = reply.now
        return reply

    def report(self, host: str) -> Covered:
        """Everything ``host`` holds, trained: its delta of this round reports it."""
        spans, self.held[host] = tuple(self.held.get(host, ())), []
        return Covered(self.epoch[host], self.data.ledger.status()["hosts"][host]["generation"], spans)

    def close(self, *hosts: str, upstream_takes: bool = True) -> int:
        """The relay's round: its hosts' reports noted, their union up as the relay's delta, published at the root
        (or refused there), then at the site. Returns the samples the root committed."""
        for h in hosts:
            self.data.covered(h, self.round, self.report(h))
        taken = [(h, self.round) for h in hosts]
        covered = self.data.carried(taken)
        committed = 0
        if upstream_takes:
            self.root.covered(RELAY, self.round, covered)
            committed = self.root.publish([(RELAY, self.round)])["published_samples"]
        else:  # refused upstream (late, say): the root voids the relay's lease, the relay learns it from the reply
            self.root.refused(RELAY)
            self.data.upstream_void()
        self.data.publish(taken)
        self.round += 1
        return committed

    def positions(self, spans) -> list[int]:
        return [p for s in spans for p in range(s.start, s.end)]


def test_hosts_lease_from_a_block_the_relay_refills_upstream_and_the_root_commits_each_sample_once() -> None:
    site = Site()
    site.join("x", "y")
    assert site.upstream.client.data == DATA  # the relay declares the site's data upstream at its join
    site.lease("x")  # nothing held: one unit a host, the hosts that leased (one so far)
    site.lease("y")  # x holds the block: the relay leases again (two hosts now: two units)
    assert site.upstream.client.calls == 2 and site.root.status()["hosts"][RELAY]["units_held"] == 3
    site.lease("x")  # from the block: no call upstream
    assert site.upstream.client.calls == 2
    committed, trained, rounds = 0, [], 0
    while site.data.ledger.epoch == 0 and rounds < 50:
        for h in ("x", "y"):
            trained += site.positions(site.held.get(h, ()))
        committed += site.close("x", "y")
        for h in ("x", "y"):
            site.lease(h)
        rounds += 1
    assert sorted(trained) == list(range(SAMPLES)) and committed == SAMPLES  # each position once, all committed
    assert site.root.ledger.epoch == 1 and site.data.ledger.epoch == 1  # the root's epoch end moved the site on
    assert site.root.status()["hosts"][RELAY]["committed"] == SAMPLES
    assert site.data.status()["hosts"]["x"]["committed"] + site.data.status()["hosts"]["y"]["committed"] == SAMPLES


def test_a_relay_delta_refused_upstream_voids_the_sites_leases_and_its_units_go_back_at_the_root() -> None:
    site = Site()
    site.join("x", "y")
    x = site.lease("x")
    site.lease("y")
    site.lease("x")  # x holds two units, y one: the root counts all three the relay's
    assert site.close("x", "y", upstream_takes=False) == 0
    root = site.root.status()
    assert root["hosts"][RELAY]["units_held"] == 0 and root["units_free"] == SAMPLES // UNIT  # all back at the root
    assert site.data.status()["epoch_committed_samples"] == 0  # the site committed nothing of that round
    with pytest.raises(Refusal) as refused:  # the host's next report: LEASE_VOID, as from the root
        site.data.covered("x", site.round, Covered(0, x.generation, x.spans))
    assert refused.value.reason is Reason.LEASE_VOID
    again = site.lease("x")  # a fresh lease, of a block leased again upstream under the relay's new generation
    assert again.generation == x.generation + 1 and site.data.generation == 1
    assert again.spans[0].start == again.spans[0].unit * UNIT  # from the unit's start: nothing was committed
    site.held = {"x": list(again.spans)}
    assert site.close("x") == UNIT  # the root takes the new lease's report


def test_a_host_that_leaves_the_site_gives_its_units_back_to_the_sites_block() -> None:
    site = Site()
    site.join("x", "y")
    site.lease("x")
    site.lease("x")  # x holds two units (the first block of one, then another)
    calls, held = site.upstream.client.calls, site.root.status()["hosts"][RELAY]["units_held"]
    first = site.held["x"][0]
    site.data.covered("x", 0, Covered(0, 0, (Span(first.unit, first.start, first.start + 30),)))
    site.data.gone("x")  # left (or its lease expired): its units go back to the site, not upstream
    got = site.lease("y", 2)
    assert {s.unit for s in got.spans} == {s.unit for s in site.held["x"]}  # the same units, from the site's block
    assert all(s.start == s.unit * UNIT for s in got.spans)  # its unpublished report went back too
    assert site.upstream.client.calls == calls and site.root.status()["hosts"][RELAY]["units_held"] == held
    with pytest.raises(Refusal) as refused:  # a report of a unit the host does not hold: bad input, as at the root
        site.data.covered("x", 1, Covered(0, 1, (Span(got.spans[0].unit, got.spans[0].start, got.spans[0].end),)))
    assert refused.value.reason is Reason.INVALID and "not leased to it" in str(refused.value)


def test_a_host_that_leaves_while_its_round_is_upstream_keeps_what_it_reported_until_the_round_is_published() -> None:
    site = Site()
    site.join("x", "y")
    site.lease("x", 2)
    first, second = site.held["x"]
    site.held["x"] = [first]
    site.data.covered("x", 0, site.report("x"))
    covered = site.data.carried([("x", 0)])
    site.data.sending()
    site.data.gone("x")  # it left (its final round, say) as the relay's delta went upstream
    site.root.covered(RELAY, 0, covered)
    site.root.publish([(RELAY, 0)])
    assert site.data.publish([("x", 0)])["published_samples"] == UNIT  # the root took it: the site commits it
    got = site.lease("y")
    assert got.spans == (Span(second.unit, second.start, second.end),)  # x's other unit, back in the block


def test_a_relay_that_dies_is_gone_at_the_root_and_its_uncommitted_units_go_to_other_hosts() -> None:
    site = Site()
    site.join("x")
    site.lease("x")
    second = site.lease("x").spans[0]  # x holds two units, each leased upstream in a block of one
    site.held["x"] = site.held["x"][:1]  # x trained its first unit only
    assert site.close("x") == UNIT
    site.root.declare("other", DATA)
    site.root.gone(RELAY)  # the relay was cut off past its lease (it died), or it left
    other = site.root.lease("other", None, 10)
    assert sum(len(s) for s in other.spans) == SAMPLES - UNIT  # every uncommitted unit, the relay's second too
    assert second.unit in {s.unit for s in other.spans}
    assert site.root.status()["hosts"][RELAY]["returned"] == UNIT
    # the relay back (it was only cut off): its lease upstream is of a new generation, so its site drops the block
    # it held (x's second unit) and leases out only what the root counts as the relay's
    site.root.refused("other")
    again = site.lease("x")
    assert site.data.generation == 1 and again.generation == 1  # x's old lease is void below too
    assert site.data.status()["units_free"] == 0 and site.data.status()["hosts"]["x"]["units_held"] == 1
    assert site.root.status()["hosts"][RELAY]["units_held"] == 1


def test_a_site_refuses_a_host_whose_data_is_not_its_own_naming_both() -> None:
    site = Site()
    site.join("x")
    with pytest.raises(Refusal, match="has 999 samples but the run's has 1000"):
        site.data.declare("y", DataSpec(999, seed=3, shuffle=True))
    other = SiteData(RootUpstream(site.root), "relay B")  # another relay, its site of another order
    other.declare("z", DataSpec(SAMPLES, seed=4, shuffle=True))
    with pytest.raises(Refusal, match="seed 4, shuffle True but the run's is seed 3, shuffle True"):
        other.upstream.client.join()  # the root refuses the relay's join, naming both
    other.join_refused()  # (Site.before_join) the next host's data is declared upstream instead
    assert other.spec is None and other.upstream.client.data is None
    fresh = SiteData(RootUpstream(RunData(UNIT, "root")), "relay")
    fresh.upstream.client.joined = True  # joined upstream before any of its hosts declared data
    with pytest.raises(Refusal, match="joined http://root.invalid without any"):
        fresh.declare("x", DATA)


def test_the_site_moves_on_to_the_next_epoch_once_it_published_its_last_reports_as_the_root_did() -> None:
    site = Site()
    site.join("x")
    assert len(site.lease("x", 10).spans) == 10  # the whole epoch, in one block
    site.data.covered("x", 0, site.report("x"))
    taken = [("x", 0)]
    site.root.covered(RELAY, 0, site.data.carried(taken))
    assert site.root.publish([(RELAY, 0)])["epoch_ended"] == 0
    assert site.lease("x") == Wait(0)  # the root's epoch ended, but the site's last round is not published yet
    assert site.data.ledger.epoch == 0 and site.data.publish(taken)["published_samples"] == SAMPLES
    assert site.lease("x") == EpochEnd(0, 1) and site.data.ledger.epoch == 1
    assert site.data.status()["hosts"]["x"]["committed"] == SAMPLES


def test_before_the_root_has_the_model_or_after_it_restarted_the_sites_hosts_wait() -> None:
    site = Site()
    site.join("x")
    site.upstream.ready.clear()  # the site's model is still on its way up (its first host provided it)
    site.data.patience = 0.05
    assert site.lease("x") == Wait(0) and site.upstream.client.calls == 0
    site.upstream.ready.set()
    site.upstream.client.refuse = Refusal(Reason.NO_MODEL, "the run has no model yet")  # the root restarted
    assert site.lease("x") == Wait(0)
    site.upstream.client.refuse = Refusal(Reason.INVALID, "bad")  # anything else is the host's to see
    with pytest.raises(Refusal, match="bad"):
        site.lease("x")
    site.upstream.client.refuse = None
    assert isinstance(site.lease("x"), Lease)


def test_a_host_ahead_of_a_site_restored_from_an_older_state_gets_a_lease_of_its_epoch_not_an_error() -> None:
    """A relay restarted from a state saved before the root's epoch ended: its hosts ask for the next epoch; the site
    catches up from the root (its EpochEnd moves the site on) instead of refusing them as bad input."""
    site = Site()
    site.join("x")
    site.lease("x")
    older = site.data.saved()  # the relay's saved state, in epoch 0
    rounds = 0
    while site.data.ledger.epoch == 0 and rounds < 50:
        site.close("x")
        site.lease("x")
        rounds += 1
    assert site.root.ledger.epoch == 1 and site.epoch["x"] == 1
    site.data.restore(older)  # the relay restarted from its older state
    assert site.data.ledger.epoch == 0
    reply = site.lease("x")
    assert isinstance(reply, Lease) and reply.epoch == 1 and site.data.ledger.epoch == 1
