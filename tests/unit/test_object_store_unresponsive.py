"""An S3 endpoint that accepts connections and never answers, and one that refuses the
credentials: each is a ``CheckpointError`` naming the URL, never a hang or a raw error.

Found in review: with botocore's 5 attempts inside s3fs's 5 tries, each waiting out a
read timeout, a save to a silent endpoint did not fail for many minutes (``save(...,
timeout=5)`` bounds ranks waiting for each other, not a request), and the error was
botocore's ``ReadTimeoutError``; with wrong credentials, ``verify``, ``inspect`` and
``read_manifest`` raised s3fs's raw ``PermissionError``, naming no URL.

The silent endpoint is a TCP server on 127.0.0.1 that accepts and never reads or
writes; its timeouts are lowered through ``storage_options`` so that a test takes
seconds, while the attempts are the defaults. The refusing store is moto's server with
its authentication turned on, in a fresh interpreter (moto's settings are global).
"""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import shardsafe
from shardsafe.checkpoint.storage.object_storage import (
    S3_ATTEMPTS,
    S3_CONNECT_TIMEOUT,
    S3_READ_TIMEOUT,
    FsspecStorage,
)
from shardsafe.errors import CheckpointError
from tests.harness import run_ranks

pytest.importorskip("s3fs")
pytestmark = pytest.mark.timeout(180)

DOCS = Path(__file__).resolve().parents[2] / "docs" / "object-storage.md"
S3FS_TRIES = 5
"""s3fs's own tries of each call (its ``retries``), around botocore's attempts."""
READ_TIMEOUT = 0.25
"""The silent endpoint's lowered read timeout: 10 attempts of it and their backoff."""


class SilentEndpoint:
    """A TCP server on 127.0.0.1 that accepts every connection and never answers."""

    def __init__(self) -> None:
        self._server = socket.create_server(("127.0.0.1", 0), backlog=100)
        self.endpoint = f"http://127.0.0.1:{self._server.getsockname()[1]}"
        self.connections: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                connection, _ = self._server.accept()
            except OSError:  # closed: the test is over
                return
            self.connections.append(connection)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._server.shutdown(socket.SHUT_RDWR)  # wakes the accept (close alone does not)
        self._server.close()
        for connection in self.connections:
            connection.close()
        self._thread.join(timeout=5)


@pytest.fixture
def silent() -> Iterator[SilentEndpoint]:
    endpoint = SilentEndpoint()
    try:
        yield endpoint
    finally:
        endpoint.close()


@pytest.fixture(autouse=True)
def no_attempts_configured(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No ``AWS_MAX_ATTEMPTS`` and no AWS config file of this machine: the defaults apply."""
    monkeypatch.delenv("AWS_MAX_ATTEMPTS", raising=False)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))


def options(endpoint: str, **config: Any) -> dict[str, Any]:
    return {
        "key": "k",
        "secret": "s",
        "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
        **({"config_kwargs": config} if config else {}),
    }


def unanswered(url: str, request: str) -> str:
    return (
        f"the object store did not answer at {url} within its client's timeouts, on any of "
        f'its retries (ReadTimeoutError: Read timeout on endpoint URL: "{request}"): check '
        "the endpoint and the network; if the store is only slow, raise the timeouts with "
        'storage_options={"config_kwargs": {"read_timeout": 120, "connect_timeout": 30, '
        '"retries": {"total_max_attempts": 3}}}'
    )


def listing(endpoint: str, prefix: str) -> str:
    quoted = prefix.replace("/", "%2F")
    return f"{endpoint}/bucket?list-type=2&prefix={quoted}%2F&delimiter=%2F&encoding-type=url"


def test_a_save_to_an_endpoint_that_never_answers_fails_in_seconds_naming_it(
    silent: SilentEndpoint,
) -> None:
    started = time.monotonic()
    with pytest.raises(CheckpointError) as caught:
        shardsafe.save(
            "s3://bucket/run/step-1",
            {"w": torch.ones(2)},
            timeout=5,
            storage_options=options(silent.endpoint, read_timeout=READ_TIMEOUT),
        )
    took = time.monotonic() - started
    assert str(caught.value) == unanswered(
        "s3://bucket/run/step-1", listing(silent.endpoint, "run/step-1")
    )
    # Every try waited its read timeout (a lower bound, which load cannot break); how many
    # tries there were is counted, not timed (the old defaults made 25 of 15 s each).
    assert took >= S3FS_TRIES * S3_ATTEMPTS * READ_TIMEOUT, took
    assert len(silent.connections) == S3FS_TRIES * S3_ATTEMPTS


@pytest.mark.parametrize("call", ["load", "verify", "inspect", "read_manifest", "latest"])
def test_every_entry_point_names_an_endpoint_that_never_answers(
    silent: SilentEndpoint, call: str
) -> None:
    # One botocore attempt per s3fs try: the message is the point here (the save's test
    # counts the default attempts), and half the attempts take half the time.
    opts = options(silent.endpoint, read_timeout=READ_TIMEOUT, retries={"total_max_attempts": 1})
    step = "s3://bucket/run/step-1"
    calls = {
        "load": lambda: shardsafe.load(step, {"w": torch.zeros(2)}, storage_options=opts),
        "verify": lambda: shardsafe.verify(step, storage_options=opts),
        "inspect": lambda: shardsafe.inspect(step, storage_options=opts),
        "read_manifest": lambda: shardsafe.read_manifest(step, storage_options=opts),
        "latest": lambda: shardsafe.CheckpointManager(
            "s3://bucket/run", storage_options=opts
        ).latest(),
    }
    url, prefix = ("s3://bucket/run", "run") if call == "latest" else (step, "run/step-1")
    with pytest.raises(CheckpointError) as caught:
        calls[call]()
    assert str(caught.value) == unanswered(url, listing(silent.endpoint, prefix))


def manager_save(rank: int, world: int, endpoint: str) -> str:
    opts = options(endpoint, read_timeout=READ_TIMEOUT, retries={"total_max_attempts": 1})
    manager = shardsafe.CheckpointManager("s3://bucket/run", storage_options=opts)
    said = "saved"
    try:
        manager.save(1, {"w": torch.ones(2)}, timeout=30)
    except CheckpointError as e:
        said = str(e)
    torch.distributed.barrier()  # rank 0 hosts the process group's store: both have raised
    return said


def test_a_managers_first_save_waits_out_a_silent_endpoint_once_on_every_rank(
    silent: SilentEndpoint,
) -> None:
    """Rank 0's look for older checkpoints before a fresh run's first save waited out
    every timeout, passed over the failure (it is only for a warning), and the save then
    waited them all out again: twice the connections and the time. Now it is the save's
    error, told to the other ranks."""
    said = run_ranks(manager_save, 2, silent.endpoint)
    url = "s3://bucket/run"
    assert said[0] == unanswered(url, listing(silent.endpoint, "run"))
    assert said[1].startswith("save failed on rank 0") and said[1].endswith(said[0]), said[1]
    # Rank 0's look and rank 1's opening of the step directory (which it does once the
    # entry is passed, before it hears of the refusal): 3 x S3FS_TRIES before.
    assert len(silent.connections) == 2 * S3FS_TRIES


def live_config(storage_options: dict[str, Any]) -> tuple[Any, Any, Any, int]:
    """The connect and read timeouts and the retries of the botocore client that the
    filesystem of ``storage_options`` really made, and s3fs's tries."""
    storage = FsspecStorage("s3://bucket/run", storage_options=storage_options)
    storage.fs.connect()  # makes the client; sends nothing
    config = storage.fs.s3.meta.config
    return config.connect_timeout, config.read_timeout, config.retries, storage.fs.retries


def test_the_defaults_are_those_the_docs_state() -> None:
    connect, read, retries, tries = live_config(options("http://127.0.0.1:9"))
    assert (connect, read, retries, tries) == (
        10,
        10,
        {"total_max_attempts": 2, "mode": "legacy"},
        S3FS_TRIES,
    )
    assert (connect, read, retries["total_max_attempts"]) == (
        S3_CONNECT_TIMEOUT,
        S3_READ_TIMEOUT,
        S3_ATTEMPTS,
    )
    docs = " ".join(DOCS.read_text().split())
    stated = (
        f'`{{"connect_timeout": {connect}, "read_timeout": {read}, "retries": '
        f'{{"total_max_attempts": {retries["total_max_attempts"]}}}}}`'
    )
    assert stated in docs
    assert f"{tries} times" in docs
    worst = tries * retries["total_max_attempts"] * read
    times = " \N{MULTIPLICATION SIGN} "
    attempts = retries["total_max_attempts"]
    assert f"after {tries}{times}{attempts}{times}{read} s = {worst} s" in docs


def test_storage_options_and_the_environment_override_the_defaults(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    mine = options("http://127.0.0.1:9", read_timeout=120, retries={"max_attempts": 7})
    assert live_config(mine)[:3] == (10, 120, {"total_max_attempts": 8, "mode": "legacy"})
    mine = options("http://127.0.0.1:9", connect_timeout=30)
    assert live_config(mine)[:2] == (30, 10)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "4")  # botocore's own setting: not overridden
    assert live_config(options("http://127.0.0.1:9"))[2]["total_max_attempts"] == 4


REFUSED = r"""
import json, logging, os, sys
from moto.server import ThreadedMotoServer
logging.getLogger("werkzeug").setLevel(logging.ERROR)
server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
server.start()
host, port = server.get_host_and_port()
os.environ.update({"AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"})
import boto3, torch, shardsafe
boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"]).create_bucket(Bucket="bkt")
manager = shardsafe.CheckpointManager("s3://bkt/run")
manager.save(1, {"w": torch.ones(2)})
manager.close()
from moto import settings
from moto.core.responses import ActionAuthenticatorMixin
settings.INITIAL_NO_AUTH_ACTION_COUNT = 0  # authentication on, from the next request
ActionAuthenticatorMixin.request_count = 0
os.environ.update({"AWS_ACCESS_KEY_ID": "WRONGKEY", "AWS_SECRET_ACCESS_KEY": "wrong"})
step = "s3://bkt/run/step-000000001"
calls = {
    "load": lambda: shardsafe.load(step, {"w": torch.zeros(2)}),
    "inspect": lambda: shardsafe.inspect(step),
    "verify": lambda: shardsafe.verify(step),
    "read_manifest": lambda: shardsafe.read_manifest(step),
    "latest": lambda: shardsafe.CheckpointManager("s3://bkt/run").latest(),
}
said = {}
for name, call in calls.items():
    try:
        call()
        said[name] = "no error"
    except Exception as e:
        said[name] = [type(e).__name__, isinstance(e, shardsafe.CheckpointError), str(e)]
server.stop()
print(json.dumps(said))
"""


def test_wrong_credentials_are_the_stores_refusal_naming_the_url() -> None:
    pytest.importorskip("moto.server")
    done = subprocess.run(
        [sys.executable, "-c", REFUSED], capture_output=True, text=True, timeout=150, check=False
    )
    assert done.returncode == 0, done.stderr
    said = json.loads(done.stdout.splitlines()[-1])
    refused = "PermissionError: The AWS Access Key Id you provided does not exist in our records."
    for name in ("load", "inspect", "verify", "read_manifest"):
        assert said[name] == [
            "CheckpointError",
            True,
            f"the object store failed at s3://bkt/run/step-000000001: {refused}",
        ], (name, said[name])
    assert said["latest"] == [
        "CheckpointError",
        True,
        f"the object store failed at s3://bkt/run: {refused}",
    ]
