"""Emulated links for the benchmarks' processes: each site (or host) in a network namespace of its own, whose
one veth to a hub namespace is its link, shaped with ``tc tbf`` both ways (its uplink on its own end, its
downlink on the hub's end); what serves them all (a coordinator, a lighthouse) sits in the hub. A byte from site
0 to site 1 crosses site 0's link up and site 1's link down, as over two sites' own links. Where namespaces are
not permitted, `Loopback` stands in: every process on this machine's loopback, unshaped and uncounted.

This kernel has no netem: links are shaped in bandwidth only, never delayed. Needs root, ``ip`` and ``tc``
(`netns_missing` says what is missing). Used by benchmarks/sites_torchft.py, benchmarks/peers.py and
benchmarks/exchange.py (``--mbit``).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

from common import tail
from site_figures import PlacementFailed, Timeline, check_memory, sent_between

SAMPLE_S = 0.1  # seconds between two samples of the links' byte counters


def sh(*cmd: str) -> None:
    done = subprocess.run(cmd, check=False, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)}: {done.stderr.strip() or done.stdout.strip()}")


def netns_missing() -> str | None:
    """Why namespaces and tc cannot be used here, or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces and tc)"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    return f"{' and '.join(missing)} not found" if missing else None


class Namespaces:
    """A hub namespace with a bridge; one namespace per site with one veth into it, both ends shaped to ``mbit``
    (None: unshaped). Names start with ``prefix`` (a run of another benchmark with another prefix is left alone);
    addresses are ``subnet``.1, .2, ... and the hub's ``subnet``.254."""

    counted = True

    def __init__(self, sites: int, mbit: float | None, prefix: str = "nxft", subnet: str = "10.77.0") -> None:
        self.sites, self.mbit, self.prefix, self.subnet = sites, mbit, prefix, subnet
        self.hub = f"{prefix}-hub"
        self.names = [f"{prefix}-s{s}" for s in range(sites)]
        self.hub_ip = f"{subnet}.254"

    def ip(self, site: int) -> str:
        return f"{self.subnet}.{site + 1}"

    def dev(self, site: int) -> str:
        """The site's end of its veth."""
        return f"{self.prefix}{site}"

    def hub_end(self, site: int) -> str:
        """The hub's end of the site's veth."""
        return f"{self.prefix}h{site}"

    def exec(self, site: int | None) -> list[str]:
        """The command prefix that runs a process in ``site``'s namespace (None: the hub's)."""
        return ["ip", "netns", "exec", self.hub if site is None else self.names[site]]

    def __enter__(self) -> Namespaces:  # noqa: PYI034
        self.remove()  # what an earlier run with these names left behind
        try:
            sh("ip", "netns", "add", self.hub)
            sh("ip", "-n", self.hub, "link", "set", "lo", "up")
            sh("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
            sh("ip", "-n", self.hub, "addr", "add", f"{self.hub_ip}/24", "dev", "br0")
            sh("ip", "-n", self.hub, "link", "set", "br0", "up")
            for s, ns in enumerate(self.names):
                hub_end = self.hub_end(s)
                sh("ip", "netns", "add", ns)
                sh("ip", "-n", ns, "link", "set", "lo", "up")
                sh("ip", "link", "add", self.dev(s), "netns", ns, "type", "veth", "peer", "name", hub_end, "netns",
                   self.hub)
                sh("ip", "-n", ns, "addr", "add", f"{self.ip(s)}/24", "dev", self.dev(s))
                sh("ip", "-n", ns, "link", "set", self.dev(s), "up")
                sh("ip", "-n", self.hub, "link", "set", hub_end, "master", "br0", "up")
                if self.mbit is None:
                    continue
                for where, dev in ((ns, self.dev(s)), (self.hub, hub_end)):  # up, down
                    # burst: above one GSO segment (64 KiB)
                    sh("tc", "-n", where, "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{self.mbit:g}mbit",
                       "burst", "128kb", "latency", "100ms")
        except Exception:
            self.remove()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def remove(self) -> None:
        for ns in (*self.names, self.hub):
            subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True)


class Loopback:
    """`Namespaces`' stand-in without namespaces: every site on 127.0.0.1, unshaped; its links are not counted
    (one loopback carries every site's bytes)."""

    counted = False
    mbit = None
    hub_ip = "127.0.0.1"

    def __init__(self, sites: int) -> None:
        self.sites = sites

    def ip(self, site: int) -> str:
        return "127.0.0.1"

    def dev(self, site: int) -> str:
        return "lo"

    def exec(self, site: int | None) -> list[str]:
        return []

    def __enter__(self) -> Loopback:  # noqa: PYI034
        return self

    def __exit__(self, *exc: object) -> None:
        pass


Net = Namespaces | Loopback


def link_counters(namespace: str) -> dict[str, tuple[int, int]]:
    """``{device: (rx, tx)}`` bytes of every device in the network namespace named ``namespace``, read by its name
    (``ip -n``), so no process has to be inside it: a process started there with ``ip netns exec`` is not yet
    inside it for its first milliseconds (its /proc/PID/net/dev is then this namespace's, without the veth)."""
    done = subprocess.run(["ip", "-n", namespace, "-s", "-j", "link", "show"], check=False, capture_output=True,
                          text=True)
    if done.returncode:
        raise RuntimeError(f"the link counters of namespace {namespace} cannot be read: {done.stderr.strip()} "
                           "(was it removed while the run went on?)")
    return {d["ifname"]: (d["stats64"]["rx"]["bytes"], d["stats64"]["tx"]["bytes"]) for d in json.loads(done.stdout)}


class Counters:
    """Each site's link over time: ``up[s]`` (sent by site ``s``) and ``down[s]`` (received by it), read at the
    hub's end of the site's veth (its rx is what the site sent, its tx what the site received), all sites in one
    read of the hub namespace by name; the first read at construction. On `Loopback` nothing is sampled."""

    def __init__(self, net: Net) -> None:
        self.net, self.counted = net, net.counted
        self.up: list[Timeline] = [[] for _ in range(net.sites)]
        self.down: list[Timeline] = [[] for _ in range(net.sites)]
        self.sample()

    def sample(self) -> None:
        if not self.counted:
            return
        now, devices = time.time(), link_counters(self.net.hub)
        for s in range(self.net.sites):
            hub_end = self.net.hub_end(s)
            if hub_end not in devices:
                raise RuntimeError(f"no {hub_end} in namespace {self.net.hub}: its veth is gone")
            rx, tx = devices[hub_end]
            self.up[s].append((now, rx))
            self.down[s].append((now, tx))

    def both_ways(self, start: float, end: float) -> int:
        """Bytes over every site's link, up and down, in the window (start, end]."""
        return sum(sent_between(t, start, end) for t in (*self.up, *self.down))

    def up_per_site(self, start: float, end: float) -> float:
        return sum(sent_between(t, start, end) for t in self.up) / self.net.sites

    def down_per_site(self, start: float, end: float) -> float:
        return sum(sent_between(t, start, end) for t in self.down) / self.net.sites

    def total(self) -> int:
        return sum(t[-1][1] - t[0][1] for t in (*self.up, *self.down) if t)


async def watch(workers: dict[str, subprocess.Popen], services: dict[str, subprocess.Popen], counters: Counters,
                memory: dict, timeout: float, logs: Path) -> None:
    """Until every worker has ended, sampling ``counters`` and memory (`check_memory`) meanwhile. Raises
    PlacementFailed, with the tails of the ``*.log`` files in ``logs``, when a worker failed, a service (which
    runs until stopped) ended, or ``timeout`` seconds passed."""
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in workers.values()):
        if any(p.returncode not in (None, 0) for p in workers.values()) or \
                any(p.poll() is not None for p in services.values()):
            break
        if time.monotonic() > deadline:
            raise PlacementFailed(f"the run did not finish within {timeout:.0f} s")
        check_memory(memory)
        counters.sample()
        await asyncio.sleep(SAMPLE_S)
    counters.sample()
    failed = [f"{name} (status {p.returncode})" for name, p in workers.items() if p.returncode]
    failed += [f"{name} (ended)" for name, p in services.items() if p.poll() is not None]
    if failed:
        raise PlacementFailed(f"{', '.join(failed)} failed:\n" + "\n".join(
            f"--- {f.name} ---\n{tail(f)}" for f in sorted(logs.glob("*.log"))))
