"""Store connections of this process's own, for blocking waits.

A TCPStore client serves one request at a time: a rank blocked in ``wait`` on the
default store's client would hold up every other user of that client (its heartbeat,
torch's own ``new_group``, a background save). So a coordinator waits on a clone of the
default store (a second connection to the same server) that nobody else uses while it
holds it. Connections are kept and handed to later operations: a process opens one per
operation it runs at the same time, not one per save (each would hold a socket until
garbage-collected). Connecting costs the server about two requests (connect and
validate), counted in ``store_requests`` as ``connect``.
"""

from __future__ import annotations

import threading
from typing import Any

from .store_requests import count

_LOCK = threading.Lock()
_FREE: dict[int, tuple[Any, list[Any]]] = {}
"""id(store) -> (store, its free connections); the store is kept so its id stays its own."""


def acquire(store: Any) -> Any:
    """A connection to ``store``'s server for the caller alone, or ``store`` itself where it
    cannot be cloned (HashStore, FileStore, the dict-backed stores of unit tests)."""
    with _LOCK:
        _, free = _FREE.get(id(store), (store, []))
        if free:
            return free.pop()
    try:
        clone = store.clone()
    except (AttributeError, RuntimeError):
        return store
    count("connect", 2)
    return clone


def release(store: Any, connection: Any) -> None:
    """Hand back a connection from :func:`acquire` (of ``store``) for a later operation."""
    if connection is store:
        return
    with _LOCK:
        _FREE.setdefault(id(store), (store, []))[1].append(connection)
