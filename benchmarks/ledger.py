"""The data ledger's cost on the coordinator for a large epoch (issue 30's goal: under 100 MB and under 5 ms a
lease for a 10-million-sample epoch at 64 hosts), and the host's cost of reading its spans.

One process, no HTTP: a DataLedger of ``--samples`` samples in units of ``--unit-size``, ``--hosts`` hosts of
uneven speeds (a round trains 320 to 960 samples on each) leasing one unit whenever they run out, reporting what
they trained with each round's delta, and one round published at a time, through a whole epoch. Faults on the
way: every 25th round a host's delta is refused, every 40th a host leaves and a new one joins, and halfway the
coordinator restarts from the saved ledger. Printed: the ledger's own memory (tracemalloc, its module's
allocations at their peak) and the process's (tracemalloc peak, RSS growth), the time per lease, report
(``covered``), publish and save (median, p99, max), against the goals; then the host side: the order of a
unit's span and of 10k positions, and LedgerSampler's cost per sample.

    python benchmarks/ledger.py [--samples 10000000] [--hosts 64] [--unit-size 256] [--json]
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time
import tracemalloc

from common import rss

from lightning_nodeox.coordinator.ledger import DataLedger
from lightning_nodeox.core.ledger_order import DataOrder
from lightning_nodeox.core.ledger_terms import Covered, Lease, LeaseVoid, Span
from lightning_nodeox.host.ledger_sampler import LedgerSampler

MEMORY_GOAL = 100 * 2**20
LEASE_GOAL_S = 0.005


class SimHost:
    """A host's side, kept minimal: its leased spans, how far it trained them, its lease's generation."""

    def __init__(self, name: str, per_round: int) -> None:
        self.name, self.per_round, self.delta = name, per_round, 0
        self.spans: list[Span] = []
        self.lease: Lease | None = None

    def train(self, ledger: DataLedger, clock: dict) -> Covered | None:
        """One round's training: lease as it runs out (timed), then what the delta carries."""
        left, done = self.per_round, []
        while left:
            if not self.spans:
                start = time.perf_counter()
                reply = ledger.lease(self.name, 1, epoch=ledger.epoch)
                clock["lease"].append(time.perf_counter() - start)
                if not isinstance(reply, Lease):
                    break  # Wait: the epoch's tail, the pass ends; EpochEnd: the epoch is over
                self.lease, self.spans = reply, list(reply.spans)
            s = self.spans[0]
            n = min(left, len(s))
            done.append(Span(s.unit, s.start, s.start + n))
            self.spans[0] = Span(s.unit, s.start + n, s.end)
            if n == len(s):
                self.spans.pop(0)
            left -= n
        if self.lease is None:
            return None
        return Covered(self.lease.epoch, self.lease.generation, tuple(done))

    def void(self) -> None:
        self.spans, self.lease = [], None


def timed(clock: dict, key: str, fn, *args, **kw):
    start = time.perf_counter()
    out = fn(*args, **kw)
    clock[key].append(time.perf_counter() - start)
    return out


def ledger_bytes() -> int:
    """What the ledger's module holds now (tracemalloc: its own lines' allocations, numpy's arrays included)."""
    snap = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(True, "*coordinator/ledger.py")])
    return sum(stat.size for stat in snap.statistics("filename"))


def one_round(ledger: DataLedger, hosts: list[SimHost], clock: dict, r: int, rng: random.Random) -> DataLedger:
    taken = []
    for h in hosts:
        covered = h.train(ledger, clock)
        if covered is None:
            continue
        h.delta += 1
        try:
            timed(clock, "covered", ledger.covered, h.name, covered, delta=h.delta)
            taken.append((h.name, h.delta))
        except LeaseVoid:
            h.void()
    if r % 25 == 24:  # a refused delta: its host's lease is void
        h = rng.choice(hosts)
        void = set(ledger.refused(h.name))
        taken = [(n, d) for n, d in taken if not (n == h.name and d in void)]
        h.void()
    published = timed(clock, "publish", ledger.publish, taken)
    saved = timed(clock, "save", ledger.to_bytes)
    clock["saved_bytes"].append(len(saved))
    if r % 40 == 39:  # a host leaves, another joins
        gone = hosts.pop(rng.randrange(len(hosts)))
        ledger.gone(gone.name)
        hosts.append(SimHost(f"j{r}", rng.randrange(320, 961)))
        ledger.check_length(ledger.order.samples)
    if clock.get("restart_at") == r:
        ledger = timed(clock, "restore", DataLedger.from_bytes, saved)
        for h in hosts:
            h.void()
    clock["ended"] = published.epoch_ended
    return ledger


class Collections:
    """The process's full (generation 2) garbage collections while it is on, and what each took: a full
    collection walks every object of the process (torch's too), so it can land on any call measured."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._start = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if info["generation"] == 2:
            if phase == "start":
                self._start = time.perf_counter()
            else:
                self.times.append(time.perf_counter() - self._start)

    def __enter__(self) -> Collections:
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self)


def run_epoch(samples: int, host_count: int, unit_size: int, traced: bool) -> dict:
    """One epoch through the ledger; with ``traced``, under tracemalloc (its memory: the times are then not
    kept, tracemalloc slows every allocation)."""
    rng = random.Random(0)
    hosts = [SimHost(str(i), rng.randrange(320, 961)) for i in range(host_count)]
    clock: dict = {k: [] for k in ("lease", "covered", "publish", "save", "restore", "saved_bytes")}
    clock["restart_at"] = samples // (640 * host_count) // 2
    rss_before = rss()
    if traced:
        tracemalloc.start()
    ledger = DataLedger(DataOrder(samples, seed=1), unit_size=unit_size)
    peak_ledger, rounds, start = ledger_bytes() if traced else 0, 0, time.perf_counter()
    with Collections() as collections:
        while clock.get("ended") is None:
            ledger = one_round(ledger, hosts, clock, rounds, rng)
            rounds += 1
            if traced and rounds % 50 == 0:
                peak_ledger = max(peak_ledger, ledger_bytes())
    if not traced:
        return {"full_collections": len(collections.times), "full_collection_max_s": max(collections.times, default=0),
                "samples": samples, "hosts": host_count, "unit_size": unit_size, "units": ledger.units,
                "rounds": rounds, "epoch_s": time.perf_counter() - start, "rss_growth_bytes": rss() - rss_before,
                "saved_bytes_max": max(clock["saved_bytes"]),
                **{f"{k}_s": quantiles(clock[k]) for k in ("lease", "covered", "publish", "save", "restore")}}
    peak_ledger = max(peak_ledger, ledger_bytes())
    _, peak_traced = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return {"ledger_bytes_peak": peak_ledger, "traced_peak_bytes": peak_traced}


def coordinator_side(samples: int, host_count: int, unit_size: int) -> dict:
    """The epoch timed (and the process's RSS growth over it), then again under tracemalloc."""
    return {**run_epoch(samples, host_count, unit_size, False), **run_epoch(samples, host_count, unit_size, True)}


def quantiles(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {"n": len(xs), "median": statistics.median(xs), "p99": xs[min(len(xs) - 1, int(len(xs) * 0.99))],
            "max": xs[-1]}


def host_side(samples: int, unit_size: int) -> dict:
    order = DataOrder(samples, seed=1).epoch(0)
    out = {}
    for name, n in (("unit", unit_size), ("10k", 10_000)):
        times = []
        for i in range(200):
            start = time.perf_counter()
            at = i * n % (samples - n + 1)
            order.indices(at, at + n)
            times.append(time.perf_counter() - start)
        out[f"order_{name}_s"] = quantiles(times)
    ledger = DataLedger(DataOrder(samples, seed=1), unit_size=unit_size)
    sampler = LedgerSampler(lambda epoch: ledger.lease("h", 4, epoch=epoch), ledger.order, pause=lambda: None)
    count, start = 200_000, time.perf_counter()
    it = iter(sampler)
    for _ in range(count):
        next(it)
    out["sampler_per_sample_s"] = (time.perf_counter() - start) / count
    return out


def report(r: dict) -> None:
    mib, ms = 2**20, 1e3
    print(f"{r['samples']:,} samples, {r['hosts']} hosts, units of {r['unit_size']} ({r['units']:,} units), "
          f"{r['rounds']} rounds in {r['epoch_s']:.2f} s")
    print(f"  memory: ledger {r['ledger_bytes_peak'] / mib:.2f} MiB, whole process traced peak "
          f"{r['traced_peak_bytes'] / mib:.2f} MiB, RSS growth {r['rss_growth_bytes'] / mib:.2f} MiB "
          f"(goal < 100 MB: {'MET' if max(r['traced_peak_bytes'], r['rss_growth_bytes']) < MEMORY_GOAL else 'MISSED'})")
    for key in ("lease", "covered", "publish", "save", "restore"):
        q = r[f"{key}_s"]
        goal = f" (goal < 5 ms: {'MET' if q['max'] < LEASE_GOAL_S else 'MISSED'})" if key == "lease" else ""
        print(f"  {key:8} n={q['n']:6}  median {q['median'] * ms:.4f} ms  p99 {q['p99'] * ms:.4f} ms  "
              f"max {q['max'] * ms:.4f} ms{goal}")
    print(f"  saved state at most {r['saved_bytes_max']:,} bytes; the process's full garbage collections during "
          f"the timed epoch: {r['full_collections']}, the longest {r['full_collection_max_s'] * ms:.1f} ms")
    for key in ("order_unit_s", "order_10k_s"):
        q = r[key]
        print(f"  host: {key[:-2]:11} median {q['median'] * ms:.4f} ms  p99 {q['p99'] * ms:.4f} ms")
    print(f"  host: LedgerSampler {r['sampler_per_sample_s'] * 1e6:.2f} us a sample")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=10_000_000)
    p.add_argument("--hosts", type=int, default=64)
    p.add_argument("--unit-size", type=int, default=256)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    result = {**coordinator_side(args.samples, args.hosts, args.unit_size), **host_side(args.samples, args.unit_size)}
    print(json.dumps(result, indent=2)) if args.json else report(result)


if __name__ == "__main__":
    main()
