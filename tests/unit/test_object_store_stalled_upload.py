"""A store that stops reading an upload in the middle of a part: the save fails with the
store's error after its retries, instead of waiting forever.

botocore's read timeout starts once a request is sent in full, and aiohttp has no
timeout for sending one, so a store that stopped taking a part's bytes (its receive
window closed, its probes acknowledged) held ``save`` forever: the request was never
sent in full. The store here is moto's server behind a proxy on 127.0.0.1 that forwards
every connection both ways until it has passed on 1 MiB of what the client sent, and
then reads nothing more from that client: small requests go through, the first part of
a 32 MiB tensor stalls.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import shardsafe
from shardsafe.checkpoint.storage import stalled_uploads
from shardsafe.checkpoint.storage.object_storage import s3_defaults
from shardsafe.errors import CheckpointError
from tests.s3server import S3Server

pytest.importorskip("s3fs")
pytestmark = pytest.mark.timeout(120)

PASSED_ON = 1 << 20
"""Bytes of a client's connection the proxy forwards before it stops reading it."""


class StallingProxy:
    """A TCP proxy on 127.0.0.1 to ``upstream`` that stops reading each client's bytes
    once it has forwarded :data:`PASSED_ON` of them (answers still flow back)."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self._upstream = upstream
        self._server = socket.create_server(("127.0.0.1", 0), backlog=64)
        self.endpoint = f"http://127.0.0.1:{self._server.getsockname()[1]}"
        self._done = threading.Event()
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._server.accept()
            except OSError:  # closed: the test is over
                return
            store = socket.create_connection(self._upstream)
            self._sockets += [client, store]
            threading.Thread(
                target=self._pump, args=(client, store, PASSED_ON), daemon=True
            ).start()
            threading.Thread(target=self._pump, args=(store, client, None), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, limit: int | None) -> None:
        passed = 0
        with contextlib.suppress(OSError):
            while limit is None or passed < limit:
                data = source.recv(1 << 16)
                if not data:
                    return
                sink.sendall(data)
                passed += len(data)
            self._done.wait()  # reads nothing more from this client

    def close(self) -> None:
        self._done.set()
        with contextlib.suppress(OSError):
            self._server.shutdown(socket.SHUT_RDWR)
        self._server.close()
        for made in self._sockets:
            made.close()


@pytest.fixture
def proxy(s3_server: S3Server) -> Iterator[StallingProxy]:
    host, port = s3_server.endpoint.removeprefix("http://").split(":")
    made = StallingProxy((host, int(port)))
    try:
        yield made
    finally:
        made.close()


def options(endpoint: str) -> dict[str, Any]:
    return {
        "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
        "config_kwargs": {"read_timeout": 0.5, "connect_timeout": 2},
    }


@pytest.mark.skipif(not stalled_uploads.supported(), reason="aiohttp/aiobotocore too old")
def test_an_upload_the_store_stops_reading_fails_with_the_stores_error(
    s3_server: S3Server, s3_bucket: str, proxy: StallingProxy
) -> None:
    url = f"s3://{s3_bucket}/ckpt"
    with pytest.raises(CheckpointError) as raised:
        shardsafe.save(
            url, {"w": torch.ones(8 << 20)}, storage_options=options(proxy.endpoint), timeout=60
        )
    said = str(raised.value)
    assert said.startswith(
        f"the object store did not answer at {url}/shard-00000-of-00001.safetensors within "
        "its client's timeouts, on any of its retries (EndpointConnectionError: "
    ), said
    assert (
        "(the store stopped taking the bytes sent to it: [Errno 110] Connection timed out)" in said
    )
    assert said.endswith(
        "check the endpoint and the network; if the store is only slow, raise "
        'the timeouts with storage_options={"config_kwargs": {"read_timeout": 120, '
        '"connect_timeout": 30, "retries": {"total_max_attempts": 3}}}'
    )
    assert [k for k in s3_server.keys(s3_bucket) if k.endswith("manifest.json")] == []
    # the same save, straight to the store: nothing about it was the checkpoint's fault
    shardsafe.save(url, {"w": torch.ones(8 << 20)}, storage_options=options(s3_server.endpoint))
    assert torch.equal(shardsafe.load(url, {"w": torch.zeros(8 << 20)})["w"], torch.ones(8 << 20))


def test_s3_connections_bound_unacknowledged_bytes_by_the_longer_timeout() -> None:
    """Every S3 connection is made with ``TCP_USER_TIMEOUT`` set to the longer of the read
    and connect timeouts, and a second (a user's own ``connector_args`` are left as
    given)."""
    if not stalled_uploads.supported():
        assert "connector_args" not in s3_defaults({})["config_kwargs"]
        return
    info = socket.getaddrinfo("127.0.0.1", 80, type=socket.SOCK_STREAM)[0]
    for timeouts, expected in (({"read_timeout": 7}, 11000), ({"read_timeout": 12}, 13000)):
        config = s3_defaults({"config_kwargs": timeouts})["config_kwargs"]
        with config["connector_args"]["socket_factory"](info) as made:
            assert made.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == expected
    mine = {"limit": 4}
    config = s3_defaults({"config_kwargs": {"connector_args": mine}})["config_kwargs"]
    assert config["connector_args"] is mine


@pytest.mark.skipif(not stalled_uploads.supported(), reason="aiohttp/aiobotocore too old")
def test_a_connection_never_made_waits_the_connect_timeout_and_says_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An endpoint whose SYNs go unanswered (a listener with a full accept queue: Linux
    drops the SYN). With the option set to the read timeout alone, the connection failed
    after the read timeout, not the user's longer connect timeout, and was said to be a
    store that "stopped taking the bytes" (found in review)."""
    import s3fs

    listener = socket.create_server(("127.0.0.1", 0), backlog=0)
    port = listener.getsockname()[1]
    fillers = []
    for _ in range(4):
        filler = socket.socket()
        filler.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            filler.connect(("127.0.0.1", port))
        fillers.append(filler)
    try:
        with socket.socket() as probe:
            probe.settimeout(1)
            with contextlib.suppress(OSError):
                probe.connect(("127.0.0.1", port))
                pytest.skip("this kernel accepted a connection past a full accept queue")
        monkeypatch.setattr(s3fs.S3FileSystem, "retries", 1)
        endpoint = f"http://127.0.0.1:{port}"
        options = {
            "key": "k",
            "secret": "s",
            "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
            "config_kwargs": {
                "connect_timeout": 3,
                "read_timeout": 0.5,
                "retries": {"total_max_attempts": 1},
            },
        }
        with pytest.raises(CheckpointError) as raised:
            shardsafe.save("s3://bucket/ckpt", {"w": torch.ones(2)}, storage_options=options)
    finally:
        for filler in fillers:
            filler.close()
        listener.close()
    said = str(raised.value)
    assert "(ConnectTimeoutError: Connect timeout on endpoint URL: " in said, said
    assert "stopped taking the bytes" not in said
