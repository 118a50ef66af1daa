"""An operation's life on this rank: its store connections, its heartbeat, and its end.

Connections: a rank blocks on a connection of its own (``clients``), handed to a later
operation when this one ends; the heartbeat beats on the shared one. Entering: the first
beat goes out before the entry barrier, so that rank 0's watch finds every rank's beat;
once every rank has arrived, each beats until close, rank 0 watching every rank and the
others rank 0. A rank whose entry timed out takes its arrival back (:meth:`withdraw`),
so that a retry on every rank meets in the same place. Closing: rank 0 stays until
every rank has seen the last outcome (:meth:`acknowledge`), since it usually hosts the
store; then the last phase's payloads go (``payloads``).
"""

from __future__ import annotations

import json
import time
from collections import Counter
from typing import Any

import torch.distributed as dist

from . import clients
from . import store_keys as keys
from .agreement import ACK_TIMEOUT_S, DEAD
from .group import default_store
from .heartbeat import BEAT_S, Heartbeat
from .link import Link
from .phases import Phase
from .store_requests import CountingStore

INTERRUPTED_ACK_S = 2.0
"""How long an interrupted rank 0 waits for the others to close (see acknowledge)."""


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

    def made(self, tag: str) -> int:
        """How many calls of ``tag`` this process has made (and not taken back)."""
        return self._counts.get(tag, 0)


CALLS = CallCounter()
_PULSING: dict[tuple[int, int], Any] = {}
"""(id(store), rank) -> store: where this process's heartbeat counter, as that rank, is."""


class Lifecycle:
    """Connecting, entering, beating, withdrawing and closing for one operation."""

    def __init__(self, link: Link, tag: str, group_store: Any = None) -> None:
        self.link = link
        self.tag = tag
        """The operation and path, as every rank names them (``store_keys.tag``)."""
        self.entered = False
        self.withdrawn = False
        self._shared: Any = None
        self._connection: Any = None
        if group_store is not None:  # tests: one store, no process group
            link.store = link.beat_store = link.pulse_store = CountingStore(group_store)
        elif link.world_size > 1:
            self._connect()

    def _connect(self) -> None:
        """This operation's own connection, and its namespace on both."""
        call = CALLS.next(self.tag)
        prefix = keys.namespace(self.tag, call)
        self._shared = default_store()
        self._connection = clients.acquire(self._shared)
        prefixed = dist.distributed_c10d.PrefixStore
        self.link.store = CountingStore(prefixed(prefix, self._connection))
        self.link.beat_store = CountingStore(prefixed(prefix, self._shared))
        self.link.pulse_store = CountingStore(prefixed(keys.PULSES, self._shared))
        # The arrival goes with the entry's own post, in one request (``Link.set_progress``):
        # the full keys, as PrefixStore joins them (``<prefix>/<key>``).
        self.link.arrival = keys.arrival(self.tag, call)
        self.link.calls_made = CALLS.made
        self.link.entry_post = (CountingStore(self._connection), f"{prefix}/", f"{keys.PULSES}/")
        if self._connection is not self._shared:
            self.link.alarm = self.link.beat_store

    def first_beat(self) -> None:
        """The first beat, before arriving: rank 0's watch reads every rank's beat in one
        multi_get, which must not block on a key that does not exist yet (once per store:
        the counter outlives operations). Guarded: if
        rank 0 (which hosts the store) died between two saves, this is the first request
        to find it gone, and must say so, not raise torch's "Connection reset by peer"."""
        store, rank = self.link.pulse_store, self.link.rank
        pulsing = (id(self._shared), rank)
        if self._shared is not None and _PULSING.get(pulsing) is self._shared:
            return  # this rank's counter is in this store already (never deleted)
        self.link.guarded(Phase.ENTRY, lambda: store.add(keys.beat(rank), 1))
        if self._shared is not None:
            _PULSING[pulsing] = self._shared  # kept, so that its id stays its own

    def start_heartbeat(self) -> None:
        """Every rank has entered: beat until close (rank 0 watches all, others rank 0)."""
        link = self.link
        if link.store is None or self.withdrawn:
            return
        self.entered = True
        watch = None if link.rank == 0 else [0]
        beat = Heartbeat(link.pulse_store, link.rank, link.world_size, link.dead_after, watch)
        beat.start(self.publish_dead, self.has_posted_current)
        link.heartbeat = beat

    def stop_heartbeat(self, wait: bool = False) -> None:
        if self.link.heartbeat is not None:
            self.link.heartbeat.stop(wait)
            self.link.heartbeat = None

    def forget(self) -> None:
        """Rank 0, once every rank has closed (and stopped beating): delete the
        operation's remaining keys, so that the store does not grow by O(ranks) keys with
        every save and load (a long run saves thousands of times). Payloads go by
        ``payloads``; a failed phase's reports and rank 0's parts for a failed decision
        stay (a few keys, only for failures)."""
        link, store = self.link, self.link.store
        names = [keys.progress(r) for r in range(link.world_size)]
        for phase in link.posted_phases:
            names += [keys.posted(phase), keys.wake(phase)]
            if link.failed:
                names += [keys.failed(phase), keys.failing(phase)]
        names += [keys.CLOSED, keys.CLOSED_ALL] + ([keys.DEAD] if link.dead else [])
        for name in names:
            store.delete_key(name)

    def withdraw(self) -> bool:
        """Take back this rank's arrival after the entry wait ran out; False if too late.

        So that a retry of the same call on every rank (the user moved ``save`` out of
        their ``if rank == 0:``) meets in the same namespace as the ranks that never came:
        the arrival is uncounted and this path's call number goes back. If, the instant
        before, the count had reached the world size, everyone has arrived and the
        arrival stands. A rank arriving just after the withdrawal waits out its own
        ``entry_timeout`` and withdraws in turn.
        """
        store = self.link.store
        before = int(store.add(keys.posted(Phase.ENTRY), -1)) + 1
        if before >= self.link.world_size:
            store.add(keys.posted(Phase.ENTRY), 1)
            return False
        store.delete_key(keys.progress(self.link.rank))
        CALLS.take_back(self.tag)
        self.withdrawn = True
        return True

    def acknowledge(self, interrupted: bool = False) -> bool:
        """Rank 0 stays until every rank that posted the last phase has seen its outcome;
        True once they all have (on the other ranks: once this one has said so).
        ``interrupted`` (Ctrl-C on this rank): at most :data:`INTERRUPTED_ACK_S`, since
        the user is waiting; the others, woken by the interrupt, close within
        milliseconds, unless busy outside any wait.

        Rank 0 usually hosts the store: if it returned (and its program exited) while
        another rank was still reading, that rank would crash on a dead socket instead
        of finishing the checkpoint it just agreed on. A rank that died is not waited for.
        """
        link, store = self.link, self.link.store
        if link.rank != 0:
            if store.add(keys.CLOSED, 1) == link.world_size - 1:
                store.add(keys.CLOSED_ALL, 1)
            return True
        deadline = time.monotonic() + (INTERRUPTED_ACK_S if interrupted else ACK_TIMEOUT_S)
        last = link.last_posted or Phase.ENTRY
        # Seen posted by every rank (the usual case): no count to read.
        known = link.world_size if last in link.all_posted else None
        exists = waited = False
        while True:
            posted = known if known is not None else int(store.add(keys.posted(last), 0))
            if int(store.add(keys.CLOSED, 0)) >= posted - 1:
                return posted >= link.world_size
            now = time.monotonic()
            if link.dead or now > deadline:
                return False
            # A rank's death is published by this rank's heartbeat (link.dead); it is
            # looked for here too once this rank has waited (one request per rank).
            if waited and link.heartbeat is not None and link.heartbeat.dead(now, lambda r: False):
                return False  # a dead rank never acknowledges; its own operation reports it
            waited = True
            if exists:  # bumped or created by the alarm, yet not all closed: look again
                time.sleep(min(deadline - now, BEAT_S / 4))
            else:  # the usual case: the last rank to close bumps closed_all at once
                exists = link.block(keys.CLOSED_ALL, min(deadline - now, BEAT_S))

    def publish_dead(self, dead: list[int]) -> None:
        """The heartbeat saw ``dead`` die: wake every rank waiting in any phase."""
        link = self.link
        link.dead = dead
        store = link.beat_store
        store.set(keys.DEAD, json.dumps(dead))
        awaiting = link.awaiting
        if awaiting is not None:  # waiting for rank 0's decision: end that wait (part)
            store.set(awaiting, json.dumps({"dead": dead}))
        for phase in Phase:
            store.add(keys.wake(phase), DEAD)

    def has_posted_current(self, rank: int) -> bool:
        """A rank that posted the phase under way may have finished and stopped beating;
        but not rank 0 while this rank waits for its decision (it has not finished)."""
        if self.link.awaiting is not None:
            return False
        return self.link.posted(self.link.current, rank, self.link.beat_store)

    def give_back(self) -> None:
        """Hand this operation's store connection to the next one (once)."""
        if self._connection is not None and not self.link.lost:
            clients.release(self._shared, self._connection)
        self._connection = None
