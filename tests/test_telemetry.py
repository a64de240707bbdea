"""Telemetry never stops training, and what it could not send is said once."""

from __future__ import annotations

import http.server
import logging
import threading

import pytest
import torch
from helpers import TwoOptimizers, data, socket_closed_port
from lightning.pytorch import Trainer

from lightning_nodeox import NodeoxStrategy, PhaseMonitor
from lightning_nodeox.core.hashing import model_hash
from lightning_nodeox.core.phases import PhaseRecord
from lightning_nodeox.core.protocol import Reason, Refusal
from lightning_nodeox.host.clock import ClockOffset
from lightning_nodeox.host.telemetry import TelemetryShipper
from lightning_nodeox.host.tensors import shared_tensors


def test_clock_offset_is_within_half_the_fastest_round_trip() -> None:
    clock = ClockOffset()
    true_offset = 123.456  # the coordinator's clock runs ahead
    for sent, rtt, server_share in [(10.0, 0.30, 0.9), (20.0, 0.02, 0.2), (30.0, 0.15, 0.5)]:
        server_time = sent + rtt * server_share + true_offset
        clock.add(sent, sent + rtt, server_time)
    assert clock.best().rtt == pytest.approx(0.02)
    assert abs(clock.offset - true_offset) <= 0.02 / 2


@pytest.mark.slow
def test_unreachable_telemetry_does_not_stop_training(coordinator, tmp_path, caplog) -> None:
    coord = coordinator(1)
    model = TwoOptimizers()
    with socket_closed_port() as port, caplog.at_level(logging.WARNING):
        trainer = Trainer(
            strategy=NodeoxStrategy(coordinator_url=coord.url, host_id="h", local_steps=3,
                                    telemetry_url=f"http://127.0.0.1:{port}"),
            max_steps=2 * 4, callbacks=[PhaseMonitor()], default_root_dir=tmp_path, enable_progress_bar=False,
            logger=False)
        trainer.fit(model, data())
    published = [e for e in coord.events() if e["phase"] == "sync_prepare"]
    assert [e["round"] for e in published] == [0, 1]  # rounds of 4 steps (2 batches); the last batch closes the final one
    assert model_hash(shared_tensors(model)) == published[-1]["model_hash"]
    assert not [e for e in coord.events() if e["host"] == "h"], "no host record could have arrived"
    warnings = [r.getMessage() for r in caplog.records if "phase records could not be sent" in r.getMessage()]
    assert len(warnings) == 1 and f"127.0.0.1:{port}" in warnings[0]
    assert torch.isfinite(torch.cat([t.view(-1) for _, t in shared_tensors(model)])).all()


class Capture(http.server.BaseHTTPRequestHandler):
    """A telemetry server that keeps the headers of every request it gets."""

    seen: list[dict] = []

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        Capture.seen.append({"path": self.path, **{k.lower(): v for k, v in self.headers.items()}})
        body = b"{}"
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.mark.slow
def test_the_token_and_credential_never_go_to_another_telemetry_address(coordinator, tmp_path) -> None:
    (tmp_path / "token").write_text("tok-123")
    coord = coordinator(1, "--token-file", str(tmp_path / "token"))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Capture)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        trainer = Trainer(
            strategy=NodeoxStrategy(coordinator_url=coord.url, host_id="h", token="tok-123", local_steps=3,
                                    telemetry_url=f"http://127.0.0.1:{server.server_address[1]}"),
            max_steps=2 * 6, default_root_dir=tmp_path, enable_progress_bar=False, logger=False)
        trainer.fit(TwoOptimizers(), data())
    finally:
        server.shutdown()
        thread.join(10)
    assert Capture.seen and all(r["path"] == "/v1/events?host=h" for r in Capture.seen)
    assert not [r for r in Capture.seen if "authorization" in r or "x-nodeox-credential" in r]
    assert trainer.strategy.last_result.complete


class RejoiningClient:
    """Refuses the first batch as sent with a credential a join has just replaced (the relay's second join)."""

    url, host = "http://coordinator", "siteB"

    def __init__(self) -> None:
        self.credential, self.batches = "first", []

    def post_events(self, payload) -> None:
        if self.credential == "first":
            self.credential = "second"  # a join answered while this batch was on its way
            raise Refusal(Reason.FORBIDDEN, "missing or wrong credential for host siteB")
        self.batches.append(len(payload))


def test_a_batch_refused_because_the_host_joined_again_meanwhile_goes_again_with_its_new_credential() -> None:
    client = RejoiningClient()
    shipper = TelemetryShipper(client, type("Clock", (), {"offset": 0.0})(), interval=3600)
    for k in range(4):
        shipper(PhaseRecord(0, "siteB", "train", float(k), float(k) + 1))
    assert shipper.close(timeout=10) == 0
    assert (client.batches, shipper.sent, shipper.dropped) == ([4], 4, 0)
