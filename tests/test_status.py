"""Watching a run while it runs: the coordinator's live view (``GET /v1/status``'s ``live``), `nodeox status` in a
terminal, and the status page in a real browser (headless Chromium over its DevTools protocol), behind the run's
token: the printed link carries it once, the page keeps it in a cookie, a load without either is refused, and
the page follows the run without a reload."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
from helpers import Coordinator, exchange, free_port, hosts, start_host, stop, terminate, upload, wait_for
from local_transport import LocalClient, LocalCoordinator

from lightning_nodeox.coordinator import statuspage
from lightning_nodeox.core.phases import PhaseRecord
from lightning_nodeox.relay.config import RelayConfig
from lightning_nodeox.relay.run import Site
from lightning_nodeox.relay.upstream import Upstream
from lightning_nodeox.tools import status as status_cli
from lightning_nodeox.tools import timeline

TOKEN = "s3cret-token"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
NO_CHROMIUM = "headless Chromium is not installed: apt-get install -y chromium (Debian's package; .ci/run does it)"
SCREENSHOT = os.environ.get("NODEOX_TEST_SCREENSHOT")  # where to keep the browser's screenshot (docs/)


def test_the_live_view_says_who_the_round_waits_for_and_each_hosts_wait_share_bytes_and_gpus(local_coordinator):
    c = local_coordinator(2, gpu_hour_price=3.6)
    a, _ = hosts(c, "a", "b")
    upload(a)
    state = c.run.state
    state.record(PhaseRecord(0, "a", "train", 100.0, 101.0, extra={"ranks": 2}),
                 PhaseRecord(0, "a", "upload", 101.0, 101.5, 1000), PhaseRecord(0, "a", "wait", 101.5, 103.0),
                 PhaseRecord(0, "a", "download", 103.0, 103.5, 500),
                 PhaseRecord(1, "a", "train", 104.0, 105.0, extra={"ranks": 2, "loss": 0.25}))
    c.tick()  # a memory sample
    live = c.call(_snapshot(c))
    assert live["state"] == "running" and live["round"] == 0 and live["model_hash"] == c.run.state.model.hash
    by_id = {h["id"]: h for h in live["hosts"]}
    assert by_id["a"]["state"] == "waiting" and by_id["b"]["state"] == "late"  # the round waits for b alone
    assert by_id["a"]["last_round"] == 1 and by_id["a"]["loss"] == 0.25 and by_id["a"]["gpus"] == 2
    assert by_id["a"]["wait_share"] == pytest.approx(1 - 1.0 / 4.0)  # trained 1 s of round 0's 4 s
    assert by_id["a"]["bytes_per_round"] == pytest.approx((1000 + 500 + 0) / 2)
    assert by_id["a"]["wait_cost"] == pytest.approx(1.5 * 2 / 3600 * 3.6)
    assert live["wait_cost"] == pytest.approx(by_id["a"]["wait_cost"])
    lanes = dict(live["timeline"]["lanes"])
    assert [name for name, _ in live["timeline"]["lanes"]] == ["coordinator", "a", "b"]
    assert [p[0] for p in lanes["a"]] == ["train", "upload", "wait", "download", "train"]
    assert lanes["a"][2][1:] == [101.5, 103.0, 0]  # [phase, start, end, round]
    assert live["coordinator"]["rss_bytes"] > 0  # the memory sample taken when the run started


async def _snapshot(c):
    return c.run.watch.snapshot()


def test_a_relays_live_view_holds_its_sites_hosts_and_the_root_sees_the_relay_as_one(tmp_path) -> None:
    root = LocalCoordinator(tmp_path / "root", 1)
    upstream = Upstream(RelayConfig(upstream="http://root", relay_id="site"), client=LocalClient(root, "site"))
    relay = LocalCoordinator(tmp_path / "relay", 2, site=Site(upstream))
    try:
        h0, h1 = hosts(relay, "0", "1")
        relay.call(relay.run.site.model.join_upstream_with_model())
        exchange((h0, 8), (h1, 24))
        site, top = relay.call(_snapshot(relay)), root.call(_snapshot(root))
    finally:
        relay.close()
        root.close()
    assert [h["id"] for h in site["hosts"]] == ["0", "1"] and [h["id"] for h in top["hosts"]] == ["site"]
    assert site["round"] == top["round"] == 1 and site["model_hash"] == top["model_hash"] == h0.model_hash
    assert {h["state"] for h in site["hosts"]} == {"training"}  # both synced, the next round open
    lanes = dict(site["timeline"]["lanes"])
    assert list(lanes) == ["coordinator", "0", "1", "site"]  # the relay's own exchange with the root: a lane
    assert "upload" in {p[0] for p in lanes["site"]}


def test_the_terminal_table_has_a_row_per_host_with_its_values() -> None:
    live = {"name": "nodeox coordinator", "state": "running", "round": 7, "published_round": 6, "model_hash": "ab12",
            "coordinator": {"rss_bytes": 5e8, "peak_rss_bytes": 6e8}, "link_bytes_per_s": 2e6,
            "gpu_hour_price": None, "hosts": [
                {"id": "0", "state": "waiting", "lease_age_s": 0.25, "last_round": 6, "wait_share": 0.12,
                 "bytes_per_round": 3e6, "loss": 0.5, "metrics": {"acc": 0.75}},
                {"id": "1", "state": "gone", "lease_age_s": 31.0, "last_round": 4, "wait_share": None,
                 "bytes_per_round": None, "loss": None, "metrics": {}}]}
    lines = status_cli.render({"live": live}).splitlines()
    assert lines[0] == "nodeox coordinator: running, round 7 (published 6), model ab12"
    assert "500.0 MB" in lines[1] and "2.0 MB/s" in lines[1]
    assert re.match(r"0 +waiting +0\.2 s +6 +12% +3\.0 MB +0\.5 +acc 0\.75$", lines[-2])
    assert re.match(r"1 +gone +31\.0 s +4 +- +- +- +-$", lines[-1])


def test_the_page_draws_each_phase_in_the_reports_colour() -> None:
    script = statuspage.asset("page.js").decode()
    block = re.search(r"PHASE_COLOURS = \{(.*?)\};", script, re.DOTALL).group(1)
    assert dict(re.findall(r"(\w+): \"(#[0-9a-f]{6})\"", block)) == timeline.PHASE_COLOURS


# -- a live run ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def live_run(tmp_path_factory, zygote):
    """A coordinator (token, ``--gpu-hour-price 2``) and 2 paced digits hosts, rounds of about a second, until the
    module's tests end."""
    if zygote is not None:
        zygote.ready()
    root = tmp_path_factory.mktemp("live")
    (root / "token").write_text(TOKEN)
    coord = Coordinator(root / "run", 2, "--token-file", str(root / "token"), "--gpu-hour-price", "2")
    procs = [start_host(h, coord.url, root / "out", "--max-steps", "100000", "--local-steps", "5", "--step-seconds",
                        "0.1", token=TOKEN) for h in "01"]
    try:
        wait_for(lambda: _status(coord.url)["published_round"] >= 1, 120, "round 1 published")
        yield coord, root / "token"
    finally:
        stop(procs)
        coord.stop()


def _status(url: str) -> dict:
    return requests.get(f"{url}/v1/status", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10).json()


def _nodeox(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lightning_nodeox", *args], check=False, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.slow
def test_nodeox_status_shows_both_hosts_and_the_round_and_fails_against_a_dead_url(live_run) -> None:
    coord, token = live_run
    before = _status(coord.url)["round"]
    out = _nodeox("status", coord.url, "--token-file", str(token))
    after = _status(coord.url)["round"]
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    shown = int(re.match(r"nodeox coordinator: running, round (\d+) ", lines[0]).group(1))
    assert before <= shown <= after
    rows = {line.split()[0]: line for line in lines if re.match(r"[01] ", line)}
    assert set(rows) == {"0", "1"} and all("rank_mean 0" in row for row in rows.values())  # their sync_dist value
    assert "waiting has cost" in lines[2] and "per GPU-hour" in lines[2]

    watched = subprocess.Popen([sys.executable, "-m", "lightning_nodeox", "status", coord.url, "--watch",
                                "--interval", "0.5", "--token-file", str(token)], stdout=subprocess.PIPE, text=True)
    tables: list[int] = []
    deadline = time.monotonic() + 60
    while not (len(tables) >= 2 and tables[-1] > tables[0]):  # redrawn as the run goes on
        line = watched.stdout.readline()
        assert line and time.monotonic() < deadline, f"the watch was never redrawn at a later round: {tables}"
        tables += [int(r) for r in re.findall(r"running, round (\d+) ", line)]
    terminate(watched, 5)
    watched.stdout.close()

    dead = _nodeox("status", f"http://127.0.0.1:{free_port()}")
    assert dead.returncode == 2 and "did not answer" in dead.stderr
    (token.parent / "wrong").write_text("not-the-token")
    refused = _nodeox("status", coord.url, "--token-file", str(token.parent / "wrong"))
    assert refused.returncode == 2 and "--token-file" in refused.stderr


@pytest.mark.slow
def test_the_page_keeps_the_token_in_a_cookie_for_its_reads_only(live_run) -> None:
    coord, _ = live_run
    assert f"status page: {coord.url}/?token={TOKEN}" in coord.log_path.read_text()  # the link, printed once
    assert requests.get(f"{coord.url}/", timeout=10).status_code == 401
    assert requests.get(f"{coord.url}/?token=wrong", timeout=10).status_code == 401
    session = requests.Session()
    page = session.get(f"{coord.url}/?token={TOKEN}", timeout=10)
    assert page.status_code == 200 and page.url == f"{coord.url}/" and 'id="round"' in page.text  # token off the URL
    cookie = next(c for c in session.cookies if c.name == statuspage.cookie_name(int(coord.url.rsplit(":", 1)[1])))
    assert cookie.value == TOKEN and cookie.path == "/" and cookie.has_nonstandard_attr("HttpOnly")
    assert session.get(f"{coord.url}/v1/status", timeout=10).json()["live"]["hosts"]
    assert session.get(f"{coord.url}/static/page.js", timeout=10).status_code == 200
    assert session.get(f"{coord.url}/static/nothing.js", timeout=10).status_code == 404
    assert session.post(f"{coord.url}/v1/join", json={"host": "9"}, timeout=10).status_code == 401  # reads only


@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None, reason=NO_CHROMIUM)
def test_the_status_page_in_a_browser_shows_the_round_the_hosts_and_the_timeline_and_follows_the_run(
        live_run, tmp_path) -> None:
    coord, _ = live_run
    profile = tmp_path / "profile"
    browser = subprocess.Popen([CHROMIUM, *HEADLESS, "--remote-debugging-port=0", f"--user-data-dir={profile}",
                                "about:blank"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        seen = asyncio.run(_browse(browser, f"{coord.url}/?token={TOKEN}", profile, tmp_path / "page.png"))
    finally:
        terminate(browser, 10)
    first, later = seen["first"], seen["later"]
    assert first["hosts"] == ["0", "1"] and later["hosts"] == ["0", "1"]
    assert first["round"] >= 1 and later["round"] > first["round"]  # without a reload: the marker survived
    assert later["marker"] == "kept" and later["first_round"] == first["round"]
    assert "train" in first["phases"] and "sync_prepare" in first["phases"]
    assert first["state"] == "running" and re.fullmatch(r"[0-9a-f]{32}", first["hash"])
    assert (tmp_path / "page.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if SCREENSHOT:
        shutil.copy(tmp_path / "page.png", SCREENSHOT)
    refused = subprocess.run([CHROMIUM, *HEADLESS, f"--user-data-dir={tmp_path / 'fresh'}", "--dump-dom",
                              f"{coord.url}/"], check=False, capture_output=True, text=True, timeout=60)
    assert "missing or wrong bearer token" in refused.stdout and 'id="round"' not in refused.stdout


HEADLESS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
            "--window-size=1200,800"]
READ = """JSON.stringify({round: +document.getElementById("round").textContent,
  first_round: +document.getElementById("first-round").textContent,
  state: document.getElementById("state").textContent, hash: document.getElementById("hash").textContent,
  hosts: [...document.querySelectorAll("#hosts tbody tr")].map((r) => r.dataset.host),
  phases: [...new Set([...document.querySelectorAll("#timeline rect.bar")].map((r) => r.dataset.phase))],
  marker: window.nodeoxTestMarker || null})"""


async def _browse(proc: subprocess.Popen, url: str, profile: Path, screenshot: Path, timeout: float = 60) -> dict:
    """In headless Chromium ``proc`` (its DevTools port in ``profile``), open ``url``, read the page once it shows
    a round, mark the window (a reload would clear the mark), read it again once the round moved on; a screenshot
    of the page at the end."""
    from aiohttp import ClientSession

    port_file = profile / "DevToolsActivePort"
    deadline = time.monotonic() + timeout
    while not port_file.exists() or not port_file.read_text().strip():
        assert time.monotonic() < deadline and proc.poll() is None, "chromium did not start"
        await asyncio.sleep(0.1)
    port = int(port_file.read_text().split()[0])
    async with ClientSession() as http:
        async with http.get(f"http://127.0.0.1:{port}/json/list") as r:
            target = next(t for t in await r.json() if t["type"] == "page")
        async with http.ws_connect(target["webSocketDebuggerUrl"], max_msg_size=0) as ws:
            calls = iter(range(1, 10**6))

            async def call(method: str, **params):
                n = next(calls)
                await ws.send_json({"id": n, "method": method, "params": params})
                while True:
                    msg = json.loads((await ws.receive()).data)
                    if msg.get("id") == n:
                        assert "error" not in msg, msg
                        return msg["result"]

            async def read() -> dict:
                got = await call("Runtime.evaluate", expression=READ, returnByValue=True)
                if "exceptionDetails" in got:  # the page is not there yet (navigating, redirected)
                    return {"hosts": [], "phases": [], "round": 0}
                return json.loads(got["result"]["value"])

            async def until(predicate) -> dict:
                while True:
                    got = await read()
                    if predicate(got):
                        return got
                    assert time.monotonic() < deadline, f"the page did not get there: {got}"
                    await asyncio.sleep(0.2)

            await call("Page.navigate", url=url)
            first = await until(lambda s: s["hosts"] and s["phases"] and s["round"] > 0)
            await call("Runtime.evaluate", expression="window.nodeoxTestMarker = 'kept'")
            later = await until(lambda s: s["round"] > first["round"])
            shot = await call("Page.captureScreenshot", format="png")
            screenshot.write_bytes(base64.b64decode(shot["data"]))
    return {"first": first, "later": later}
