"""Telling a dead rank from a slow one: a counter every rank bumps once a second.

A rank that is SIGKILLed or dies of OOM mid-save stops beating; whoever watches notices
within ``dead_after`` seconds instead of waiting out a phase's timeout.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

BEAT_S = 1.0
DEAD_AFTER_S = 15.0
"""A rank whose heartbeat has not moved for this long is declared dead."""


class Heartbeat:
    """This rank's beat, and a watch on the others' (in the store under ``beat/<rank>``)."""

    def __init__(self, store: Any, rank: int, world_size: int, dead_after: float) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        self.dead_after = dead_after
        self._seen: dict[int, tuple[int, float]] = {}
        self._stop: threading.Event | None = None

    def start(self) -> None:
        self._stop = threading.Event()
        threading.Thread(
            target=self._beat, args=(self._stop,), daemon=True, name="shardsafe-heartbeat"
        ).start()

    def stop(self) -> None:
        if self._stop is not None:
            self._stop.set()
            self._stop = None

    @property
    def running(self) -> bool:
        return self._stop is not None

    def _beat(self, stop: threading.Event) -> None:
        key = f"beat/{self.rank}"
        try:
            while not stop.wait(BEAT_S):
                self.store.add(key, 1)
        except Exception:  # the store is gone: the waiting side reports that
            return

    def dead(self, now: float, skip: Callable[[int], bool]) -> list[int]:
        """Other ranks (but those ``skip`` names) whose beat has not moved for too long."""
        dead = []
        for r in range(self.world_size):
            if r == self.rank or skip(r):
                continue
            beats = int(self.store.add(f"beat/{r}", 0))
            last, since = self._seen.get(r, (-1, now))
            if beats != last:
                self._seen[r] = (beats, now)
            elif now - since > self.dead_after:
                dead.append(r)
        return dead
