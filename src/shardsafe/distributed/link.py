"""What the parts of one coordinated operation share: this rank's line to the others.

The coordinator's jobs (``agreement``: deciding and publishing outcomes; ``lifecycle``:
entering, heartbeats, closing; ``payloads``: when a payload may go) each read and
update the same few facts: who this rank is, its connections to the store, and what it
has learnt of the other ranks (which died, which phase is under way). They are kept
here, in one object, so that no part holds a copy another part cannot see change.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..errors import CheckpointError
from . import store_keys as keys
from . import waiting
from .heartbeat import Heartbeat
from .phases import Phase
from .reports import dead_message


@dataclass
class Link:
    """One operation's view of the ranks: identity, store connections, what it learnt."""

    operation: str
    rank: int
    world_size: int
    timeout: float
    dead_after: float
    aftermath: dict[Phase | None, str]
    """Per phase (``None``: any other), what a rank dying there means for the caller."""
    store: Any = None
    """This operation's own connection (a ``CountingStore``), for its blocking waits;
    ``None`` on a single rank."""
    pulse_store: Any = None
    """Where the heartbeat counters live: one per rank for every operation, outside any
    operation's namespace, so that they never pile up in the store (``store_keys``)."""
    beat_store: Any = None
    """The heartbeat's connection: never blocked by this operation's waits."""
    alarm: Any = None
    """A connection other than the one this rank blocks on, for the alarms that end its
    waits (``waiting.block``); ``None`` where there is only one."""
    heartbeat: Heartbeat | None = None
    dead: list[int] = field(default_factory=list)
    """Ranks this rank's heartbeat watch saw die."""
    awaiting: str | None = None
    """The key of rank 0's decision while this rank waits for it (``agreement.part``)."""
    current: Phase = Phase.ENTRY
    """The phase under way."""
    deciding: Phase | None = None
    """The phase under way, if rank 0 decides it (the others await their ``part``)."""
    last_posted: Phase | None = None
    lost: bool = False
    """The store failed us: this connection is not handed on."""
    posted_phases: set[Phase] = field(default_factory=set)
    """The phases this rank has posted (ok or error): an interrupt fails the others."""
    all_posted: set[Phase] = field(default_factory=set)
    """The phases this rank saw every rank post (ok or error): their count needs no
    reading at close (``Lifecycle.acknowledge``)."""
    failed: bool = False
    """Every rank has raised (or will raise) an agreed error: nothing left to tell."""
    interrupted: bool = False
    """This rank left the operation by an interrupt it told the others of (``abandon``)."""
    gave_up: bool = False
    """This rank stopped waiting on its own (a phase timeout, a rank it called dead): the
    others may yet finish the phase, and rank 0 commit what every rank wrote."""
    arrival: str = ""
    """The operation and call this rank entered (``store_keys.arrival``), as it posts it
    under ``entered/<rank>``; empty on a single rank."""
    calls_made: Callable[[str], int] | None = None
    """How many calls of an operation tag this process has made (``lifecycle.CALLS``): a
    missing rank whose last arrival is one of them is behind, not elsewhere."""
    entry_post: tuple[Any, str, str] | None = None
    """This operation's connection without its prefix, the operation's prefix and the
    pulses' (each ending in ``/``): the entry's progress and the arrival are set in one
    request (:meth:`set_progress`); ``None`` where the store is the tests' own."""
    called_as: str | None = None
    """What the user calls, for the message to a rank that waited for one that never came
    (``reports.missing_message``); ``None``: ``shardsafe.<operation>``."""

    def guarded(self, phase: Phase, step: Callable[[], Any], error: Any = None) -> Any:
        """Run ``step``; a store that went away becomes a :class:`CheckpointError`."""
        try:
            return step()
        except CheckpointError:
            raise
        except (RuntimeError, OSError) as lost:  # the store itself is gone
            self.lost = True
            if self.heartbeat is not None:  # its next beat would fail too, logged by torch
                self.heartbeat.stop()
            raise CheckpointError(
                f"lost contact with the process group's store during the '{phase.value}' "
                f"phase of {self.operation} (this is rank {self.rank}): {lost}. Another rank, "
                "usually rank 0 which hosts the store, has probably exited or crashed."
            ) from (error or lost)

    def block(self, key: str, timeout: float, ring: Callable[[], Any] | None = None) -> bool:
        """Wait until ``key`` exists (True) or ``timeout`` seconds pass (False, or True
        after an alarm created the key: see ``waiting.block``)."""
        return waiting.block(self.store, key, timeout, self.alarm, ring)

    def posted(self, phase: Phase, rank: int, store: Any = None) -> bool:
        """Whether ``rank`` has posted ``phase`` (read through ``store``, default this
        operation's connection)."""
        store = self.store if store is None else store
        if any(store.check([k]) for k in (keys.payload(phase, rank), keys.error(phase, rank))):
            return True
        progress = keys.progress(rank)
        return bool(store.check([progress])) and store.get(progress) == phase.value.encode()

    def set_progress(self, phase: Phase) -> None:
        """Post that this rank reached ``phase`` (one key per rank, overwritten phase after
        phase); at the entry, with where this rank is (``entered/<rank>``, outside the
        operation's namespace, for a rank that waits for it elsewhere), in the same
        request: a save stays within its budget of store requests per rank."""
        if phase is Phase.ENTRY and self.entry_post is not None and self.arrival:
            raw, prefix, pulses = self.entry_post
            progress, entered = prefix + keys.progress(self.rank), pulses + keys.entered(self.rank)
            raw.multi_set([progress, entered], [phase.value, self.arrival])
            return
        self.store.set(keys.progress(self.rank), phase.value)

    def elsewhere(self, missing: list[int]) -> str:
        """Where the ``missing`` ranks last entered, where that is not this operation: a
        call this rank has not made (``"rank 1 last entered save of 'b' (call 1), while
        this rank entered save of 'a' (call 1)"``: another path, the manager another step,
        a call more), or one it has made (that rank is behind: slow, stuck or dead, or it
        skips this call). Empty where neither, or the store cannot say."""
        store, instead, behind = self.pulse_store, [], []
        if store is None or not self.arrival:
            return ""
        try:
            for rank in missing:
                key = keys.entered(rank)
                value = store.get(key).decode() if store.check([key]) else self.arrival
                call, _, tag = value.partition(" ")
                if value == self.arrival:
                    continue
                if self.calls_made is not None and self.calls_made(tag) >= int(call):
                    behind.append(f"rank {rank} has entered nothing since {_described(value)}")
                else:
                    instead.append(f"rank {rank} last entered {_described(value)}")
        except (RuntimeError, OSError, UnicodeDecodeError, ValueError):
            return ""
        said = []
        if instead:
            said.append(f"{'; '.join(instead)}, while this rank entered {_described(self.arrival)}")
        if behind:
            said.append(
                f"{'; '.join(behind)}, which this rank has passed: behind (slow, stuck or "
                "dead), or skipping this call"
            )
        return ". ".join(s[:1].upper() + s[1:] for s in said)

    def dead_error(self, phase: Phase, dead: list[int]) -> CheckpointError:
        """The error for ranks that died during ``phase``, ended by what it means."""
        what = self.aftermath.get(phase, self.aftermath.get(None, ""))
        message = dead_message(self.operation, phase, dead, self.dead_after, self.rank)
        return CheckpointError(f"{message} {what}".rstrip())


def _described(arrival: str) -> str:
    """``"3 save:runs/a"`` as ``"save of 'runs/a' (call 3)"`` (a path the operation
    spells with its own name in front, as the tiered manager's ``tiers:<root>``, without
    it)."""
    call, _, tag = arrival.partition(" ")
    operation, _, path = tag.partition(":")
    path = path.removeprefix(f"{operation}:")
    return f"{operation} of {path!r} (call {int(call)})"
