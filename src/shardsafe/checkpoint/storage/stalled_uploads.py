"""S3 connections on which bytes sent and never taken by the store time out.

botocore's ``read_timeout`` (:data:`object_storage.S3_READ_TIMEOUT`) covers a store that
does not answer a request once it is sent. It cannot cover an upload the store stops
reading in the middle of a part: aiohttp, s3fs's HTTP client, has no timeout for writing
a request, and TCP keeps probing a peer that advertises a zero window for as long as the
peer acknowledges the probes. A save to such a store (a stuck proxy, a server that stopped
reading its sockets) waited forever; with several ranks, every other rank then failed at
the commit after ``timeout`` while this one hung.

Linux's ``TCP_USER_TIMEOUT`` bounds how long sent bytes may stay unacknowledged, a zero
window included (Linux 5.10 and later): set to the read timeout (or the connect timeout
if longer, and a second: :func:`connector_args`), the connection fails
like any dropped connection, botocore and s3fs retry it, and the save fails with the
store's error after the same number of tries as a silent store's. Bytes that move, however
slowly, are acknowledged and never trip it. Elsewhere (no such option) sockets are plain.

aiohttp takes a ``socket_factory`` from 3.12, and only newer aiobotocore releases pass it
through; with older ones nothing is set here (:func:`supported`).
"""

from __future__ import annotations

import contextlib
import functools
import socket
from typing import Any


def stall_bounded(timeout_s: float, addr_info: tuple[Any, ...]) -> socket.socket:
    """A socket for ``addr_info`` (``getaddrinfo``'s tuple) whose sent bytes may stay
    unacknowledged for at most ``timeout_s`` seconds (aiohttp's ``socket_factory``)."""
    family, kind, proto = addr_info[0], addr_info[1], addr_info[2]
    made = socket.socket(family, kind, proto)
    option = getattr(socket, "TCP_USER_TIMEOUT", None)
    if option is not None and family in (socket.AF_INET, socket.AF_INET6):
        with contextlib.suppress(OSError):  # a kernel without it: the socket as it is
            made.setsockopt(socket.IPPROTO_TCP, option, max(1, int(timeout_s * 1000)))
    return made


@functools.lru_cache(maxsize=1)
def supported() -> bool:
    """Whether this aiohttp and aiobotocore take a ``socket_factory`` (checked once)."""
    try:
        import inspect

        import aiohttp
        from aiobotocore.config import AioConfig  # type: ignore[import-untyped]

        if "socket_factory" not in inspect.signature(aiohttp.TCPConnector).parameters:
            return False
        AioConfig(connector_args={"socket_factory": functools.partial(stall_bounded, 1.0)})
    except Exception:  # not installed, or too old to accept it
        return False
    return True


def connector_args(read_timeout: float, connect_timeout: float) -> dict[str, Any] | None:
    """aiobotocore's ``connector_args`` with stall-bounded sockets, or ``None`` where they
    cannot be had. Keeps aiobotocore's own default keep-alive, which giving
    ``connector_args`` at all would drop.

    The option is set before the socket connects, and Linux applies it to the connection's
    SYNs too: set to the read timeout alone, it cut a longer ``connect_timeout`` short and
    failed a connection never made as a stalled one (found in review). It is the longer of
    the two, plus a second, so that botocore's own connect timeout always comes first."""
    if not supported():
        return None
    from aiobotocore.httpsession import DEFAULT_KEEPALIVE_TIMEOUT  # type: ignore[import-untyped]

    return {
        "keepalive_timeout": DEFAULT_KEEPALIVE_TIMEOUT,
        "socket_factory": functools.partial(
            stall_bounded, max(read_timeout, connect_timeout) + 1.0
        ),
    }
