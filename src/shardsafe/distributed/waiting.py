"""Waiting for a key of the store without a wait that times out in torch.

A TCPStore ``wait`` that runs out of time makes torch log two ``[c10d] waitForInput ...
timed out`` warnings to stderr, which no Python setting silences (the C++ log level is
read once, when torch is imported). They came exactly when a user most needs to read
what shardsafe says: a rank missing or dead, just before shardsafe's own message, and
every few seconds while a rank waited for a dead rank 0. So a wait with a deadline sets
an alarm instead: a timer that, when the time is up, *creates* the key from another
connection (``ring``), which ends the wait like any other writer would. The caller then
tells an alarm from the real thing by the key's value. The store wait itself keeps a
backstop timeout (:data:`BACKSTOP_S` later), reached only if the alarm could not reach
the store.

Stores that cannot block (the dict-backed stores of unit tests) are polled instead.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any

POLL_S = 0.005
"""Between two looks at a store that cannot block on a key."""
BACKSTOP_S = 30.0
"""How long after its deadline a wait gives up by itself, should its alarm have failed."""


def block(
    store: Any,
    key: str,
    timeout: float,
    alarm: Any = None,
    ring: Callable[[], Any] | None = None,
) -> bool:
    """Wait until ``key`` exists (True) or ``timeout`` seconds pass (False).

    With ``alarm``, a second connection to the same store (never one this thread may be
    blocked on), the time running out *creates* the key through it, by ``ring`` (default:
    ``add(key, 0)``, for counters) and the wait returns True: the caller reads the key's
    value to tell an alarm from the event it waited for.
    """
    if not getattr(store, "can_wait", hasattr(store, "wait")):
        return poll(store, key, timeout)
    if alarm is None:
        return bool(store.wait([key], timeout))
    timer = threading.Timer(max(timeout, 0.0), _rung, (ring or (lambda: alarm.add(key, 0)),))
    timer.daemon = True
    timer.name = "shardsafe-alarm"
    timer.start()
    try:
        return bool(store.wait([key], timeout + BACKSTOP_S))
    finally:
        timer.cancel()


def poll(store: Any, key: str, timeout: float) -> bool:
    """Look for ``key`` every few milliseconds until it exists (True) or ``timeout``
    seconds pass (False): for stores that cannot block, and for short, rare waits."""
    deadline = time.monotonic() + timeout
    while not store.check([key]):
        if time.monotonic() > deadline:
            return False
        time.sleep(POLL_S)
    return True


def _rung(ring: Callable[[], Any]) -> None:
    with contextlib.suppress(Exception):  # the store is gone: the wait's own error says so
        ring()
