"""Transport security: TLS end to end, no open bind without a token, and the URL of the socket really bound."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests
import torch
from helpers import MODEL, SPECS, Coordinator, body_bytes, delta_message, expected_after_round, forked, model_file

from lightning_nodeox.coordinator.config import CoordinatorConfig
from lightning_nodeox.coordinator.server import bound_url
from lightning_nodeox.core.hashing import model_hash
from lightning_nodeox.core.protocol import SyncReady, TlsMismatch, Unreachable, Upload
from lightning_nodeox.core.wire import Message
from lightning_nodeox.host.client import HttpClient

TENSORS = [s.as_json() for s in SPECS]


def self_signed(folder: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and localhost, and its key (openssl's command line)."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is needed to make a test certificate")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-keyout", str(key), "-out", str(cert), "-days", "2", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
                   check=True, capture_output=True, timeout=60)
    return cert, key


@pytest.mark.slow
def test_a_round_over_tls_with_the_ca_file_or_the_requests_convention(coordinator, tmp_path, monkeypatch) -> None:
    cert, key = self_signed(tmp_path)
    coord = coordinator(2, "--tls-cert", str(cert), "--tls-key", str(key))
    assert coord.url.startswith("https://127.0.0.1:")
    with pytest.raises(Unreachable, match="CERTIFICATE_VERIFY_FAILED.*NODEOX_CA_FILE"):  # the system does not trust it
        HttpClient(coord.url, host="a", retry_for=0.5).join(TENSORS)
    a = HttpClient(coord.url, host="a", ca_file=str(cert), retry_for=5)  # NODEOX_CA_FILE
    assert a.join(TENSORS).provide_model
    initial = a.put_model(memoryview(model_file()))
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(cert))  # the requests convention
    b = HttpClient(coord.url, host="b", retry_for=5)
    assert b.join(TENSORS).model_hash == initial
    gen = torch.Generator().manual_seed(7)
    deltas = [[torch.randn(t.shape, generator=gen) * 0.01 for _, t in MODEL] for _ in range(2)]
    for client, values, samples in ((a, deltas[0], 8), (b, deltas[1], 8)):
        message = delta_message(values, round_=0, host=client.host, base_hash=initial, samples=samples)
        assert client.post_delta(0, message.view()) is Upload.TAKEN
    reply = b.wait_sync(0)
    assert isinstance(reply, SyncReady)
    expected = expected_after_round([t for _, t in MODEL], [(deltas[0], 8), (deltas[1], 8)])
    expected_hash = model_hash(list(zip([n for n, _ in MODEL], expected)))
    assert Message.parse(body_bytes(reply.body)).meta.model_hash == expected_hash
    assert requests.get(f"{coord.url}/v1/status", verify=str(cert), timeout=10).json()["model_hash"] == expected_hash


def nodeox(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(forked([sys.executable, "-m", "lightning_nodeox", *args]), capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, PYTHONUNBUFFERED="1"))


@pytest.mark.slow
def test_binding_beyond_loopback_without_a_token_is_refused(tmp_path) -> None:
    out = nodeox("coordinator", "--hosts", "1", "--run-dir", str(tmp_path / "run"), "--bind", "0.0.0.0:0")
    assert out.returncode != 0
    assert "--token-file" in out.stderr and "--insecure" in out.stderr, out.stderr
    assert not (tmp_path / "run" / "events.jsonl").exists()


@pytest.mark.slow
def test_insecure_binds_everywhere_and_says_the_address_bound(tmp_path) -> None:
    coord = Coordinator(tmp_path / "run", 1, "--bind", "0.0.0.0:0", "--insecure")
    try:
        assert coord.url.startswith("http://0.0.0.0:") and int(coord.url.rsplit(":", 1)[1]) > 0
        port = coord.url.rsplit(":", 1)[1]
        assert requests.get(f"http://127.0.0.1:{port}/v1/health", timeout=10).json() == {"ok": True}
    finally:
        coord.stop()
    assert f"listening on {coord.url} " in coord.log_path.read_text()


@pytest.mark.slow
def test_an_ipv6_bind_is_printed_in_brackets_and_reachable(tmp_path) -> None:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    coord = Coordinator(tmp_path / "run", 1, "--bind", "[::1]:0")
    try:
        assert coord.url.startswith("http://[::1]:")
        assert requests.get(f"{coord.url}/v1/health", timeout=10).json() == {"ok": True}
    finally:
        coord.stop()


def test_the_url_printed_is_the_socket_bound() -> None:
    assert bound_url("http", "::1", ("::1", 8470, 0, 0)) == "http://[::1]:8470"
    assert bound_url("https", "127.0.0.1", ("127.0.0.1", 40123)) == "https://127.0.0.1:40123"
    assert bound_url("https", "localhost", ("127.0.0.1", 40123)) == "https://localhost:40123"  # as a cert names it
    assert bound_url("http", "0.0.0.0", ("0.0.0.0", 5)) == "http://0.0.0.0:5"


@pytest.mark.parametrize("bind", ["127.0.0.1:0", "localhost:8470", "[::1]:0", "127.0.0.5:1"])
def test_loopback_needs_no_token(bind, tmp_path) -> None:
    assert CoordinatorConfig(hosts=1, run_dir=tmp_path, bind=bind).bind == bind


@pytest.mark.parametrize("bind", ["0.0.0.0:8470", ":8470", "[::]:0", "10.1.2.3:1", "coordinator.example.org:1"])
def test_beyond_loopback_needs_a_token_or_insecure(bind, tmp_path) -> None:
    with pytest.raises(ValueError, match="--token-file F .* or --insecure"):
        CoordinatorConfig(hosts=1, run_dir=tmp_path, bind=bind)
    CoordinatorConfig(hosts=1, run_dir=tmp_path, bind=bind, token="t")
    CoordinatorConfig(hosts=1, run_dir=tmp_path, bind=bind, insecure=True)


def test_tls_needs_a_certificate_and_its_key(tmp_path) -> None:
    (tmp_path / "cert.pem").write_text("x")
    with pytest.raises(ValueError, match="--tls-cert and --tls-key go together"):
        CoordinatorConfig(hosts=1, run_dir=tmp_path, tls_cert=tmp_path / "cert.pem")
    with pytest.raises(ValueError, match="--tls-key .* is not a file"):
        CoordinatorConfig(hosts=1, run_dir=tmp_path, tls_cert=tmp_path / "cert.pem", tls_key=tmp_path / "nope.pem")


HTTPS_HOST = '''
import os, sys, torch
from lightning_nodeox.core.hashing import model_hash
from lightning_nodeox.core.modelfile import model_header
from lightning_nodeox.core.codecs.settings import Q4Settings
from lightning_nodeox.core.specs import spec_of
from lightning_nodeox.core.wire import MessageLayout, Message, MessageMeta
from lightning_nodeox.host.client import HttpClient

url, ca = os.environ["NODEOX_COORDINATOR_URL"], os.environ["NODEOX_CA_FILE"]
assert url.startswith("https://"), url
named = [("w", torch.arange(12.0))]
specs = spec_of(named)
client = HttpClient(url, host=os.environ["NODEOX_HOST_ID"], token=os.environ["NODEOX_TOKEN"], ca_file=ca)
reply = client.join([s.as_json() for s in specs])
digest = model_hash(named)
if reply.provide_model:
    client.put_model(memoryview(model_header(specs, 0, digest) + named[0][1].numpy().tobytes()))
final = Message.allocate(MessageLayout.of(specs, Q4Settings()))
final.buffer.fill_(0x88)
final.scales(0).fill_(0.0)
final.write_header(MessageMeta("delta", 0, client.host, digest, samples=0, final=True))
client.post_delta(0, final.view())
print("sync complete:", client.wait_sync(0).complete)
client.leave()
'''


@pytest.mark.slow
def test_launch_passes_tls_and_the_token_to_its_hosts(tmp_path) -> None:
    cert, key = self_signed(tmp_path)
    (tmp_path / "token").write_text("tok")
    (tmp_path / "host.py").write_text(HTTPS_HOST)
    env = {k: v for k, v in os.environ.items() if k != "NODEOX_CA_FILE"}
    out = subprocess.run([sys.executable, "-m", "lightning_nodeox", "launch", "--hosts", "1", "--run-dir",
                          str(tmp_path / "run"), "--threads", "1", "--token-file", str(tmp_path / "token"),
                          "--tls-cert", str(cert), "--tls-key", str(key), "--elastic", "--",
                          *forked([sys.executable, str(tmp_path / "host.py")])],
                         capture_output=True, text=True, timeout=180, env=dict(env, PYTHONUNBUFFERED="1"))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "[host 0] sync complete: True" in out.stdout
    assert "listening on https://127.0.0.1:" in out.stdout


# -- TLS mistakes are not transient: they fail at once, naming the fix -------------------------------------------------
def refused_at_once(client: HttpClient, match: str) -> str:
    """``client``'s join fails with a TLS mistake within a few seconds (its retry budget is 60 s); the message."""
    start = time.monotonic()
    with pytest.raises(TlsMismatch, match=match) as raised:
        client.join(TENSORS)
    assert time.monotonic() - start < 5, "a TLS mistake was retried"
    return str(raised.value)


@pytest.mark.slow
def test_an_http_url_for_a_tls_coordinator_fails_at_once_naming_https(coordinator, tmp_path) -> None:
    cert, key = self_signed(tmp_path)
    coord = coordinator(1, "--tls-cert", str(cert), "--tls-key", str(key))
    plain = coord.url.replace("https://", "http://")
    message = refused_at_once(HttpClient(plain, host="a", ca_file=str(cert)), "speaks TLS, not plain HTTP")
    assert f"use {coord.url}" in message


@pytest.mark.slow
def test_an_https_url_for_a_plain_coordinator_fails_at_once_naming_http(coordinator) -> None:
    coord = coordinator(1)
    secure = coord.url.replace("http://", "https://")
    message = refused_at_once(HttpClient(secure, host="a"), "speaks plain HTTP, not TLS")
    assert f"use {coord.url}" in message


@pytest.mark.slow
def test_a_coordinator_certificate_the_host_does_not_trust_fails_at_once_naming_the_ca_file(coordinator,
                                                                                            tmp_path) -> None:
    cert, key = self_signed(tmp_path)
    coord = coordinator(1, "--tls-cert", str(cert), "--tls-key", str(key))
    unset = refused_at_once(HttpClient(coord.url, host="a"), "certificate is not trusted")
    assert "NODEOX_CA_FILE is not set" in unset and "set NODEOX_CA_FILE=/path/to/cert.pem" in unset
    (tmp_path / "other").mkdir()
    other, _ = self_signed(tmp_path / "other")  # a certificate, but not the coordinator's
    wrong = refused_at_once(HttpClient(coord.url, host="a", ca_file=str(other)), "certificate is not trusted")
    assert f"NODEOX_CA_FILE={other} does not verify it" in wrong
    (tmp_path / "garbage.pem").write_text("not a certificate\n")
    garbage = refused_at_once(HttpClient(coord.url, host="a", ca_file=str(tmp_path / "garbage.pem")),
                              "cannot be read as a certificate")
    assert "point NODEOX_CA_FILE at the PEM certificate the coordinator serves" in garbage
    assert HttpClient(coord.url, host="a", ca_file=str(cert)).join(TENSORS).provide_model  # the fix works


def test_a_connection_cut_that_is_no_tls_mistake_is_still_retried() -> None:
    """A plain server that closes every connection unanswered looks like an http:// request to a TLS port, but it
    completes no TLS handshake: the host retries (for its budget) instead of blaming the URL's scheme."""
    server = socket.create_server(("127.0.0.1", 0))
    cuts = []

    def cut_every_connection() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            cuts.append(1)
            conn.close()

    threading.Thread(target=cut_every_connection, daemon=True).start()
    url = f"http://127.0.0.1:{server.getsockname()[1]}"
    start = time.monotonic()
    try:
        with pytest.raises(Unreachable, match=f"coordinator at {url} did not answer") as raised:
            HttpClient(url, host="a", retry_for=1.5).join(TENSORS)
    finally:
        server.close()
    assert not isinstance(raised.value, TlsMismatch)
    tries = int(re.search(r"after (\d+) tries", str(raised.value)).group(1))
    assert tries >= 3 and len(cuts) == 2 * tries  # each try, and each try's probe of a TLS handshake, was cut
    assert time.monotonic() - start < 10
