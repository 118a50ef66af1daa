"""When a phase's payloads leave the store.

Every rank reads a phase's payloads right after the phase (``agreement.read_payloads``),
so a rank's payload keys may go once every rank has moved on: when the *next* phase
has been posted by every rank (each posts only after reading). At close a rank deletes
what it still holds, once rank 0's acknowledgement is done (``lifecycle``). A failed
phase's payloads are never read (every rank raises instead).
"""

from __future__ import annotations

from typing import Any


class Payloads:
    """This rank's payload keys still in the store, and when they may go."""

    def __init__(self) -> None:
        self._unread: list[str] = []
        """This rank's payload of the last agreed phase: other ranks may still read it."""
        self._spent: list[str] = []
        """Keys nobody reads any more: a failed phase's, or an agreed phase's once every
        rank posted the next one."""

    def agreed(self, posted: list[str]) -> None:
        """Every rank has posted the phase (so read everything before it); ``posted``:
        this rank's payload key of it, if any."""
        self._spent += self._unread
        self._unread = posted

    def failed(self, posted: list[str]) -> None:
        """The phase failed: its payloads will not be read."""
        self._spent += posted

    def release(self, store: Any) -> None:
        """Delete the keys nobody reads any more."""
        _delete(store, self._spent)
        self._spent.clear()

    def release_own(self, store: Any) -> None:
        """At close: every key this rank still holds."""
        _delete(store, self._spent + self._unread)
        self._spent, self._unread = [], []


def _delete(store: Any, names: list[str]) -> None:
    for name in names:
        try:
            store.delete_key(name)
        except Exception:  # pragma: no cover - a store without delete support
            return
