"""The data ledger (issue 30), its core without the wiring: the epoch's order (core/ledger_order.py), the
coordinator's ledger (coordinator/ledger.py) and the host's sampler (host/ledger_sampler.py), in one process.

The simulated run (:class:`Run`) drives hosts of one or two ranks, each rank a real LedgerSampler, through
leases, rounds, refusals, hosts gone and joining and coordinator restarts; every epoch that ends must have
committed each sample index exactly once, and no position committed is leased again."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_nodeox.coordinator.ledger import DataLedger
from lightning_nodeox.coordinator.ledger_saved import RESTORE_STEP
from lightning_nodeox.core.ledger_order import DataOrder, EpochOrder
from lightning_nodeox.core.ledger_terms import (Covered, EpochEnd, Lease, LeaseVoid, Span, Wait, reply_from_dict)
from lightning_nodeox.host.ledger_sampler import LedgerSampler


# ---- the order ----

@pytest.mark.parametrize("n", [1, 2, 7, 1000, 2**20 + 3])
def test_an_epochs_order_is_a_bijection_of_the_datasets_indices(n):
    order = EpochOrder(n, seed=5, epoch=3)
    assert np.array_equal(np.sort(order.indices(0, n)), np.arange(n))


def test_the_order_is_the_same_on_every_call_and_for_any_cut_into_spans():
    whole = EpochOrder(10_007, 1, 2).indices(0, 10_007)
    assert np.array_equal(whole, EpochOrder(10_007, 1, 2).indices(0, 10_007))
    cuts = [0, 1, 500, 501, 4096, 9000, 10_007]
    parts = [EpochOrder(10_007, 1, 2).indices(a, b) for a, b in zip(cuts, cuts[1:])]
    assert np.array_equal(np.concatenate(parts), whole)
    assert EpochOrder(10_007, 1, 2).index(4242) == whole[4242]


def test_the_order_differs_across_epochs_and_seeds_and_is_the_identity_unshuffled():
    n = 1000
    base = EpochOrder(n, 0, 0).indices(0, n)
    for other in (EpochOrder(n, 0, 1), EpochOrder(n, 1, 0)):
        assert np.count_nonzero(other.indices(0, n) == base) < 20  # about one in a thousand by chance
    assert not np.array_equal(base, np.arange(n))
    assert np.array_equal(DataOrder(n, shuffle=False).epoch(4).indices(3, 9), np.arange(3, 9))
    with pytest.raises(ValueError, match="outside the epoch"):
        EpochOrder(n, 0, 0).indices(990, 1001)
    with pytest.raises(ValueError, match="at least one sample"):
        DataOrder(0)


# ---- the ledger's rules ----

def ledger(n=1000, size=100, **kw) -> DataLedger:
    return DataLedger(DataOrder(n, seed=1, **kw), unit_size=size)


def report(lease: Lease, *spans: tuple[int, int, int]) -> Covered:
    return Covered(lease.epoch, lease.generation, tuple(Span(*s) for s in spans))


def test_a_host_whose_dataset_length_differs_is_refused_naming_both_lengths():
    with pytest.raises(ValueError, match="999 samples but the run's has 1000"):
        ledger().check_length(999)
    ledger().check_length(1000)


def test_units_are_leased_fresh_in_order_and_the_last_unit_is_short():
    led = ledger(n=250, size=100)
    a = led.lease("a", 2)
    assert a == Lease(0, 0, (Span(0, 0, 100), Span(1, 100, 200)))
    assert led.lease("b", 5) == Lease(0, 0, (Span(2, 200, 250),))
    assert led.lease("b") == Wait(0)


def test_a_report_of_a_unit_never_leased_or_out_of_order_or_twice_is_refused_and_changes_nothing():
    led = ledger()
    a = led.lease("a", 1)
    led.lease("b", 1)
    with pytest.raises(ValueError, match="never leased"):
        led.covered("c", report(a, (0, 0, 10)), delta=0)
    with pytest.raises(ValueError, match="not leased to it"):
        led.covered("a", report(a, (1, 100, 110)), delta=0)
    with pytest.raises(ValueError, match="not a unit of this epoch"):
        led.covered("a", report(a, (10, 1000, 1001)), delta=0)
    with pytest.raises(ValueError, match="reading stands at 0"):
        led.covered("a", report(a, (0, 5, 10)), delta=0)
    with pytest.raises(ValueError, match="reading stands at 10"):  # the second span does not follow the first
        led.covered("a", report(a, (0, 0, 10), (0, 11, 20)), delta=0)
    led.covered("a", report(a, (0, 0, 10)), delta=0)  # nothing of the refused reports was noted
    with pytest.raises(ValueError, match="noted once"):
        led.covered("a", report(a, (0, 10, 20)), delta=0)
    led.publish([("a", 0)])
    with pytest.raises(ValueError, match="already committed up to 10"):
        led.covered("a", report(a, (0, 0, 10)), delta=1)
    led.covered("a", report(a, (0, 10, 100)), delta=1)
    led.publish([("a", 1)])
    with pytest.raises(ValueError, match="already committed"):  # the whole unit: no longer leased to anyone
        led.covered("a", report(a, (0, 99, 100)), delta=2)


def test_a_unit_straddling_rounds_is_committed_piece_by_piece():
    led = ledger()
    a = led.lease("a", 1)
    led.covered("a", report(a, (0, 0, 30)), delta=0)
    assert led.publish([("a", 0)]).spans == (Span(0, 0, 30),)
    led.covered("a", report(a, (0, 30, 60)), delta=1)
    led.covered("a", report(a, (0, 60, 100)), delta=2)  # overlap: the next delta before the last was decided
    with pytest.raises(ValueError, match="in the order it sent them"):
        led.publish([("a", 2)])
    published = led.publish([("a", 1), ("a", 2)])
    assert (published.samples, published.spans) == (70, (Span(0, 30, 100),))
    assert led.status()["hosts"]["a"]["units_held"] == 0


def test_a_withdrawn_report_is_forgotten_so_its_delta_may_be_sent_again():
    led = ledger()
    a = led.lease("a", 1)
    led.covered("a", report(a, (0, 0, 30)), delta=0)
    led.covered("a", report(a, (0, 30, 50), (0, 50, 60)), delta=1)
    assert not led.withdraw("a", 0)  # only the latest undecided report (a delta sent again comes last)
    assert led.withdraw("a", 1)
    led.covered("a", report(a, (0, 30, 60)), delta=1)  # the delta sent again
    assert led.publish([("a", 0), ("a", 1)]).spans == (Span(0, 0, 60),)


def test_a_refused_delta_voids_the_hosts_lease_and_its_units_go_back_first():
    led = ledger()
    a = led.lease("a", 2)
    led.covered("a", report(a, (0, 0, 40)), delta=0)
    led.publish([("a", 0)])
    led.covered("a", report(a, (0, 40, 70)), delta=1)
    led.covered("a", report(a, (0, 70, 100), (1, 100, 120)), delta=2)
    assert led.refused("a") == [1, 2]  # every undecided delta of it is void: none may be taken into a round
    with pytest.raises(LeaseVoid, match="lease again"):
        led.covered("a", report(a, (1, 120, 130)), delta=3)
    b = led.lease("b", 3)
    assert b.spans == (Span(0, 40, 100), Span(1, 100, 200), Span(2, 200, 300))  # from the committed cursor on
    counts = led.counts("a")
    assert (counts.leased, counts.committed, counts.returned, counts.in_flight) == (200, 40, 160, 0)
    a2 = led.lease("a", 1)
    assert a2.generation == 1 and a2.spans == (Span(3, 300, 400),)


def test_an_epoch_ends_for_every_host_when_all_its_units_are_committed():
    led = ledger(n=200, size=100)
    a, b = led.lease("a"), led.lease("b")
    assert led.lease("a", epoch=0) == Wait(0)  # b holds the last unit: a waits (it does not take b's over)
    led.covered("a", report(a, (0, 0, 100)), delta=0)
    led.covered("b", report(b, (1, 100, 150)), delta=0)
    assert led.publish([("a", 0), ("b", 0)]).epoch_ended is None
    led.covered("b", report(b, (1, 150, 200)), delta=1)
    assert led.publish([("b", 1)]).epoch_ended == 0
    assert led.lease("a", epoch=0) == EpochEnd(0, 1)
    assert led.lease("a", epoch=1).epoch == 1
    assert led.lease("c").spans == (Span(1, 100, 200),)  # a new host takes the current epoch
    with pytest.raises(ValueError, match="asks for epoch 2 but the ledger is at epoch 1"):
        led.lease("a", epoch=2)
    with pytest.raises(ValueError, match="at least one unit"):
        led.lease("a", 0)


def test_a_host_gone_gives_back_what_it_reported_but_was_not_published():
    led = ledger()
    a = led.lease("a", 1)
    led.covered("a", report(a, (0, 0, 50)), delta=0)
    assert led.gone("a") == [0]
    status = led.status()
    assert status["hosts"]["a"]["present"] is False and status["hosts"]["a"]["returned"] == 100
    assert led.lease("b").spans == (Span(0, 0, 100),)
    assert led.gone("never-seen") == []


def test_the_saved_ledger_is_small_and_a_restored_one_voids_every_lease():
    led = DataLedger(DataOrder(10_000_000), unit_size=256)
    leases = {h: led.lease(h, 2) for h in ("a", "b")}
    u0 = leases["a"].spans[0]
    led.covered("a", report(leases["a"], (u0.unit, u0.start, u0.start + 10)), delta=0)
    led.publish([("a", 0)])
    saved = led.to_bytes()
    assert len(saved) < 1000  # O(units held), not O(units)
    back = DataLedger.from_bytes(saved)
    with pytest.raises(LeaseVoid):
        back.covered("a", report(leases["a"], (u0.unit, u0.start + 10, u0.start + 20)), delta=1)
    again = back.lease("b", 1)
    assert again.generation == RESTORE_STEP and again.spans == (Span(u0.unit, u0.start + 10, u0.end),)
    assert back.status()["epoch_committed_samples"] == 10
    assert back.lease("c", 4).spans[-1].unit == 4  # the given-back units, then fresh ones


def test_a_relay_leases_a_block_upstream_and_leases_it_again_below_with_the_same_class():
    root = ledger(n=300, size=100)
    below = DataLedger.below(root.order, unit_size=100)
    assert below.lease("x") == Wait(0)  # nothing given yet: the relay leases upstream, as host "site"
    block = root.lease("site", 2)
    below.give(block)
    x, y = below.lease("x"), below.lease("y")
    assert (x.spans, y.spans) == ((Span(0, 0, 100),), (Span(1, 100, 200),))
    below.covered("x", report(x, (0, 0, 100)), delta=0)
    below.covered("y", report(y, (1, 100, 130)), delta=0)
    published = below.publish([("x", 0), ("y", 0)])  # the relay's round: its delta goes upstream with these
    root.covered("site", Covered(block.epoch, block.generation, published.spans), delta=0)
    root.publish([("site", 0)])
    assert root.status()["epoch_committed_samples"] == 130 and root.lease("z").spans == (Span(2, 200, 300),)
    with pytest.raises(ValueError, match="only a relay's ledger"):
        root.give(block)
    back = DataLedger.from_bytes(below.to_bytes())  # the relay's own state: its units, its leases void
    assert back.lease("x", 3).spans == (Span(1, 130, 200),)


def test_lease_replies_and_reports_survive_their_dict_form():
    for reply in (Lease(1, 2, (Span(3, 4, 5),)), Wait(2), EpochEnd(1, 3)):
        assert reply_from_dict(reply.to_dict()) == reply
    covered = Covered(1, 2, (Span(0, 0, 3), Span(5, 500, 512)))
    assert Covered.from_dict(covered.to_dict()) == covered and covered.samples == 15
    with pytest.raises(ValueError, match="not a ledger reply"):
        reply_from_dict({"kind": "what"})


# ---- the host's sampler ----

class Source:
    """A host's lease source over a ledger, its answers replayed to the host's other ranks."""

    def __init__(self, led: DataLedger, host: str, k: int = 1, check=lambda reply: None) -> None:
        self.led, self.host, self.k, self.answers, self.check = led, host, k, [], check

    def for_rank(self, rank: int):
        asked = [0]

        def source(epoch):
            if rank == 0:
                self.answers.append(self.led.lease(self.host, self.k, epoch=epoch))
                self.check(self.answers[-1])
            asked[0] += 1
            return self.answers[asked[0] - 1]
        return source


class Blocked(Exception):
    """The sampler would block (a Wait with nothing held): the simulated host tries again later."""


def block():
    raise Blocked


def test_a_hosts_ranks_split_each_row_and_their_union_is_the_lease():
    led = ledger(n=1000, size=100)
    src = Source(led, "a", k=2)
    samplers = [LedgerSampler(src.for_rank(r), led.order, rank=r, ranks=3, pause=block) for r in range(3)]
    its = [iter(s) for s in samplers]
    got = [[next(it) for _ in range(50)] for it in its]  # 150 positions: the 2 units and half of a third
    order = led.order.epoch(0)
    assert sorted(sum(got, [])) == sorted(order.indices(0, 150).tolist())
    assert got[1][:2] == [order.index(1), order.index(4)]
    covered = samplers[0].take_covered(40)  # 40 rows trained of 50 read: a prefetching loader
    assert covered == Covered(0, 0, (Span(0, 0, 100), Span(1, 100, 120)))
    assert samplers[2].take_covered(40) == covered  # every rank says the same


@pytest.mark.parametrize("drop_last", [False, True])
def test_a_pass_ends_on_wait_and_its_short_last_row_is_dropped_or_filled(drop_last):
    led = ledger(n=205, size=100)
    other = led.lease("b", 2)  # b holds units 0 and 1: a gets the short last unit (5 positions)
    src = Source(led, "a")
    samplers = [LedgerSampler(src.for_rank(r), led.order, rank=r, ranks=2, drop_last=drop_last, pause=block)
                for r in range(2)]
    passes = [list(s) for s in samplers]
    order = led.order.epoch(0)
    tail = order.indices(200, 205).tolist()
    if drop_last:
        assert passes == [tail[0:4:2], tail[1:4:2]]
    else:
        assert passes == [tail[0::2], tail[1::2] + [tail[4]]]  # the short row [tail[4]] repeated
    covered, same = (s.take_covered(len(passes[0]), pass_ended=True) for s in samplers)  # on every rank
    assert covered == same and covered.spans == (Span(2, 200, 205),)  # the dropped one counts as read, as DDP
    led.covered("a", covered, delta=0)
    led.publish([("a", 0)])
    for s in samplers:
        with pytest.raises(Blocked):  # nothing held: the next pass waits for the epoch's end
            next(iter(s))
    led.covered("b", report(other, (0, 0, 100), (1, 100, 200)), delta=0)
    assert led.publish([("b", 0)]).epoch_ended == 0
    nxt = [next(iter(s)) for s in samplers]  # an EpochEnd, then the new epoch's lease, in the same pass
    assert samplers[0].epoch == 1 and nxt == led.order.epoch(1).indices(0, 2).tolist()


def test_a_sampler_drops_what_it_holds_when_its_lease_is_void():
    led = ledger()
    src = Source(led, "a")
    sampler = LedgerSampler(src.for_rank(0), led.order, pause=block)
    it = iter(sampler)
    first = [next(it) for _ in range(30)]
    assert first == led.order.epoch(0).indices(0, 30).tolist()
    led.refused("a")
    sampler.void()
    rest = [next(it) for _ in range(5)]  # the void unit went back first: leased again, from its cursor
    assert rest == led.order.epoch(0).indices(0, 5).tolist()
    assert sampler.generation == 1
    assert sampler.take_covered(35) == Covered(0, 1, (Span(0, 0, 5),))


def test_a_pass_cut_short_reads_again_what_it_read_but_did_not_report():
    led = ledger()
    sampler = LedgerSampler(Source(led, "a").for_rank(0), led.order, pause=block)
    it = iter(sampler)
    [next(it) for _ in range(30)]  # 30 read (a loader prefetching), 20 trained, then the loop stops
    assert sampler.take_covered(20).spans == (Span(0, 0, 20),)
    again = iter(sampler)
    assert [next(again) for _ in range(3)] == led.order.epoch(0).indices(20, 23).tolist()
    assert sampler.take_covered(3).spans == (Span(0, 20, 23),)


# ---- the invariants, over any run ----

class Run:
    """Hosts of one or two ranks (LedgerSamplers) around one ledger, rounds published as the test says."""

    def __init__(self, n: int, size: int, shuffle: bool) -> None:
        self.led = DataLedger(DataOrder(n, seed=7, shuffle=shuffle), unit_size=size)
        self.n, self.hosts, self.round, self.names, self.sources = n, {}, [], 0, []
        self.committed: dict[int, np.ndarray] = {}  # epoch -> how many times each position was committed
        self.ended: list[int] = []

    def join(self, ranks: int, k: int) -> None:
        name = f"h{self.names}"
        self.names += 1
        self.led.check_length(self.n)
        src = Source(self.led, name, k, check=self.check)
        self.sources.append(src)
        samplers = [LedgerSampler(src.for_rank(r), self.led.order, rank=r, ranks=ranks, pause=block)
                    for r in range(ranks)]
        self.hosts[name] = {"samplers": samplers, "its": None, "rows": 0, "ended": False, "delta": 0}

    def train(self, name: str, rows: int) -> None:
        host = self.hosts[name]
        for _ in range(rows):
            if host["its"] is None:
                host["its"], host["rows"], host["ended"] = [iter(s) for s in host["samplers"]], 0, False
            outcomes = []
            for it in host["its"]:
                try:
                    outcomes.append(next(it))
                except (StopIteration, Blocked) as e:
                    outcomes.append(type(e))
            assert len({o if isinstance(o, type) else int for o in outcomes}) == 1, outcomes  # ranks in step
            if outcomes[0] is StopIteration:
                host["ended"], host["its"] = True, None
                return
            if outcomes[0] is Blocked:
                host["its"] = None
                return
            host["rows"] += 1

    def send(self, name: str) -> None:
        host = self.hosts[name]
        covered, *others = (s.take_covered(host["rows"], pass_ended=host["ended"]) for s in host["samplers"])
        assert all(c == covered for c in others)
        host["delta"] += 1
        try:
            self.led.covered(name, covered, delta=host["delta"])
        except LeaseVoid:
            for s in host["samplers"]:
                s.void()
            return
        self.round.append((name, host["delta"]))

    def publish(self) -> None:
        epoch = self.led.epoch
        published = self.led.publish(self.round)
        self.round = []
        counts = self.committed.setdefault(epoch, np.zeros(self.n, dtype=np.int64))
        for s in published.spans:
            counts[s.start:s.end] += 1
        if published.epoch_ended is not None:
            self.ended.append(published.epoch_ended)
            assert np.array_equal(counts, np.ones(self.n)), "an epoch ended without every position once"

    def refuse(self, name: str, tell: bool) -> None:
        void = set(self.led.refused(name))
        self.round = [(h, d) for h, d in self.round if not (h == name and d in void)]
        if tell:
            for s in self.hosts[name]["samplers"]:
                s.void()

    def gone(self, name: str) -> None:
        self.led.gone(name)
        self.round = [(h, d) for h, d in self.round if h != name]
        del self.hosts[name]

    def restart(self) -> None:
        self.led = DataLedger.from_bytes(self.led.to_bytes())
        for src in self.sources:  # the hosts now ask the restored ledger
            src.led = self.led
        self.round = []  # the round in progress is redone: its deltas are lost

    def check(self, reply) -> None:
        """No lease hands out a position committed in its epoch."""
        counts = self.committed.get(reply.epoch) if isinstance(reply, Lease) else None
        if counts is not None:
            for s in reply.spans:
                assert not counts[s.start:s.end].any(), (reply, "hands out what is committed")

    def drain(self, epochs: int) -> None:
        """Every host trains and sends, a round published, until ``epochs`` more epochs ended."""
        target = len(self.ended) + epochs
        for _ in range(3_000):
            if len(self.ended) >= target:
                return
            for name in list(self.hosts):
                self.train(name, 7)
                self.send(name)
            self.publish()
        raise AssertionError(f"the epochs did not end: {self.led.status()}")

OPS = st.one_of(
    st.tuples(st.just("train"), st.integers(0, 5), st.integers(1, 40)),
    st.tuples(st.just("send"), st.integers(0, 5)),
    st.tuples(st.just("publish")),
    st.tuples(st.just("refuse"), st.integers(0, 5), st.booleans()),
    st.tuples(st.just("gone"), st.integers(0, 5)),
    st.tuples(st.just("join"), st.integers(1, 2), st.integers(1, 3)),
    st.tuples(st.just("restart")),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(1, 300), size=st.integers(1, 40), shuffle=st.booleans(),
       ops=st.lists(OPS, max_size=40))
def test_every_epoch_commits_each_index_once_whatever_hosts_do(n, size, shuffle, ops):
    run = Run(n, size, shuffle)
    run.join(1, 1)
    for op in ops:
        names = sorted(run.hosts)
        kind = op[0]
        if kind in ("train", "send", "refuse", "gone") and not names:
            continue
        if kind == "train":
            run.train(names[op[1] % len(names)], op[2])
        elif kind == "send":
            run.send(names[op[1] % len(names)])
        elif kind == "publish":
            run.publish()
        elif kind == "refuse":
            run.refuse(names[op[1] % len(names)], op[2])
        elif kind == "gone":
            run.gone(names[op[1] % len(names)])
        elif kind == "join":
            run.join(op[1], op[2])
        else:
            run.restart()
    if not run.hosts:
        run.join(1, 2)
    for name in list(run.hosts):  # what each host read but never sent is its lease's: the host leaves, rejoins
        run.gone(name)
    run.join(2, 1)
    run.join(1, 2)
    run.drain(2)
    status = run.led.status()
    assert sum(h["committed"] for h in status["hosts"].values()) == sum(c.sum() for c in run.committed.values())
    for h in status["hosts"].values():
        assert h["leased"] == h["committed"] + h["returned"] + h["in_flight"]


def test_a_host_three_times_faster_takes_about_three_times_the_units():
    run = Run(n=30_000, size=64, shuffle=True)
    run.join(1, 1)
    run.join(1, 1)
    fast, slow = sorted(run.hosts)
    while not run.ended:  # each round: the same seconds, three times the steps on the fast host
        run.train(fast, 48)
        run.train(slow, 16)
        run.send(fast)
        run.send(slow)
        run.publish()
    status = run.led.status()["hosts"]
    ratio = status[fast]["committed"] / status[slow]["committed"]
    assert 2.7 < ratio < 3.3, ratio
