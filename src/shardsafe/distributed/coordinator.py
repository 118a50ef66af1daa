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

:class:`Coordinator` is the face the engine sees; the work is done by job, each in a
module of its own: ``store_keys`` (every key in the store), ``agreement`` (publishing an
outcome, waiting, the error every rank raises, rank 0's decisions), ``lifecycle``
(connections, the entry, heartbeats, withdrawal, the acknowledgement at close),
``payloads`` (a payload stays until every rank has read it) and ``link`` (what they
share). With ``only_rank0_reads`` only rank 0 reads the payloads; with ``decide`` rank 0
alone turns them into one part per rank (the save plan), each rank reading its own.

Once every rank has entered, each runs a :class:`Heartbeat`, so a rank that dies is named
within ``dead_after`` seconds; what that means for the checkpoint, the caller says.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import CheckpointError
from . import agreement
from . import store_keys as keys
from .agreement import Decide
from .group import world
from .heartbeat import DEAD_AFTER_S, Heartbeat
from .lifecycle import Lifecycle
from .link import Link
from .payloads import Payloads
from .phases import Phase
from .reports import as_checkpoint_error

__all__ = ["Coordinator", "Decide", "PhaseOutcome"]


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
    it ends the dead-rank message. ``called_as``: what the user calls, named to a rank
    that waited for one that never came, where the operation is not a function of theirs
    (``Link.called_as``). ``group`` (rank, world size, store) replaces the default
    process group, for tests.
    """

    def __init__(
        self,
        operation: str,
        path: str,
        *,
        timeout: float,
        dead_after: float = DEAD_AFTER_S,
        aftermath: Mapping[Phase | None, str] | None = None,
        called_as: str | None = None,
        group: tuple[int, int, Any] | None = None,
    ) -> None:
        rank, world_size = group[:2] if group else world()
        self._link = Link(operation, rank, world_size, timeout, dead_after, dict(aftermath or {}))
        self._link.called_as = called_as
        self._life = Lifecycle(self._link, keys.tag(operation, path), group[2] if group else None)
        self._payloads = Payloads()

    # -- who this is (the link's, shared by every part; tests set some of them)

    @property
    def operation(self) -> str:
        return self._link.operation

    @property
    def rank(self) -> int:
        return self._link.rank

    @rank.setter
    def rank(self, rank: int) -> None:
        self._link.rank = rank

    @property
    def world_size(self) -> int:
        return self._link.world_size

    @world_size.setter
    def world_size(self, world_size: int) -> None:
        self._link.world_size = world_size

    @property
    def timeout(self) -> float:
        return self._link.timeout

    @property
    def dead_after(self) -> float:
        return self._link.dead_after

    @property
    def _store(self) -> Any:
        return self._link.store

    @_store.setter
    def _store(self, store: Any) -> None:
        self._link.store = store

    @property
    def _heartbeat(self) -> Heartbeat | None:
        return self._link.heartbeat

    @_heartbeat.setter
    def _heartbeat(self, heartbeat: Heartbeat | None) -> None:
        self._link.heartbeat = heartbeat

    # -- the operation's lifetime

    def enter(self, entry_timeout: float) -> None:
        """Wait until every rank has called the same operation; name the ones that did not.

        From then on this rank beats a heartbeat until :meth:`close`.
        """
        try:
            if self._link.store is not None:
                self._life.first_beat()
            self.exchange(Phase.ENTRY, None, None, timeout=entry_timeout)
        except BaseException as e:
            if not isinstance(e, Exception) and self._arrival_stands():
                # Ctrl-C in the entry's wait: this rank's arrival counts, so the others
                # go on into the first phase. Told nothing, they waited there for its
                # heartbeat, never started, and then said it had died.
                self._life.start_heartbeat()
                self.abandon(e)
                self.close()
            self._life.give_back()
            raise
        self._life.start_heartbeat()

    def _arrival_stands(self) -> bool:
        """Whether this rank's arrival at the entry was posted and not taken back."""
        link = self._link
        return (
            link.store is not None
            and Phase.ENTRY in link.posted_phases
            and not (self._life.withdrawn)
        )

    def refuse(self, error: Exception, entry_timeout: float) -> None:
        """This rank refuses the operation before it begins (``error``: a usage error,
        such as an empty ``state``, that may be this rank's alone): meet the others at
        the entry all the same and tell them, so that they raise it at once, naming this
        rank, instead of waiting ``entry_timeout`` for a rank that never comes and then
        saying it did not call. Never raises: the caller raises ``error``."""
        with contextlib.suppress(Exception):  # the others gone too: ``error`` is the news
            self.enter(entry_timeout)
            self.abandon(error)
        self.close()

    def close(self) -> None:
        """Rank 0 stays until the others have seen the last outcome; stop the heartbeat;
        the last phase's payloads go once every rank has read them.

        Call when the operation ends, however it ends.
        """
        if self._life.entered:
            self._life.entered = False
            if self.rank != 0:  # no beat may come after rank 0 deleted the key (forget)
                self._life.stop_heartbeat(wait=True)
            # Once the store is gone there is nobody to acknowledge to: each request would
            # only fail, and torch would log each failure with a C++ stack.
            with contextlib.suppress(Exception):  # the error being raised matters more
                if not self._link.lost:
                    everyone_closed = self._life.acknowledge(self._link.interrupted)
                    self._life.stop_heartbeat(wait=True)
                    self._release_at_close(everyone_closed)
        self._life.stop_heartbeat()
        self._life.give_back()

    def _release_at_close(self, everyone_closed: bool) -> None:
        """The keys this rank may delete now: rank 0, once every rank has closed, every
        rank's last payloads; another rank, only what nobody reads any more."""
        store = self._link.store
        if self.rank != 0:
            self._payloads.release(store)
        elif everyone_closed:
            self._payloads.release_everyones(store, self.world_size)
            self._life.forget()
        else:
            self._payloads.release_own(store)

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
        self._link.current = name
        self._link.deciding = name if decide is not None else None
        outcome = PhaseOutcome()
        only_rank0_reads = only_rank0_reads or decide is not None
        try:
            yield outcome
        except Exception as error:
            self.exchange(name, None, error, only_rank0_reads=only_rank0_reads)
            raise  # pragma: no cover - exchange always raises for a failed rank
        except BaseException as error:  # Ctrl-C, SystemExit: tell the others, don't wait
            self.abandon(error)
            raise
        outcome.payloads = self.exchange(
            name, outcome.payload, None, only_rank0_reads=only_rank0_reads
        )
        if decide is not None:
            link, payloads = self._link, outcome.payloads
            outcome.part = self._agreeing(
                lambda: link.guarded(name, lambda: agreement.decide(link, name, payloads, decide))
            )
            link.deciding = None  # every part is sent: nobody waits for rank 0's any more

    def abandon(self, error: BaseException) -> None:
        """This rank leaves the operation by ``error``, which no phase agreed on (an
        interrupt, an exception outside any phase block): every other rank raises it at
        once, naming this rank (``agreement.abandon``), not after a heartbeat or timeout.
        Nothing to do if the error was agreed; never raises. Call it before :meth:`close`."""
        link = self._link
        if link.store is None or link.lost or link.failed or not self._life.entered:
            return
        link.failed = link.interrupted = True
        with contextlib.suppress(Exception):
            agreement.abandon(link, error)

    @property
    def gave_up(self) -> bool:
        """Whether this rank's error is its own verdict, not agreed (``agreement.give_up``)."""
        return self._link.gave_up

    def raise_if_left(self, phase: Phase) -> None:
        """Raise the agreed error if a rank already failed ``phase`` (``agreement.give_up``)."""
        if self._link.store is not None and agreement.phase_failed(self._link, phase):
            raise agreement.agreed(self._link, phase)

    def _agreeing(self, step: Callable[[], Any]) -> Any:
        """Run ``step``; an error it raises is one every rank raises (no need to abandon)."""
        try:
            return step()
        except CheckpointError:
            self._link.failed = True
            raise

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
        link = self._link
        if link.store is None:
            if error is not None:
                raise as_checkpoint_error(error) from error
            return [payload]
        link.current = phase
        wait = link.timeout if timeout is None else timeout
        skip_reading = only_rank0_reads and link.rank != 0
        payloads: list[Any] = self._agreeing(
            lambda: link.guarded(
                phase, lambda: self._exchange(phase, payload, error, wait, skip_reading), error
            )
        )
        return payloads

    def _exchange(
        self,
        phase: Phase,
        payload: Any,
        error: BaseException | None,
        timeout: float,
        skip_reading: bool,
    ) -> list[Any]:
        link = self._link
        woke = agreement.post(link, phase, payload, error)
        own = [keys.payload(phase, link.rank)] if payload is not None else []
        try:
            self._wait(phase, timeout, error, check_first=False, woke=woke)
        except CheckpointError as e:
            if agreement.phase_failed(link, phase):
                self._payloads.failed(own)
            elif phase is not Phase.ENTRY:  # timed out, or called a slow rank dead: its
                agreement.give_up(link, e)  # payload stays for others that may yet read it
            raise
        # Every rank has posted this phase, so every rank has read the earlier payloads.
        self._payloads.agreed(phase, own)
        self.release()
        if payload is None or skip_reading:
            return [None] * link.world_size
        return agreement.read_payloads(link, phase)

    def _wait(
        self,
        phase: Phase | str,
        timeout: float,
        own_error: BaseException | None,
        check_first: bool = True,
        woke: int | None = None,
    ) -> None:
        """Return once every rank has posted ``phase`` (see ``agreement.wait``)."""
        agreement.wait(
            self._link,
            Phase(phase),
            timeout,
            own_error,
            check_first=check_first,
            withdraw=self._life.withdraw,
            woke=woke,
        )

    def _check_heartbeats(self, phase: Phase | str, now: float) -> None:
        """Raise if a watched rank that has not posted ``phase`` stopped beating long ago."""
        link, under_way = self._link, Phase(phase)
        assert link.heartbeat is not None
        dead = link.heartbeat.dead(now, lambda r: link.posted(under_way, r))
        if dead:
            raise link.dead_error(under_way, dead)

    def release(self) -> None:
        """Delete this rank's payload keys that no rank will read any more."""
        if self._link.store is not None:
            self._payloads.release(self._link.store)


def rank_zero_answer(
    operation: str,
    name: str,
    answer: Callable[[], str | None],
    *,
    timeout: float,
    entry_timeout: float,
) -> str | None:
    """``answer()`` as rank 0 gives it, on every rank; its error is every rank's.

    For a lookup that each rank could make on its own but might see differently (an
    object store that one rank cannot reach, a checkpoint committed in between): every
    rank then acts on one answer, or raises one agreed error, instead of one rank
    raising the store's error alone while the others wait for it in a collective.
    ``operation`` and ``name`` label the agreement (``operation`` as in the errors:
    ``"load"``)."""
    coord = Coordinator(operation, name, timeout=timeout)
    try:
        coord.enter(entry_timeout)

        def decide(payloads: list[Any]) -> list[str | None]:
            return [answer()] * len(payloads)

        with coord.phase(Phase.PLAN, decide=decide) as chosen:
            pass
    finally:
        coord.close()
    return None if chosen.part is None else str(chosen.part)
