"""A store that answers a data object's upload with ``200`` and keeps nothing: retention
must not then delete the last checkpoint that loads.

The manifest is committed last, but the store's word is all a save has that the objects
before it are there. When it lied, the new step was unloadable, ``keep_last=1`` deleted
step 1, and a restart found nothing to load (found in review). Retention now checks that
the new step's data objects are listed at their recorded sizes before it deletes an
older checkpoint. The store is moto's server behind an HTTP proxy on 127.0.0.1 that
forwards every request but the upload of step 2's data object, which it answers ``200``.
"""

from __future__ import annotations

import hashlib
import http.client
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
import torch

from shardsafe import CheckpointManager
from tests.s3server import S3Server

pytest.importorskip("s3fs")
pytestmark = pytest.mark.timeout(120)

DROPPED = "/step-000000002/shard-"
"""The uploads the proxy answers and drops: step 2's data object."""


class LyingProxy(ThreadingHTTPServer):
    """Forwards every request to ``upstream`` but a ``PUT`` of a :data:`DROPPED` object,
    which it answers ``200`` with the ETag S3 would give, storing nothing."""

    daemon_threads = True

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        super().__init__(("127.0.0.1", 0), _Forward)
        self.endpoint = f"http://127.0.0.1:{self.server_address[1]}"


class _Forward(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: LyingProxy

    def log_message(self, *args: Any) -> None:
        pass

    def _relay(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        if self.command == "PUT" and DROPPED in self.path:
            self.send_response(200)
            self.send_header("ETag", f'"{hashlib.md5(body).hexdigest()}"')
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        connection = http.client.HTTPConnection(*self.server.upstream, timeout=30)
        headers = {k: v for k, v in self.headers.items() if k.lower() != "host"}
        connection.request(self.command, self.path, body=body or None, headers=headers)
        answer = connection.getresponse()
        data = answer.read()
        self.send_response(answer.status)
        for key, value in answer.getheaders():
            if key.lower() not in ("transfer-encoding", "content-length", "connection"):
                self.send_header(key, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)
        connection.close()

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _relay


@pytest.fixture
def proxy(s3_server: S3Server) -> Iterator[LyingProxy]:
    host, port = s3_server.endpoint.removeprefix("http://").split(":")
    made = LyingProxy((host, int(port)))
    thread = threading.Thread(target=made.serve_forever, daemon=True)
    thread.start()
    try:
        yield made
    finally:
        made.shutdown()
        made.server_close()


def test_retention_keeps_the_last_loadable_step_when_the_store_dropped_a_new_object(
    s3_server: S3Server, s3_bucket: str, proxy: LyingProxy
) -> None:
    root = f"s3://{s3_bucket}/run"
    options = {"client_kwargs": {"endpoint_url": proxy.endpoint, "region_name": "us-east-1"}}
    manager = CheckpointManager(root, keep_last=1, storage_options=options)
    manager.save(1, {"w": torch.full((4,), 1.0)})
    with pytest.warns(UserWarning) as warned:
        manager.save(2, {"w": torch.full((4,), 2.0)})
    manager.close()
    said = [str(w.message) for w in warned if "retention" in str(w.message)]
    assert said == [
        f"shardsafe: retention deleted no checkpoint: the new one, {root}/step-000000002, is "
        "not whole in the store (data file shard-00000-of-00001.safetensors is missing), "
        "which said it had stored it; the older ones are what a restart can load"
    ]
    assert s3_server.keys(s3_bucket, "run/step-000000001/") == [
        "run/step-000000001/manifest.json",
        "run/step-000000001/shard-00000-of-00001.safetensors",
    ]
    state = {"w": torch.zeros(4)}
    with pytest.warns(UserWarning, match="passing over .*step-000000002: data"):
        CheckpointManager(root).load_latest(state)  # straight to the store
    assert torch.equal(state["w"], torch.full((4,), 1.0))
