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
  its message, on every rank, within milliseconds;
* data-moving collectives (the consolidated gather) only start after every rank has
  agreed that it holds its data, so they cannot be entered by only some ranks.

The store serves O(ranks) requests per phase, not O(ranks²) (issue 17): ranks do not
poll. Each blocks (on a connection of its own, ``clients``) on the phase's ``wake`` key,
which the last rank to post, a failing rank, or a watcher that saw a rank die bumps; the
value says which. No wait is left to time out in torch (which would print its own
warnings ahead of shardsafe's message): when the time is up, an alarm creates the key
(``waiting.py``). With ``only_rank0_reads`` only rank 0 reads the payloads; with
``decide`` rank 0 alone turns them into one part per rank (the save plan) and each rank
reads its own part. Only rank 0 watches every rank's heartbeat; the others watch rank 0.

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
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from ..errors import CheckpointError
from . import clients, waiting
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
from .store_requests import CountingStore

_ACK_TIMEOUT_S = 30.0
_LATE = json.dumps({"late": True})
"""What an alarm writes into a decision this rank waited for too long (see _part)."""
REPORTS_READ = 8
"""How many failing ranks' reports a rank reads to agree on an error (see _failures)."""
AGREE_WAIT_S = 1.0
"""How long a rank woken by a failure waits for every rank to post (see _agreed_error)."""

ALL_POSTED = 1
FAILED = 1 << 20
DEAD = 1 << 40
"""What bumped a phase's ``wake`` counter: the last rank to post adds ``ALL_POSTED``, each
failing rank ``FAILED`` (before it counts itself as posted, so a value showing every rank
posted shows every failure too), a watcher that saw a rank die ``DEAD``."""

Decide = Callable[[list[Any]], list[Any]]
"""Rank 0's decision over every rank's payload: one JSON-able part per rank."""


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
    """What a rank posts in a phase block, and (after it) what every rank posted, or
    with ``decide``, this rank's part of rank 0's decision."""

    payload: Any = None
    payloads: list[Any] = field(default_factory=list)
    part: Any = None


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
        self._beat_store: Any = None
        """The heartbeat's connection: never blocked by this operation's waits."""
        self._own_keys: list[str] = []
        self._heartbeat: Heartbeat | None = None
        self._withdrawn = False
        self._entered = False
        self._current = str(Phase.ENTRY)
        self._last_posted: str | None = None
        self._dead: list[int] = []
        # The path as every rank spells it, not made absolute: ranks on different nodes
        # may run in different working directories, and a URL is no local path.
        self._tag = f"{operation}:{path if '://' in path else os.path.normpath(path)}"
        self._shared: Any = None
        self._connection: Any = None
        self._lost = False
        """The store failed us: this connection is not handed on."""
        self._alarm: Any = None
        """A connection other than the one this rank blocks on, for the alarms that end
        its waits (``waiting.block``); ``None`` where there is only one."""
        self._awaiting: str | None = None
        """The key of rank 0's decision while this rank waits for it (see _part)."""
        if group is not None:
            self._store = self._beat_store = CountingStore(group[2])
        elif self.world_size > 1:
            prefix = f"shardsafe/{self._tag}/{CALLS.next(self._tag)}"
            self._shared = default_store()
            self._connection = clients.acquire(self._shared)
            prefixed = dist.distributed_c10d.PrefixStore
            self._store = CountingStore(prefixed(prefix, self._connection))
            self._beat_store = CountingStore(prefixed(prefix, self._shared))
            if self._connection is not self._shared:
                self._alarm = self._beat_store

    # -- the operation's lifetime

    def enter(self, entry_timeout: float) -> None:
        """Wait until every rank has called the same operation; name the ones that did not.

        From then on this rank beats a heartbeat until :meth:`close`.
        """
        try:
            if self._store is not None:
                # The first beat, before arriving: rank 0's watch reads every rank's beat in
                # one multi_get, which must not block on a key that does not exist yet.
                # Guarded: if rank 0 (which hosts the store) died between two saves, this
                # is the first request to find it gone, and must say so, not raise torch's
                # "Connection reset by peer".
                store = self._beat_store
                self._guarded(str(Phase.ENTRY), lambda: store.add(f"beat/{self.rank}", 1))
            self.exchange(Phase.ENTRY, None, None, timeout=entry_timeout)
        except BaseException:
            self._give_back()
            raise
        if self._store is not None and not self._withdrawn:
            self._entered = True
            watch = None if self.rank == 0 else [0]
            beat = Heartbeat(self._beat_store, self.rank, self.world_size, self.dead_after, watch)
            beat.start(self._publish_dead, self._has_posted_current)
            self._heartbeat = beat

    def close(self) -> None:
        """Rank 0 stays until the others have seen the last outcome; stop the heartbeat.

        Call when the operation ends, however it ends.
        """
        if self._entered:
            self._entered = False
            # Once the store is gone there is nobody to acknowledge to: each request would
            # only fail, and torch would log each failure with a C++ stack.
            with contextlib.suppress(Exception):  # the error being raised matters more
                if not self._lost:
                    self._acknowledge()
                    self.release()
        if self._heartbeat is not None:
            self._heartbeat.stop()
            self._heartbeat = None
        self._give_back()

    def _give_back(self) -> None:
        """Hand this operation's store connection to the next one (once)."""
        if self._connection is not None and not self._lost:
            clients.release(self._shared, self._connection)
        self._connection = None

    @contextlib.contextmanager
    def phase(
        self, name: Phase, *, only_rank0_reads: bool = False, decide: Decide | None = None
    ) -> Iterator[PhaseOutcome]:
        """A block whose outcome (its ``payload``, or the exception it raised) is agreed on
        every rank when it ends: then ``payloads`` holds every rank's payload, or every
        rank raises the same :class:`CheckpointError`. See :meth:`exchange`.

        With ``decide``, rank 0 alone reads the payloads and calls ``decide`` on them;
        every rank's ``part`` is then its element of the result (an exception in
        ``decide`` is rank 0's error, raised on every rank).
        """
        self._current = str(name)
        outcome = PhaseOutcome()
        only_rank0_reads = only_rank0_reads or decide is not None
        try:
            yield outcome
        except Exception as error:
            self.exchange(name, None, error, only_rank0_reads=only_rank0_reads)
            raise  # pragma: no cover - exchange always raises for a failed rank
        outcome.payloads = self.exchange(
            name, outcome.payload, None, only_rank0_reads=only_rank0_reads
        )
        if decide is not None:
            step = str(name)
            outcome.part = self._guarded(step, lambda: self._decide(step, outcome, decide))

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
        self._current = str(phase)
        wait = self.timeout if timeout is None else timeout
        skip_reading = only_rank0_reads and self.rank != 0
        payloads: list[Any] = self._guarded(
            str(phase),
            lambda: self._exchange(str(phase), payload, error, wait, skip_reading),
            error,
        )
        return payloads

    def _guarded(self, phase: str, step: Callable[[], Any], error: Any = None) -> Any:
        """Run ``step``; a store that went away becomes a :class:`CheckpointError`."""
        try:
            return step()
        except CheckpointError:
            raise
        except (RuntimeError, OSError) as lost:  # the store itself is gone
            self._lost = True
            if self._heartbeat is not None:  # its next beat would fail too, logged by torch
                self._heartbeat.stop()
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
            slot = store.add(f"{phase}/failing", 1)  # see _failures
            if slot <= REPORTS_READ:
                store.set(f"{phase}/failing/{slot}", str(self.rank))
            store.add(f"{phase}/failed", 1)
            store.add(f"{phase}/wake", FAILED)
        elif payload is not None:
            store.set(f"{phase}/ok/{self.rank}", json.dumps(payload))
        else:  # nothing to read: one key per rank, overwritten phase after phase
            store.set(f"progress/{self.rank}", phase)
        if store.add(f"{phase}/posted", 1) == self.world_size:
            store.add(f"{phase}/wake", ALL_POSTED)
        self._last_posted = phase
        own = [f"{phase}/ok/{self.rank}"] if payload is not None else []
        try:
            self._wait(phase, timeout, error, check_first=False)
        except CheckpointError:
            self._own_keys += own
            raise
        # Every rank has posted this phase, so every rank has read the earlier payloads.
        self.release()
        self._own_keys += own
        if payload is None or skip_reading:
            return [None] * self.world_size
        keys = [f"{phase}/ok/{r}" for r in range(self.world_size)]
        return [json.loads(raw) for raw in store.multi_get(keys)]

    def _wait(
        self, phase: str, timeout: float, own_error: BaseException | None, check_first: bool = True
    ) -> None:
        """Return once every rank has posted ``phase``; raise the agreed error if one failed,
        a rank died, or some did not post within ``timeout``."""
        deadline = time.monotonic() + timeout
        if check_first and self._settled(phase, own_error):
            return
        woke = self._woken(f"{phase}/wake", deadline)
        if woke // FAILED % (DEAD // FAILED):
            raise self._agreed_error(phase) from own_error
        if woke % FAILED:
            return
        if woke:
            raise self._dead_error(phase, json.loads(self._store.get("dead")))
        if self._settled(phase, own_error):
            return  # the last rank arrived just as the wait ran out
        missing = [r for r in range(self.world_size) if not self._posted(phase, r)]
        if phase == Phase.ENTRY.value and not self._withdraw():
            return
        raise CheckpointError(
            missing_message(self.operation, phase, missing, timeout, self.rank, self.world_size)
        )

    def _woken(self, key: str, deadline: float) -> int:
        """The counter ``key`` once something bumps it, or 0 when ``deadline`` passes.

        An alarm creates the key at 0: this rank's own when its time is up, or, the key
        being every rank's, that of a rank whose time ran out first (a missing rank, a
        retried entry). A rank whose own time is not up then looks at the key every so
        often instead of blocking: only ever while some rank is missing or stuck.
        """
        left = deadline - time.monotonic()
        if left <= 0 or not self._block(key, left):
            return 0
        pause = waiting.POLL_S
        while True:
            woke = int(self._store.add(key, 0))
            left = deadline - time.monotonic()
            if woke or left <= 0:
                return woke
            time.sleep(min(pause, left))
            pause = min(2 * pause, 0.25)

    def _settled(self, phase: str, own_error: BaseException | None) -> bool:
        """Whether every rank has posted ``phase``; raise the agreed error if one failed."""
        # `posted` before `failed`: a failing rank bumps `failed` first, so once all
        # have posted, any failure is already visible to the read that follows.
        everyone = self._store.add(f"{phase}/posted", 0) >= self.world_size
        if self._store.add(f"{phase}/failed", 0) > 0:
            raise self._agreed_error(phase) from own_error
        return bool(everyone)

    def _block(self, key: str, timeout: float, ring: Callable[[], Any] | None = None) -> bool:
        """Wait until ``key`` exists (True) or ``timeout`` seconds pass (False, or True
        after an alarm created the key: see ``waiting.block``)."""
        return waiting.block(self._store, key, timeout, self._alarm, ring)

    def _decide(self, phase: str, outcome: PhaseOutcome, decide: Decide) -> Any:
        """Rank 0 decides from every payload and posts each rank its part; the others
        wait for theirs (watching rank 0 meanwhile)."""
        if self._store is None:
            try:
                return decide(outcome.payloads)[0]
            except Exception as e:
                raise as_checkpoint_error(e) from e
        keys = [f"{phase}/part/{r}" for r in range(1, self.world_size)]
        if self.rank == 0:
            try:
                parts = decide(outcome.payloads)
            except Exception as e:
                report = {"type": error_type(e), "message": error_message(e)}
                self._store.multi_set(keys, [json.dumps({"error": report})] * len(keys))
                failure = RankFailure(0, report["type"], report["message"])
                raise agreed_error([failure], self.operation) from e
            self._store.multi_set(keys, [json.dumps({"ok": part}) for part in parts[1:]])
            return parts[0]
        raw = self._part(phase, keys[self.rank - 1])
        if "error" in raw:
            failure = RankFailure(0, raw["error"]["type"], raw["error"]["message"])
            raise agreed_error([failure], self.operation)
        return raw["ok"]

    def _part(self, phase: str, key: str) -> dict[str, Any]:
        """Rank 0's decision for this rank, from ``key``: ``{"ok": part}`` or ``{"error":
        report}``. Rank 0's death (this rank's heartbeat writes ``{"dead": ranks}`` into
        the key, see _publish_dead) or the phase's timeout (an alarm writes ``_LATE``) are
        raised, without a wait that torch would report as timed out."""
        self._awaiting = key
        try:
            arrived = not self._dead and self._block(
                key, self.timeout, ring=lambda: self._alarm.set(key, _LATE)
            )
        finally:
            self._awaiting = None
        raw: dict[str, Any] = {}
        if arrived:
            raw = json.loads(self._store.get(key))
            self._store.delete_key(key)
        if "ok" in raw or "error" in raw:
            return raw
        if self._dead or "dead" in raw:
            raise self._dead_error(phase, self._dead or raw["dead"])
        raise CheckpointError(
            missing_message(self.operation, phase, [0], self.timeout, self.rank, self.world_size)
        )

    def _acknowledge(self) -> None:
        """Rank 0 stays until every rank that posted the last phase has seen its outcome.

        Rank 0 usually hosts the store: if it returned (and its program exited) while
        another rank was still reading, that rank would crash on a dead socket instead
        of finishing the checkpoint it just agreed on. A rank that died is not waited for.
        """
        store = self._store
        if self.rank != 0:
            if store.add("closed", 1) == self.world_size - 1:
                store.add("closed_all", 1)
            return
        deadline = time.monotonic() + _ACK_TIMEOUT_S
        last = self._last_posted or str(Phase.ENTRY)
        exists = False
        while True:
            posted = int(store.add(f"{last}/posted", 0))
            if int(store.add("closed", 0)) >= posted - 1 or self._dead:
                return
            now = time.monotonic()
            if now > deadline:
                return
            if self._heartbeat is not None and self._heartbeat.dead(now, lambda r: False):
                return  # a dead rank never acknowledges; its own operation reports it
            if exists:  # bumped or created by the alarm, yet not all closed: look again
                time.sleep(min(deadline - now, BEAT_S / 4))
            else:  # the usual case: the last rank to close bumps closed_all at once
                exists = self._block("closed_all", min(deadline - now, BEAT_S))

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
        self._store.delete_key(f"progress/{self.rank}")
        CALLS.take_back(self._tag)
        self._withdrawn = True
        return True

    # -- dead ranks

    def _publish_dead(self, dead: list[int]) -> None:
        """The heartbeat saw ``dead`` die: wake every rank waiting in any phase."""
        self._dead = dead
        store = self._beat_store
        store.set("dead", json.dumps(dead))
        awaiting = self._awaiting
        if awaiting is not None:  # waiting for rank 0's decision: end that wait (_part)
            store.set(awaiting, json.dumps({"dead": dead}))
        for phase in Phase:
            store.add(f"{phase}/wake", DEAD)

    def _has_posted_current(self, rank: int) -> bool:
        """A rank that posted the phase under way may have finished and stopped beating;
        but not rank 0 while this rank waits for its decision (it has not finished)."""
        if self._awaiting is not None:
            return False
        return self._posted(self._current, rank, self._beat_store)

    def _dead_error(self, phase: str, dead: list[int]) -> CheckpointError:
        what = self.aftermath.get(Phase(phase), self.aftermath.get(None, ""))
        message = dead_message(self.operation, phase, dead, self.dead_after, self.rank)
        return CheckpointError(f"{message} {what}".rstrip())

    def _check_heartbeats(self, phase: str, now: float) -> None:
        """Raise if a watched rank that has not posted ``phase`` stopped beating long ago."""
        assert self._heartbeat is not None
        dead = self._heartbeat.dead(now, lambda r: self._posted(phase, r))
        if dead:
            raise self._dead_error(phase, dead)

    def _posted(self, phase: str, rank: int, store: Any = None) -> bool:
        store = self._store if store is None else store
        keys = [f"{phase}/ok/{rank}", f"{phase}/error/{rank}"]
        if any(store.check([k]) for k in keys):
            return True
        progress = f"progress/{rank}"
        return bool(store.check([progress])) and store.get(progress) == phase.encode()

    def _failures(self, phase: str) -> list[RankFailure]:
        """The reports of the first ranks to fail ``phase`` (at most
        :data:`REPORTS_READ`), in the order they failed.

        Each failing rank takes a numbered slot and writes its rank there; a reader reads
        only the first :data:`REPORTS_READ` slots, so agreeing on an error costs every rank
        O(1) requests even when every rank fails (a full disk): O(ranks) in all, not
        O(ranks^2). The first report, the one whose rank, class and message every rank
        raises, is slot 1's: the same on every rank however late the others fail. A
        report is posted before its rank counts as failed, so a reader that saw the count
        finds it (slot 1's writer, if still writing, is waited for a moment).
        """
        store = self._store
        slots = min(int(store.add(f"{phase}/failing", 0)), REPORTS_READ)
        keys = [f"{phase}/failing/{i}" for i in range(1, slots + 1)]
        if store.add(f"{phase}/posted", 0) >= self.world_size:
            # Every rank that took a slot has written it: two multi_gets, nothing waits.
            ranks = [int(raw) for raw in store.multi_get(keys)] if keys else []
            reports = store.multi_get([f"{phase}/error/{r}" for r in ranks]) if ranks else []
        else:  # a rank may be between taking its slot and writing it
            if keys:  # short and rare: a poll, with no store wait to time out in torch
                waiting.poll(store, keys[0], AGREE_WAIT_S)
            ranks = [int(store.get(key)) for key in keys if store.check([key])]
            reports = [store.get(f"{phase}/error/{r}") for r in ranks]
        failures = []
        for r, raw in zip(ranks, reports):
            report = json.loads(raw)
            failures.append(RankFailure(r, report["type"], report["message"]))
        return failures

    def _agreed_error(self, phase: str) -> CheckpointError:
        """The error every rank raises for a failed ``phase``.

        Several ranks may fail the same phase (a full disk); a rank woken by the first
        failure waits a moment (:data:`AGREE_WAIT_S`) for every rank to post, so that
        every rank reads the same reports and raises the same message."""
        pause, settle = 0.001, time.monotonic() + AGREE_WAIT_S
        while self._store.add(f"{phase}/posted", 0) < self.world_size:
            if time.monotonic() > settle:
                break  # a rank is slow or dead: agree on what has been posted
            time.sleep(pause)
            pause = min(2 * pause, 0.05)
        deadline = time.monotonic() + _ACK_TIMEOUT_S
        failures = self._failures(phase)
        while not failures and time.monotonic() < deadline:
            time.sleep(waiting.POLL_S)  # only if every rank read about is still writing its slot
            failures = self._failures(phase)
        if not failures:
            return CheckpointError(f"{self.operation} failed on some rank during '{phase}'")
        total = int(self._store.add(f"{phase}/failed", 0))
        return agreed_error(failures, self.operation, total=total)

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
