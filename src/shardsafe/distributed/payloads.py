"""When a phase's payloads leave the store: once every rank has read them, not before.

Every rank reads a phase's payloads right after the phase (``agreement.read_payloads``),
so a rank's payload keys may go once every rank has moved on: when the *next* phase
has been posted by every rank (each posts only after reading), or, for the last phase of
the operation, once every rank has closed (rank 0's acknowledgement, ``lifecycle``). A
rank that deleted its own last payload as soon as it closed could take it from under a
rank still reading it; so the last phase's payloads are deleted by rank 0, after the
acknowledgement, for every rank. A failed phase's payloads are never read (every rank
raises instead) and go when their rank closes.
"""

from __future__ import annotations

from typing import Any

from . import store_keys as keys
from .phases import Phase


class Payloads:
    """This rank's payload keys still in the store, and who deletes them when."""

    def __init__(self) -> None:
        self._unread: list[str] = []
        """This rank's payload of the last agreed phase: other ranks may still read it."""
        self._last: Phase | None = None
        """That phase, if it carried payloads (on every rank, then)."""
        self._spent: list[str] = []
        """Keys nobody reads any more: a failed phase's, or an agreed phase's once every
        rank posted the next one."""

    def agreed(self, phase: Phase, posted: list[str]) -> None:
        """Every rank has posted ``phase`` (so read everything before it); ``posted``:
        this rank's payload key of it, if any."""
        self._spent += self._unread
        self._unread, self._last = posted, (phase if posted else None)

    def failed(self, posted: list[str]) -> None:
        """The phase failed: its payloads will not be read."""
        self._spent += posted

    def release(self, store: Any) -> None:
        """Delete the keys nobody reads any more."""
        _delete(store, self._spent)
        self._spent.clear()

    def release_own(self, store: Any) -> None:
        """Rank 0 when not every rank acknowledged (one died or hangs): its own keys only;
        the others' may still be read."""
        _delete(store, self._spent + self._unread)
        self._spent, self._unread, self._last = [], [], None

    def release_everyones(self, store: Any, world_size: int) -> None:
        """Rank 0, once every rank has closed: every rank's payload of the last agreed
        phase, and its own spent keys."""
        last = [keys.payload(self._last, r) for r in range(world_size)] if self._last else []
        _delete(store, self._spent + last)
        self._spent, self._unread, self._last = [], [], None


def _delete(store: Any, names: list[str]) -> None:
    for name in names:
        try:
            store.delete_key(name)
        except Exception:  # pragma: no cover - a store without delete support
            return
