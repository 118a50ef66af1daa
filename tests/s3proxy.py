"""An HTTP proxy on 127.0.0.1 in front of the loopback S3 server, for tests of a store
that misbehaves: it forwards every request, but may answer one itself (:attr:`answer`:
an upload acknowledged and dropped) or change an answer's body on its way back
(:attr:`alter`: bytes damaged in transit). Nothing else is contacted.
"""

from __future__ import annotations

import http.client
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from tests.s3server import S3Server

HANG_UP = (0, {}, b"")
"""An :data:`Answer` that closes the connection without a word (a store gone mid-upload)."""
Answer = Callable[[str, str, bytes], "tuple[int, dict[str, str], bytes] | None"]
"""``(method, path, body)`` -> ``(status, headers, body)`` to answer instead
(:data:`HANG_UP` to answer nothing), or None to forward the request."""
Alter = Callable[[str, str, bytes], bytes]
"""``(method, path, body of the store's answer)`` -> the body sent on."""


class S3Proxy(ThreadingHTTPServer):
    """Forwards to ``upstream``, through :attr:`answer` and :attr:`alter`."""

    daemon_threads = True

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.answer: Answer = lambda method, path, body: None
        self.alter: Alter = lambda method, path, body: body
        super().__init__(("127.0.0.1", 0), _Forward)
        self.endpoint = f"http://127.0.0.1:{self.server_address[1]}"

    def options(self) -> dict[str, Any]:
        """``storage_options`` that send a save's or load's requests through the proxy."""
        return {"client_kwargs": {"endpoint_url": self.endpoint, "region_name": "us-east-1"}}


class _Forward(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: S3Proxy

    def log_message(self, *args: Any) -> None:
        pass

    def _reply(self, status: int, headers: list[tuple[str, str]], data: bytes) -> None:
        head = self.command == "HEAD"  # no body: the store's length is the object's
        self.send_response(status)
        for key, value in headers:
            if key.lower() not in ("transfer-encoding", "connection") and (
                head or key.lower() != "content-length"
            ):
                self.send_header(key, value)
        if not head:
            self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if not head:
            self.wfile.write(data)

    def _relay(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        instead = self.server.answer(self.command, self.path, body)
        if instead is HANG_UP:
            self.close_connection = True
            return
        if instead is not None:
            status, headers, data = instead
            self._reply(status, list(headers.items()), data)
            return
        connection = http.client.HTTPConnection(*self.server.upstream, timeout=30)
        try:
            headers = {k: v for k, v in self.headers.items() if k.lower() != "host"}
            connection.request(self.command, self.path, body=body or None, headers=headers)
            answer = connection.getresponse()
            data = self.server.alter(self.command, self.path, answer.read())
            self._reply(answer.status, answer.getheaders(), data)
        finally:
            connection.close()

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _relay


@pytest.fixture
def s3_proxy(s3_server: S3Server) -> Iterator[S3Proxy]:
    host, port = s3_server.endpoint.removeprefix("http://").split(":")
    made = S3Proxy((host, int(port)))
    thread = threading.Thread(target=made.serve_forever, daemon=True)
    thread.start()
    try:
        yield made
    finally:
        made.shutdown()
        made.server_close()
