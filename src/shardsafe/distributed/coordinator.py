"""Agreement between ranks during a save or load: a timed entry barrier and phase blocks.

Why the process group's own collectives are not used for this: a collective that one rank
never enters hangs every other rank until the (30 minute) process-group timeout, and a
rank that failed cannot tell the others *why*. Instead ranks meet in the process group's
key-value store (the TCPStore that ``init_process_group`` and ``torchrun`` already
created). Each phase is a block::

    with coord.phase(Phase.WRITE) as phase:
        phase.payload = write_files()      # an exception here is this rank's error
    results = phase.payloads               # every rank's payload, once all have posted

On leaving the block every rank posts "ok" plus its small JSON payload, or its error, and
waits until all have posted or one has failed. So

* a rank that never calls ``save`` is reported by name after ``entry_timeout`` seconds;
* an exception on any rank becomes the same :class:`CheckpointError`, naming that rank and
  its message, on every rank, within a poll interval;
* data-moving collectives (the consolidated gather) only start after every rank has
  agreed that it holds its data, so they cannot be entered by only some ranks.

Once every rank has entered, each runs a :class:`Heartbeat`, so a rank that dies is named
within ``dead_after`` seconds. What a dead rank means for the checkpoint is for the
caller to say (``aftermath``). Keys are namespaced by the operation, the absolute path
and a per-path call number, so a save one rank abandoned is never confused with a later
one.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from ..errors import CheckpointError
from .group import default_store, world
from .heartbeat import BEAT_S, DEAD_AFTER_S, Heartbeat
from .phases import Phase
from .reports import (
    RankFailure,
    agreed_error,
    as_checkpoint_error,
    dead_message,
    error_message,
    error_type,
    missing_message,
)

_POLL_MIN_S = 0.001
_POLL_MAX_S = 0.05
_POLL_S_PER_RANK = 0.0001
_ACK_TIMEOUT_S = 30.0


def _poll_cap(world_size: int) -> float:
    """The longest pause between two polls of the store while waiting for other ranks.

    5 ms on small jobs, so that a rank which waited through a long phase (rank 0 writing
    a consolidated checkpoint) sees its end within 5 ms rather than 50; 0.1 ms a rank on
    large ones, at most 50 ms, so that rank 0's store gets at most ~10,000 polls a second
    however many ranks wait.
    """
    return min(_POLL_MAX_S, max(0.005, world_size * _POLL_S_PER_RANK))


class CallCounter:
    """How many times this process has called each operation on each path.

    Every rank counts its own calls, so the n-th ``save`` of a path meets the n-th on
    every other rank. A call whose entry timed out is taken back, so that retrying it on
    every rank meets in the same place.
    """

    def __init__(self) -> None:
        self._counts: Counter[str] = Counter()

    def next(self, tag: str) -> int:
        self._counts[tag] += 1
        return self._counts[tag]

    def take_back(self, tag: str) -> None:
        self._counts[tag] -= 1


CALLS = CallCounter()


@dataclass
class PhaseOutcome:
    """What a rank posts in a phase block, and (after it) what every rank posted."""

    payload: Any = None
    payloads: list[Any] = field(default_factory=list)


class Coordinator:
    """Agreement between all ranks of the default process group for one operation.

    ``aftermath`` says, per phase (``None``: any other), what a rank dying there means;
    it ends the dead-rank message. ``group`` (rank, world size, store) replaces the
    default process group, for tests.
    """

    def __init__(
        self,
        operation: str,
        path: str,
        *,
        timeout: float,
        dead_after: float = DEAD_AFTER_S,
        aftermath: Mapping[Phase | None, str] | None = None,
        group: tuple[int, int, Any] | None = None,
    ) -> None:
        self.operation = operation
        self.rank, self.world_size = group[:2] if group else world()
        self.timeout = timeout
        self.dead_after = dead_after
        self.aftermath = dict(aftermath or {})
        self._store: Any = None
        self._own_keys: list[str] = []
        self._heartbeat: Heartbeat | None = None
        self._withdrawn = False
        # The path as every rank spells it, not made absolute: ranks on different nodes
        # may run in different working directories, and a URL is no local path.
        self._tag = f"{operation}:{path if '://' in path else os.path.normpath(path)}"
        if group is not None:
            self._store = group[2]
        elif self.world_size > 1:
            prefix = f"shardsafe/{self._tag}/{CALLS.next(self._tag)}"
            self._store = dist.distributed_c10d.PrefixStore(prefix, default_store())

    # -- the operation's lifetime

    def enter(self, entry_timeout: float) -> None:
        """Wait until every rank has called the same operation; name the ones that did not.

        From then on this rank beats a heartbeat until :meth:`close`.
        """
        self.exchange(Phase.ENTRY, None, None, timeout=entry_timeout)
        if self._store is not None and not self._withdrawn:
            self._heartbeat = Heartbeat(self._store, self.rank, self.world_size, self.dead_after)
            self._heartbeat.start()

    def close(self) -> None:
        """Stop the heartbeat; call when the operation ends, however it ends."""
        if self._heartbeat is not None:
            self._heartbeat.stop()

    @contextlib.contextmanager
    def phase(self, name: Phase, *, only_rank0_reads: bool = False) -> Iterator[PhaseOutcome]:
        """A block whose outcome (its ``payload``, or the exception it raised) is agreed on
        every rank when it ends: then ``payloads`` holds every rank's payload, or every
        rank raises the same :class:`CheckpointError`. See :meth:`exchange`."""
        outcome = PhaseOutcome()
        try:
            yield outcome
        except Exception as error:
            self.exchange(name, None, error, only_rank0_reads=only_rank0_reads)
            raise  # pragma: no cover - exchange always raises for a failed rank
        outcome.payloads = self.exchange(
            name, outcome.payload, None, only_rank0_reads=only_rank0_reads
        )

    # -- one exchange

    def exchange(
        self,
        phase: Phase,
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
                raise as_checkpoint_error(error) from error
            return [payload]
        try:
            return self._exchange(
                str(phase),
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
            report = {"type": error_type(error), "message": error_message(error)}
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
        watch = self._heartbeat or Heartbeat(store, self.rank, self.world_size, self.dead_after)
        deadline = time.monotonic() + _ACK_TIMEOUT_S
        pause = _POLL_MIN_S
        next_check = time.monotonic() + BEAT_S
        while store.add(f"{phase}/seen", 0) < store.add(f"{phase}/posted", 0):
            now = time.monotonic()
            if now > deadline:
                return
            if now > next_check:
                if watch.dead(now, lambda r: False):
                    return  # a dead rank never acknowledges; the next phase reports it
                next_check = now + BEAT_S
            time.sleep(pause)
            pause = min(pause * 2, _poll_cap(self.world_size))

    def _wait(self, phase: str, timeout: float, own_error: BaseException | None) -> None:
        store = self._store
        deadline = time.monotonic() + timeout
        pause = _POLL_MIN_S
        next_check = time.monotonic() + BEAT_S
        while True:
            # `posted` before `failed`: a failing rank bumps `failed` first, so once all
            # have posted, any failure is already visible to the read that follows.
            everyone = store.add(f"{phase}/posted", 0) >= self.world_size
            if store.add(f"{phase}/failed", 0) > 0:
                raise agreed_error(self._failures(phase), self.operation) from own_error
            if everyone:
                return
            now = time.monotonic()
            if now > deadline:
                missing = [r for r in range(self.world_size) if not self._posted(phase, r)]
                if phase == Phase.ENTRY.value and not self._withdraw():
                    return  # the last rank arrived just as the wait ran out
                raise CheckpointError(
                    missing_message(
                        self.operation, phase, missing, timeout, self.rank, self.world_size
                    )
                )
            if self._heartbeat is not None and now > next_check:
                self._check_heartbeats(phase, now)
                next_check = now + BEAT_S
            time.sleep(pause)
            pause = min(pause * 2, _poll_cap(self.world_size))

    def _withdraw(self) -> bool:
        """Take back this rank's arrival after the entry wait ran out; False if too late.

        So that a retry of the same call on every rank (the user moved ``save`` out of
        their ``if rank == 0:``) meets in the same namespace as the ranks that never came:
        the arrival is uncounted and this path's call number goes back. If, the instant
        before, the count had reached the world size, everyone has arrived and the
        arrival stands. A rank arriving just after the withdrawal waits out its own
        ``entry_timeout`` and withdraws in turn.
        """
        before = int(self._store.add("entry/posted", -1)) + 1
        if before >= self.world_size:
            self._store.add("entry/posted", 1)
            return False
        self._store.delete_key(f"entry/ok/{self.rank}")
        CALLS.take_back(self._tag)
        self._withdrawn = True
        return True

    def _check_heartbeats(self, phase: str, now: float) -> None:
        """Raise if a rank that has not posted ``phase`` stopped beating long ago."""
        assert self._heartbeat is not None
        dead = self._heartbeat.dead(now, lambda r: self._posted(phase, r))
        if dead:
            what = self.aftermath.get(Phase(phase), self.aftermath.get(None, ""))
            message = dead_message(self.operation, phase, dead, self.dead_after, self.rank)
            raise CheckpointError(f"{message} {what}".rstrip())

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
