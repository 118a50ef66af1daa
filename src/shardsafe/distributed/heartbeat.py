"""Telling a dead rank from a slow one: a counter every rank bumps every few seconds.

A rank that is SIGKILLed or dies of OOM mid-save stops beating; whoever watches notices
within ``dead_after`` seconds instead of waiting out a phase's timeout.

Who watches whom keeps rank 0's store linear in the number of ranks: rank 0 watches
every rank (one ``multi_get`` a second), every other rank watches rank 0 alone (one
request every ``WATCH_OTHERS_S``). Beating and watching run on a thread, so a rank busy
writing still beats, and rank 0 notices a dead rank even while it is not waiting.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from . import store_keys as keys

BEAT_S = 1.0
"""How often the heartbeat thread wakes (to beat or to watch)."""
BEATS_EVERY_S = 3.0
"""How often a rank bumps its counter: five beats per ``DEAD_AFTER_S``."""
WATCH_OTHERS_S = 3.0
"""How often a rank other than 0 looks at rank 0's counter."""
DEAD_AFTER_S = 15.0
"""A rank whose heartbeat has not moved for this long is declared dead."""


class Heartbeat:
    """This rank's beat (in the store under ``beat/<rank>``), and a watch on ``watch``'s
    (default: every other rank)."""

    def __init__(
        self,
        store: Any,
        rank: int,
        world_size: int,
        dead_after: float,
        watch: Sequence[int] | None = None,
    ) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        self.dead_after = dead_after
        self.watch = [r for r in range(world_size) if r != rank] if watch is None else list(watch)
        self._seen: dict[int, tuple[int, float]] = {}
        self._stop: threading.Event | None = None
        self._thread: threading.Thread | None = None

    def beat(self) -> None:
        self.store.add(keys.beat(self.rank), 1)

    def start(
        self,
        on_dead: Callable[[list[int]], None] | None = None,
        skip: Callable[[int], bool] = lambda r: False,
    ) -> None:
        """Beat on a thread; also watch, calling ``on_dead`` (once) with the ranks that
        died (but those ``skip`` names)."""
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run,
            args=(self._stop, on_dead, skip),
            daemon=True,
            name="shardsafe-heartbeat",
        )
        self._thread.start()

    def stop(self, wait: bool = False) -> None:
        """Stop beating and watching; with ``wait``, return only once the thread has made
        its last request (within milliseconds: it sleeps on the stop event), so that the
        keys it uses can be deleted without it creating them again (or, rank 0's watch,
        blocking on them)."""
        if self._stop is not None:
            self._stop.set()
            self._stop = None
        thread = self._thread
        if wait and thread is not None and thread is not threading.current_thread():
            thread.join(timeout=BEAT_S + 1.0)

    @property
    def running(self) -> bool:
        return self._stop is not None

    def _run(
        self,
        stop: threading.Event,
        on_dead: Callable[[list[int]], None] | None,
        skip: Callable[[int], bool],
    ) -> None:
        # Five beats per dead_after at least, so that a short dead_after (tests) never
        # declares a live rank dead.
        beat_every = max(min(BEATS_EVERY_S, self.dead_after / 5), 0.05)
        tick = min(BEAT_S, beat_every)
        watch_every = tick if self.rank == 0 else max(tick, min(WATCH_OTHERS_S, beat_every))
        last_beat = last_watch = time.monotonic()
        try:
            while not stop.wait(tick):
                now = time.monotonic()
                if now >= last_beat + beat_every - tick / 2:
                    self.beat()
                    last_beat = now
                if on_dead is None or now < last_watch + watch_every - tick / 2:
                    continue
                last_watch = now
                dead = self.dead(now, skip)
                if dead:
                    on_dead(dead)
                    on_dead = None
        except Exception:  # the store is gone: the waiting side reports that
            return

    def dead(self, now: float, skip: Callable[[int], bool]) -> list[int]:
        """Watched ranks (but those ``skip`` names) whose beat has not moved for too long.

        ``skip`` is asked only about ranks that look dead, so it may be costly.
        """
        beats = self._beats()
        dead = []
        for r, count in beats.items():
            last, since = self._seen.get(r, (-1, now))
            if count != last:
                self._seen[r] = (count, now)
            elif now - since > self.dead_after and not skip(r):
                dead.append(r)
        return dead

    def _beats(self) -> dict[int, int]:
        beats = [keys.beat(r) for r in self.watch]
        if len(beats) > 1 and hasattr(self.store, "multi_get"):
            # Every watched rank beat once before entering (Coordinator.enter), so every
            # key exists and multi_get does not block.
            return {r: int(v) for r, v in zip(self.watch, self.store.multi_get(beats))}
        return {r: int(self.store.add(k, 0)) for r, k in zip(self.watch, beats)}
