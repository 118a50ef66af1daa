"""Counting the requests shardsafe makes of the process group's store, and its own clients.

Every rank's coordinator talks to one key-value store (the TCPStore rank 0 or torchrun's
agent hosts), so that store's load is the sum of every rank's requests. Each process
counts its own here; a benchmark or test sums the counts of all ranks to see what the
store served during one save or load (issue 17: it must stay O(ranks)).

``get`` and ``multi_get`` count as two: the TCPStore client sends a WAIT for the keys
before the GET. A ``wait`` that times out counts as two as well (WAIT, CANCEL_WAIT).
"""

from __future__ import annotations

import threading
from collections import Counter
from datetime import timedelta
from typing import Any

_LOCK = threading.Lock()
_COUNTS: Counter[str] = Counter()
_WIRE = {"get": 2, "multi_get": 2}


def store_requests() -> dict[str, int]:
    """This process's store requests so far, by operation (and ``"total"``)."""
    with _LOCK:
        counts = dict(_COUNTS)
    counts["total"] = sum(counts.values())
    return counts


def reset_store_requests() -> None:
    with _LOCK:
        _COUNTS.clear()


def count(op: str, n: int = 1) -> None:
    with _LOCK:
        _COUNTS[op] += n


class CountingStore:
    """A store that counts each request it forwards; the calls the coordinator makes."""

    def __init__(self, store: Any) -> None:
        self.inner = store

    def add(self, key: str, n: int) -> int:
        count("add")
        return int(self.inner.add(key, n))

    def set(self, key: str, value: str) -> None:
        count("set")
        self.inner.set(key, value)

    def get(self, key: str) -> bytes:
        count("get", _WIRE["get"])
        return bytes(self.inner.get(key))

    def check(self, keys: list[str]) -> bool:
        count("check")
        return bool(self.inner.check(keys))

    def delete_key(self, key: str) -> bool:
        count("delete_key")
        return bool(self.inner.delete_key(key))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        """All of ``keys`` in one request (one GET per key where the store has no
        ``multi_get``, as the dict-backed test stores)."""
        if not hasattr(self.inner, "multi_get"):
            return [self.get(k) for k in keys]
        count("multi_get", _WIRE["multi_get"])
        return [bytes(v) for v in self.inner.multi_get(keys)]

    def multi_set(self, keys: list[str], values: list[str]) -> None:
        if not hasattr(self.inner, "multi_set"):
            for k, v in zip(keys, values):
                self.set(k, v)
            return
        count("multi_set")
        self.inner.multi_set(keys, values)

    @property
    def can_wait(self) -> bool:
        return hasattr(self.inner, "wait")

    def wait(self, keys: list[str], timeout: float) -> bool:
        """Block until every key exists (True) or ``timeout`` seconds pass (False)."""
        count("wait")
        try:
            self.inner.wait(keys, timedelta(seconds=max(timeout, 0.001)))
        except RuntimeError as e:
            if "timeout" not in str(e).lower() or "wait" not in str(e).lower():
                raise  # the store is gone, not slow
            count("wait")  # the client's CANCEL_WAIT
            return False
        return True
