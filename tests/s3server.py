"""An S3 service for the tests: moto's server in a thread of the test process, on 127.0.0.1 and a free port, started
once per session (the ``s3_server`` fixture, registered in conftest.py). ``s3_url`` gives each test a fresh bucket
and points boto3 at the server (``AWS_ENDPOINT_URL``, test credentials); ``s3_server.env()`` is the same for a
process a test starts (a coordinator).

moto compares and writes a conditional put in two steps with no lock between; S3 does both at once. The server
hands moto one request at a time, so racing ``create()`` calls see S3's rule (exactly one wins)."""

from __future__ import annotations

import functools
import os
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import pytest

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
# what else in the environment or ~/.aws could send boto3 elsewhere, or to other credentials
ELSEWHERE = ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3", "AWS_REGION")
NO_FILES = {"AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
            "AWS_EC2_METADATA_DISABLED": "true"}


class OneAtATime:
    """A WSGI app that lets one request at a time into ``app``."""

    def __init__(self, app: Callable) -> None:
        self.app = app
        self.lock = threading.Lock()

    def __call__(self, environ: dict, start_response: Callable) -> Iterable[bytes]:
        with self.lock:
            return list(self.app(environ, start_response))


class S3Server:
    """moto's S3 (and the rest of its services) on ``self.endpoint``."""

    def __init__(self) -> None:
        from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
        from werkzeug.serving import make_server

        class QuietHandler(MotoRequestHandler):
            """moto's request handler without werkzeug's line per request on stderr (errors still show)."""

            def log_request(self, *args: Any, **kwargs: Any) -> None:
                pass

        app = OneAtATime(DomainDispatcherApplication(create_backend_app))
        self.server = make_server("127.0.0.1", 0, app, threaded=True, request_handler=QuietHandler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_port}"
        self.thread = threading.Thread(target=self.server.serve_forever, name="s3-server", daemon=True)
        self.thread.start()

    def env(self, endpoint: str | None = None) -> dict[str, str]:
        """The variables that send boto3 to this server with its test credentials (``endpoint``: another address,
        such as a proxy in front of it)."""
        return {"AWS_ENDPOINT_URL": endpoint or self.endpoint, **CREDENTIALS, **NO_FILES}

    def process_env(self) -> dict[str, str]:
        """This process's environment, sent to this server: ``subprocess.Popen(..., env=s3_server.process_env())``."""
        return {**{k: v for k, v in os.environ.items() if k not in ELSEWHERE}, **self.env()}

    @functools.cached_property
    def client(self) -> Any:
        """A client of this server (boto3's clients are thread-safe: one serves every test)."""
        import boto3

        return boto3.session.Session().client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                                              aws_access_key_id="testing", aws_secret_access_key="testing")

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


def use(server: S3Server, monkeypatch: pytest.MonkeyPatch, endpoint: str | None = None) -> None:
    """Point this process's boto3 at ``server`` (or ``endpoint``) for the length of a test."""
    for name in ELSEWHERE:
        monkeypatch.delenv(name, raising=False)
    for name, value in server.env(endpoint).items():
        monkeypatch.setenv(name, value)


def new_bucket(server: S3Server) -> str:
    """A fresh, empty bucket's name."""
    name = f"nodeox-{uuid.uuid4().hex[:16]}"
    server.client.create_bucket(Bucket=name)
    return name


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    server = S3Server()
    yield server
    server.stop()


@pytest.fixture
def s3_url(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> str:
    """``s3://<fresh bucket>/run`` on the session's server, with boto3 pointed at it."""
    use(s3_server, monkeypatch)
    return f"s3://{new_bucket(s3_server)}/run"
