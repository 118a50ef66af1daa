"""Coordination of ranks during a save or load: a timed entry barrier and error agreement.

Why the process group's own collectives are not used for this: a collective that one rank
never enters hangs every other rank until the (30 minute) process-group timeout, and a
rank that failed cannot tell the others *why*. shardsafe instead coordinates through the
process group's key-value store (the TCPStore that ``init_process_group`` and ``torchrun``
already created). Each phase of a save or load ends in :meth:`Coordinator.exchange`:
every rank posts "ok" plus a small JSON payload, or its error; every rank polls until all
have posted or one has failed. So

* a rank that never calls ``save`` is reported by name after ``entry_timeout`` seconds;
* an exception on any rank becomes the same :class:`CheckpointError`, naming that rank and
  its message, on every rank, within a poll interval;
* data-moving collectives (the consolidated gather) only start after every rank has
  agreed that it holds its data, so they cannot be entered by only some ranks.

Once every rank has entered, each runs a heartbeat thread (a store counter bumped every
second). A rank that is SIGKILLed or dies of OOM mid-save stops beating; the others
notice within ``dead_after`` seconds and raise naming it, instead of waiting out the
phase timeout.

Keys are namespaced by the operation, the absolute checkpoint path and a per-path call
counter, so a save that one rank abandoned can never be confused with a later one.
"""

from __future__ import annotations

import json
import os
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from .errors import ERROR_CLASSES, CheckpointError

_CALLS: Counter[str] = Counter()
_POLL_MIN_S = 0.001
_POLL_MAX_S = 0.05
_POLL_S_PER_RANK = 0.0001
_ACK_TIMEOUT_S = 30.0
_HEARTBEAT_S = 1.0
DEAD_AFTER_S = 15.0
"""A rank whose heartbeat has not moved for this long is declared dead."""


def _poll_cap(world_size: int) -> float:
    """The longest pause between two polls of the store while waiting for other ranks.

    5 ms on small jobs, so that a rank which waited through a long phase (rank 0 writing
    a consolidated checkpoint) sees its end within 5 ms rather than 50; 0.1 ms a rank on
    large ones, at most 50 ms, so that rank 0's store gets at most ~10,000 polls a second
    however many ranks wait.
    """
    return min(_POLL_MAX_S, max(0.005, world_size * _POLL_S_PER_RANK))


_AFTERMATH = {
    ("save", ""): "Nothing was committed; the previous checkpoint is untouched.",
    ("save", "commit"): (
        "Every rank had written its data, so rank 0 may have committed the checkpoint "
        "anyway: it exists if and only if its manifest.json does."
    ),
    ("load", ""): "Nothing was restored on this rank.",
    ("load", "restore"): (
        "This rank may already have restored some of its objects; load again before using them."
    ),
}
"""What a rank dying in a phase means for the checkpoint, by (operation, phase)."""


@dataclass
class RankFailure:
    """What one rank reported when it failed a phase."""

    rank: int
    error_type: str
    message: str


def world() -> tuple[int, int]:
    """``(rank, world_size)`` of the default process group, ``(0, 1)`` without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class Coordinator:
    """Agreement between all ranks of the default process group for one save or load."""

    def __init__(
        self, operation: str, path: str, *, timeout: float, dead_after: float = DEAD_AFTER_S
    ) -> None:
        self.operation = operation
        self.rank, self.world_size = world()
        self.timeout = timeout
        self.dead_after = dead_after
        self._store: Any = None
        self._own_keys: list[str] = []
        self._beating: threading.Event | None = None
        self._beats: dict[int, tuple[int, float]] = {}
        self._withdrawn = False
        self._tag = f"{operation}:{os.path.abspath(path)}"
        if self.world_size > 1:
            _CALLS[self._tag] += 1
            prefix = f"shardsafe/{self._tag}/{_CALLS[self._tag]}"
            self._store = dist.distributed_c10d.PrefixStore(
                prefix, dist.distributed_c10d._get_default_store()
            )

    def enter(self, entry_timeout: float) -> None:
        """Wait until every rank has called the same operation; name the ones that did not.

        From then on this rank beats a heartbeat until :meth:`close`.
        """
        self.exchange("entry", None, None, timeout=entry_timeout)
        if self._store is not None and not self._withdrawn:
            self._beating = threading.Event()
            threading.Thread(
                target=self._beat, args=(self._beating,), daemon=True, name="shardsafe-heartbeat"
            ).start()

    def close(self) -> None:
        """Stop the heartbeat; call when the operation ends, however it ends."""
        if self._beating is not None:
            self._beating.set()
            self._beating = None

    def _beat(self, stop: threading.Event) -> None:
        key = f"beat/{self.rank}"
        try:
            while not stop.wait(_HEARTBEAT_S):
                self._store.add(key, 1)
        except Exception:  # the store is gone: the waiting side reports that
            return

    def exchange(
        self,
        phase: str,
        payload: Any,
        error: BaseException | None,
        *,
        timeout: float | None = None,
        only_rank0_reads: bool = False,
    ) -> list[Any]:
        """Post this rank's outcome of ``phase``; return every rank's payload, or raise.

        With ``only_rank0_reads`` the payloads are returned on rank 0 alone (``None`` on
        the others), so a phase whose results only rank 0 uses costs O(ranks), not O(ranks²).

        If any rank posted an error, every rank raises the same :class:`CheckpointError`
        subclass naming the failing rank. If some rank does not post within ``timeout``
        seconds, every waiting rank raises naming the missing ranks. A ``None`` payload
        on every rank returns ``[None] * world_size`` without reading the store.
        """
        if self._store is None:
            if error is not None:
                raise _as_checkpoint_error(error) from error
            return [payload]
        try:
            return self._exchange(
                phase,
                payload,
                error,
                self.timeout if timeout is None else timeout,
                only_rank0_reads and self.rank != 0,
            )
        except CheckpointError:
            raise
        except (RuntimeError, OSError) as lost:  # the store itself is gone
            raise CheckpointError(
                f"lost contact with the process group's store during the '{phase}' phase of "
                f"{self.operation} (this is rank {self.rank}): {lost}. Another rank, usually "
                "rank 0 which hosts the store, has probably exited or crashed."
            ) from (error or lost)

    def _exchange(
        self,
        phase: str,
        payload: Any,
        error: BaseException | None,
        timeout: float,
        skip_reading: bool,
    ) -> list[Any]:
        store = self._store
        if error is not None:
            report = {"type": _error_type(error), "message": _error_message(error)}
            store.set(f"{phase}/error/{self.rank}", json.dumps(report))
            store.add(f"{phase}/failed", 1)
        else:
            store.set(f"{phase}/ok/{self.rank}", json.dumps(payload))
        store.add(f"{phase}/posted", 1)
        outcome: CheckpointError | None = None
        payloads: list[Any] = [None] * self.world_size
        try:
            self._wait(phase, timeout, error)
            # Every rank has posted this phase, so every rank has read the earlier payloads.
            self.release()
            if payload is not None and not skip_reading:
                payloads = [
                    json.loads(store.get(f"{phase}/ok/{r}")) for r in range(self.world_size)
                ]
        except CheckpointError as e:
            outcome = e
        self._own_keys.append(f"{phase}/ok/{self.rank}")
        if not self._withdrawn:
            self._acknowledge(phase)
        if outcome is not None:
            raise outcome from error
        return payloads

    def _acknowledge(self, phase: str) -> None:
        """Rank 0 stays until every rank that posted has seen the outcome.

        Rank 0 usually hosts the store: if it returned (and its program exited) while
        another rank was still polling, that rank would crash on a dead socket instead
        of finishing the checkpoint it just agreed on. A rank whose heartbeat has stopped
        (or, after the entry phase, never started) for ``dead_after`` seconds is not
        waited for: it has died, and the next phase reports it.
        """
        store = self._store
        store.add(f"{phase}/seen", 1)
        if self.rank != 0:
            return
        deadline = time.monotonic() + _ACK_TIMEOUT_S
        pause = _POLL_MIN_S
        next_check = time.monotonic() + _HEARTBEAT_S
        while store.add(f"{phase}/seen", 0) < store.add(f"{phase}/posted", 0):
            now = time.monotonic()
            if now > deadline:
                return
            if now > next_check:
                if self._dead_ranks(now, lambda r: False):
                    return  # a dead rank never acknowledges; the next phase reports it
                next_check = now + _HEARTBEAT_S
            time.sleep(pause)
            pause = min(pause * 2, _poll_cap(self.world_size))

    def _wait(self, phase: str, timeout: float, own_error: BaseException | None) -> None:
        store = self._store
        deadline = time.monotonic() + timeout
        pause = _POLL_MIN_S
        next_check = time.monotonic() + _HEARTBEAT_S
        while True:
            # `posted` before `failed`: a failing rank bumps `failed` first, so once all
            # have posted, any failure is already visible to the read that follows.
            everyone = store.add(f"{phase}/posted", 0) >= self.world_size
            if store.add(f"{phase}/failed", 0) > 0:
                failures = self._failures(phase)
                raise _agreed_error(failures, self.operation, phase) from own_error
            if everyone:
                return
            now = time.monotonic()
            if now > deadline:
                missing = [r for r in range(self.world_size) if not self._posted(phase, r)]
                if phase == "entry" and not self._withdraw():
                    return  # the last rank arrived just as the wait ran out
                raise CheckpointError(self._missing_message(phase, missing, timeout))
            if self._beating is not None and now > next_check:
                self._check_heartbeats(phase, now)
                next_check = now + _HEARTBEAT_S
            time.sleep(pause)
            pause = min(pause * 2, _poll_cap(self.world_size))

    def _withdraw(self) -> bool:
        """Take back this rank's arrival after the entry wait ran out; False if too late.

        So that a retry of the same call on every rank (the user moved ``save`` out of
        their ``if rank == 0:``) meets in the same namespace as the ranks that never came:
        the arrival is uncounted and this path's call counter goes back. If, the instant
        before, the count had reached the world size, everyone has arrived and the
        arrival stands. A rank arriving just after the withdrawal waits out its own
        ``entry_timeout`` and withdraws in turn.
        """
        before = int(self._store.add("entry/posted", -1)) + 1
        if before >= self.world_size:
            self._store.add("entry/posted", 1)
            return False
        self._store.delete_key(f"entry/ok/{self.rank}")
        _CALLS[self._tag] -= 1
        self._withdrawn = True
        return True

    def _check_heartbeats(self, phase: str, now: float) -> None:
        """Raise if a rank that has not posted ``phase`` stopped beating long ago."""
        dead = self._dead_ranks(now, lambda r: self._posted(phase, r))
        if dead:
            ranks = ", ".join(map(str, dead))
            raise CheckpointError(
                f"rank(s) {ranks} stopped responding during the '{phase}' phase of "
                f"{self.operation} (no heartbeat for {self.dead_after:g}s; this is rank "
                f"{self.rank}): they have probably died (killed, out of memory). "
                + _AFTERMATH.get((self.operation, phase), _AFTERMATH[(self.operation, "")])
            )

    def _dead_ranks(self, now: float, skip: Callable[[int], bool]) -> list[int]:
        """Other ranks (but those ``skip`` names) whose heartbeat stopped long ago."""
        dead = []
        for r in range(self.world_size):
            if r == self.rank or skip(r):
                continue
            beats = int(self._store.add(f"beat/{r}", 0))
            last, since = self._beats.get(r, (-1, now))
            if beats != last:
                self._beats[r] = (beats, now)
            elif now - since > self.dead_after:
                dead.append(r)
        return dead

    def _posted(self, phase: str, rank: int) -> bool:
        keys = [f"{phase}/ok/{rank}", f"{phase}/error/{rank}"]
        return any(self._store.check([k]) for k in keys)

    def _failures(self, phase: str) -> list[RankFailure]:
        failures = []
        for r in range(self.world_size):
            key = f"{phase}/error/{r}"
            if self._store.check([key]):
                report = json.loads(self._store.get(key))
                failures.append(RankFailure(r, report["type"], report["message"]))
        return failures

    def _missing_message(self, phase: str, missing: list[int], timeout: float) -> str:
        ranks = ", ".join(map(str, missing))
        if phase == "entry":
            return (
                f"shardsafe.{self.operation} must be called on all ranks, but rank(s) {ranks} "
                f"never arrived within entry_timeout={timeout:g}s (this is rank {self.rank} of "
                f"{self.world_size}). Call {self.operation} on every rank, outside any "
                "`if rank == 0:` block, with the same path. Nothing was written."
            )
        return (
            f"rank(s) {ranks} did not finish the '{phase}' phase of {self.operation} within "
            f"{timeout:g}s (this is rank {self.rank}); they may have died or hung. "
            "The previous checkpoint is untouched."
        )

    def release(self) -> None:
        """Delete this rank's payload keys of phases every rank has moved past."""
        if self._store is None:
            return
        for key in self._own_keys:
            try:
                self._store.delete_key(key)
            except Exception:  # pragma: no cover - a store without delete support
                return
        self._own_keys.clear()


def _error_type(error: BaseException) -> str:
    return type(error).__name__ if isinstance(error, CheckpointError) else "CheckpointError"


def _error_message(error: BaseException) -> str:
    if isinstance(error, CheckpointError):
        return str(error)
    last = traceback.extract_tb(error.__traceback__)[-1:] if error.__traceback__ else []
    where = f" (at {last[0].filename}:{last[0].lineno})" if last else ""
    return f"{type(error).__name__}: {error}{where}"


def _as_checkpoint_error(error: BaseException) -> CheckpointError:
    if isinstance(error, CheckpointError):
        return error
    return CheckpointError(_error_message(error))


def _agreed_error(failures: list[RankFailure], operation: str, phase: str) -> CheckpointError:
    first = failures[0]
    cls = ERROR_CLASSES.get(first.error_type, CheckpointError)
    others = ""
    if len(failures) > 1:
        others = f" (rank(s) {', '.join(str(f.rank) for f in failures[1:])} failed too)"
    return cls(f"{operation} failed on rank {first.rank}{others}: {first.message}")
