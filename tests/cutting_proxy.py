"""An HTTP proxy on loopback, in front of the S3 server, that cuts responses short.

A store, a proxy or a load balancer that drops the connection mid-body sends the headers
of a whole object (its Content-Length) and then fewer bytes: this forwards every request
to the S3 server unchanged and, for the GETs whose path ends with one of ``cut``, sends
the response's headers as they are, then half of its body, then closes the connection.
It counts the GETs it cut, so a test sees how often the reader tried; with ``times``,
it cuts only the first ``times`` of them (a connection that fails, then recovers). With
``fail=True`` it answers those GETs with S3's ``500 InternalError`` instead of cutting
them (a store that fails).
"""

from __future__ import annotations

import http.client
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade"}


class CuttingProxy:
    def __init__(
        self, upstream: str, cut: tuple[str, ...], times: int | None = None, fail: bool = False
    ) -> None:
        self.upstream = urlsplit(upstream)
        self.cut, self.times, self.fail = cut, times, fail
        self.cut_count = 0
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _forward(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                upstream = http.client.HTTPConnection(
                    proxy.upstream.hostname or "127.0.0.1", proxy.upstream.port, timeout=30
                )
                try:
                    upstream.request(self.command, self.path, body, dict(self.headers))
                    answer = upstream.getresponse()
                    data = answer.read()
                finally:
                    upstream.close()
                cutting = self.command == "GET" and urlsplit(self.path).path.endswith(proxy.cut)
                with proxy._lock:
                    cutting = cutting and (proxy.times is None or proxy.cut_count < proxy.times)
                    proxy.cut_count += cutting and len(data) > 1
                if cutting and proxy.fail:
                    self._internal_error()
                    return
                self.send_response(answer.status, answer.reason)
                head = self.command == "HEAD"  # its Content-Length is the object's
                for name, value in answer.getheaders():
                    if name.lower() not in HOP_BY_HOP and (
                        head or name.lower() != "content-length"
                    ):
                        self.send_header(name, value)
                if not head:
                    self.send_header("Content-Length", str(len(data)))
                if cutting:
                    self.send_header("Connection", "close")
                self.end_headers()
                if cutting and len(data) > 1:
                    self.wfile.write(data[: len(data) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    return
                self.wfile.write(data)

            def _internal_error(self) -> None:
                body = (
                    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>InternalError</Code>'
                    b"<Message>We encountered an internal error. Please try again.</Message>"
                    b"</Error>"
                )
                self.send_response(500, "Internal Server Error")
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _forward

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> CuttingProxy:
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()


@contextmanager
def cutting_proxy(
    upstream: str, cut: tuple[str, ...], times: int | None = None, fail: bool = False
) -> Iterator[CuttingProxy]:
    with CuttingProxy(upstream, cut, times, fail) as proxy:
        yield proxy
