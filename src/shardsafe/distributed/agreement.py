"""Error agreement: publishing this rank's outcome of a phase and deciding the one every
rank raises.

A rank posts "ok" (with its payload) or its error, then waits on the phase's ``wake``
counter until every rank has posted, one failed, a rank died, or the time ran out. The
store serves O(ranks) requests per phase (issue 17): nobody polls; the last rank to post,
a failing rank or a watcher that saw a death bumps ``wake``, and its value says which.
If some rank failed, every rank reads the same few reports (:func:`failures`) and raises
the same error, of the first failing rank's class. With ``decide``, rank 0 alone turns
every payload into one part per rank (:func:`decide`) and each rank reads its own
(:func:`part`), so that rank 0's refusal is agreed like any other error.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable
from typing import Any

from ..errors import CheckpointError
from . import store_keys as keys
from . import waiting
from .link import Link
from .phases import Phase
from .reports import (
    RankFailure,
    agreed_error,
    as_checkpoint_error,
    error_message,
    error_type,
    missing_message,
)

ACK_TIMEOUT_S = 30.0
"""How long rank 0 waits for the others' acknowledgement, and a reader for a report."""
_LATE = json.dumps({"late": True})
"""What an alarm writes into a decision this rank waited for too long (see part)."""
REPORTS_READ = 8
"""How many failing ranks' reports a rank reads to agree on an error (see failures)."""
AGREE_WAIT_S = 1.0
"""How long a rank woken by a failure waits for every rank to post (see agreed)."""

ALL_POSTED = 1
FAILED = 1 << 20
DEAD = 1 << 40
"""What bumped a phase's ``wake`` counter: the last rank to post adds ``ALL_POSTED``, each
failing rank ``FAILED`` (before it counts itself as posted, so a value showing every rank
posted shows every failure too), a watcher that saw a rank die ``DEAD``."""

Decide = Callable[[list[Any]], list[Any]]
"""Rank 0's decision over every rank's payload: one JSON-able part per rank."""


def post(link: Link, phase: Phase, payload: Any, error: BaseException | None) -> int | None:
    """Publish this rank's outcome of ``phase``: its error report, its payload, or (with
    neither) only its progress; wake everyone if it fails or is the last to post. The last
    to post gets the ``wake`` counter's value as it woke the others (every failure
    already in it: a failing rank bumps ``wake`` before it counts itself as posted), so
    that it need not wait and read the counter again (two requests less per phase);
    the others get ``None``."""
    store = link.store
    if error is not None:
        report = {"type": error_type(error), "message": error_message(error)}
        store.set(keys.error(phase, link.rank), json.dumps(report))
        slot = store.add(keys.failing(phase), 1)  # see failures
        if slot <= REPORTS_READ:
            store.set(keys.failing_slot(phase, slot), str(link.rank))
        store.add(keys.failed(phase), 1)
        store.add(keys.wake(phase), FAILED)
    elif payload is not None:
        store.set(keys.payload(phase, link.rank), json.dumps(payload))
    else:  # nothing to read: one key per rank, overwritten phase after phase
        link.set_progress(phase)
    woke = None
    if store.add(keys.posted(phase), 1) == link.world_size:
        woke = int(store.add(keys.wake(phase), ALL_POSTED))
    link.last_posted = phase
    link.posted_phases.add(phase)
    return woke


def abandon(link: Link, error: BaseException) -> None:
    """This rank leaves the operation by ``error`` (Ctrl-C, ``SystemExit``, an exception
    outside any phase block) without having posted it: post it as this rank's failure of
    every phase it has not posted, so that a rank waiting in any of them raises it at once,
    naming this rank, instead of waiting for this rank's heartbeat to stop (15 s, and then
    calling it dead) or, while this process lives on, for the phase timeout. Rank 0 also
    ends the wait of ranks for its decision in the phase under way (``part``).

    Costs a few store requests per phase, once, and only on this rank's way out."""
    last = link.last_posted  # rank 0's acknowledgement at close waits on the real one
    report = {"type": error_type(error), "message": error_message(error)}
    if link.rank == 0 and link.deciding in link.posted_phases:
        parts = [keys.part(link.deciding, r) for r in range(1, link.world_size)]
        link.store.multi_set(parts, [json.dumps({"error": report})] * len(parts))
    for phase in Phase:
        if phase not in link.posted_phases:
            post(link, phase, None, error)
    link.last_posted = last


def give_up(link: Link, verdict: CheckpointError) -> None:
    """This rank stopped waiting on its own in a phase after the entry (its phase timeout
    ran out, or it called a slow rank dead), an error not agreed: the others may yet all
    post. (At the entry a rank takes its arrival back instead, so that the same call
    retried on every rank meets: ``Lifecycle``.) Its verdict is
    posted as its failure of every later phase (:func:`abandon`), so that a rank late in
    this phase raises it as soon as it goes on, instead of waiting out a timeout of its
    own and then blaming this rank; and rank 0, before it commits, sees that this rank
    left (``Coordinator.raise_if_left``). This rank's files stay (``Link.gave_up``): rank
    0 may have committed them already. Before, such a rank deleted its shard, and rank 0
    committed a manifest naming it (found in review)."""
    link.gave_up = True
    with contextlib.suppress(Exception):  # the store gone: the verdict is the news
        abandon(link, verdict)


def read_payloads(link: Link, phase: Phase) -> list[Any]:
    """Every rank's payload of ``phase``, once all have posted."""
    raws = link.store.multi_get([keys.payload(phase, r) for r in range(link.world_size)])
    return [json.loads(raw) for raw in raws]


def wait(
    link: Link,
    phase: Phase,
    timeout: float,
    own_error: BaseException | None,
    *,
    check_first: bool = True,
    withdraw: Callable[[], bool] | None = None,
    woke: int | None = None,
) -> None:
    """Return once every rank has posted ``phase``; raise the agreed error if one failed,
    a rank died, or some did not post within ``timeout``. ``withdraw``: at the entry,
    take this rank's arrival back when the time is up (False: too late, all arrived).
    ``woke``: the ``wake`` counter as this rank, the last to post, bumped it (``post``):
    nothing to wait for."""
    deadline = time.monotonic() + timeout
    if woke is None and check_first and settled(link, phase, own_error):
        return
    if woke is None:
        woke = woken(link, keys.wake(phase), deadline)
    everyone = woke % FAILED > 0  # the last rank to post added ALL_POSTED
    if everyone:
        link.all_posted.add(phase)
    if woke // FAILED % (DEAD // FAILED):
        raise agreed(link, phase) from own_error
    if everyone:
        return
    if woke:
        raise link.dead_error(phase, json.loads(link.store.get(keys.DEAD)))
    if settled(link, phase, own_error):
        return  # the last rank arrived just as the wait ran out
    missing = [r for r in range(link.world_size) if not link.posted(phase, r)]
    if phase is Phase.ENTRY and withdraw is not None and not withdraw():
        return
    elsewhere = link.elsewhere(missing) if phase is Phase.ENTRY else ""
    raise CheckpointError(
        missing_message(
            link.operation,
            phase,
            missing,
            timeout,
            link.rank,
            link.world_size,
            link.called_as,
            elsewhere,
        )
    )


def woken(link: Link, key: str, deadline: float) -> int:
    """The counter ``key`` once something bumps it, or 0 when ``deadline`` passes.

    An alarm creates the key at 0: this rank's own when its time is up, or, the key
    being every rank's, that of a rank whose time ran out first (a missing rank, a
    retried entry). A rank whose own time is not up then looks at the key every so
    often instead of blocking: only ever while some rank is missing or stuck.
    """
    left = deadline - time.monotonic()
    if left <= 0 or not link.block(key, left):
        return 0
    pause = waiting.POLL_S
    while True:
        woke = int(link.store.add(key, 0))
        left = deadline - time.monotonic()
        if woke or left <= 0:
            return woke
        time.sleep(min(pause, left))
        pause = min(2 * pause, 0.25)


def settled(link: Link, phase: Phase, own_error: BaseException | None) -> bool:
    """Whether every rank has posted ``phase``; raise the agreed error if one failed."""
    # `posted` before `failed`: a failing rank bumps `failed` first, so once all
    # have posted, any failure is already visible to the read that follows.
    everyone = link.store.add(keys.posted(phase), 0) >= link.world_size
    if link.store.add(keys.failed(phase), 0) > 0:
        raise agreed(link, phase) from own_error
    return bool(everyone)


def phase_failed(link: Link, phase: Phase) -> bool:
    """Whether a rank posted an error of ``phase`` (then nobody reads its payloads); True
    if the store is gone (nobody reads them either)."""
    try:
        return int(link.store.add(keys.failed(phase), 0)) > 0
    except (RuntimeError, OSError):
        return True


def failures(link: Link, phase: Phase) -> list[RankFailure]:
    """The reports of the first ranks to fail ``phase`` (at most :data:`REPORTS_READ`),
    in the order they failed.

    Each failing rank takes a numbered slot and writes its rank there; a reader reads
    only the first :data:`REPORTS_READ` slots, so agreeing on an error costs every rank
    O(1) requests even when every rank fails (a full disk): O(ranks) in all, not
    O(ranks^2). The first report, the one whose rank, class and message every rank
    raises, is slot 1's: the same on every rank however late the others fail. A report
    is posted before its rank counts as failed, so a reader that saw the count finds it
    (slot 1's writer, if still writing, is waited for a moment).
    """
    store = link.store
    slots = min(int(store.add(keys.failing(phase), 0)), REPORTS_READ)
    slot_keys = [keys.failing_slot(phase, i) for i in range(1, slots + 1)]
    if store.add(keys.posted(phase), 0) >= link.world_size:
        # Every rank that took a slot has written it: two multi_gets, nothing waits.
        ranks = [int(raw) for raw in store.multi_get(slot_keys)] if slot_keys else []
        reports = store.multi_get([keys.error(phase, r) for r in ranks]) if ranks else []
    else:  # a rank may be between taking its slot and writing it
        if slot_keys:  # short and rare: a poll, with no store wait to time out in torch
            waiting.poll(store, slot_keys[0], AGREE_WAIT_S)
        ranks = [int(store.get(key)) for key in slot_keys if store.check([key])]
        reports = [store.get(keys.error(phase, r)) for r in ranks]
    found = []
    for r, raw in zip(ranks, reports):
        report = json.loads(raw)
        found.append(RankFailure(r, report["type"], report["message"]))
    return found


def agreed(link: Link, phase: Phase) -> CheckpointError:
    """The error every rank raises for a failed ``phase``.

    Several ranks may fail the same phase (a full disk); a rank woken by the first
    failure waits a moment (:data:`AGREE_WAIT_S`) for every rank to post, so that every
    rank reads the same reports and raises the same message."""
    pause, settle = 0.001, time.monotonic() + AGREE_WAIT_S
    while link.store.add(keys.posted(phase), 0) < link.world_size:
        if time.monotonic() > settle:
            break  # a rank is slow or dead: agree on what has been posted
        time.sleep(pause)
        pause = min(2 * pause, 0.05)
    deadline = time.monotonic() + ACK_TIMEOUT_S
    found = failures(link, phase)
    while not found and time.monotonic() < deadline:
        time.sleep(waiting.POLL_S)  # only if every rank read about is still writing its slot
        found = failures(link, phase)
    if not found:
        return CheckpointError(f"{link.operation} failed on some rank during '{phase.value}'")
    total = int(link.store.add(keys.failed(phase), 0))
    return agreed_error(found, link.operation, total=total)


def decide(link: Link, phase: Phase, payloads: list[Any], choose: Decide) -> Any:
    """Rank 0 decides from every payload (``choose``) and posts each rank its part; the
    others wait for theirs (watching rank 0 meanwhile). Returns this rank's part."""
    if link.store is None:
        try:
            return choose(payloads)[0]
        except Exception as e:
            raise as_checkpoint_error(e) from e
    part_keys = [keys.part(phase, r) for r in range(1, link.world_size)]
    if link.rank != 0:
        raw = part(link, phase, part_keys[link.rank - 1])
        if "error" in raw:
            failure = RankFailure(0, raw["error"]["type"], raw["error"]["message"])
            raise agreed_error([failure], link.operation)
        return raw["ok"]
    try:
        parts = choose(payloads)
    except Exception as e:
        report = {"type": error_type(e), "message": error_message(e)}
        link.store.multi_set(part_keys, [json.dumps({"error": report})] * len(part_keys))
        failure = RankFailure(0, report["type"], report["message"])
        raise agreed_error([failure], link.operation) from e
    link.store.multi_set(part_keys, [json.dumps({"ok": p}) for p in parts[1:]])
    return parts[0]


def part(link: Link, phase: Phase, key: str) -> dict[str, Any]:
    """Rank 0's decision for this rank, from ``key``: ``{"ok": part}`` or ``{"error":
    report}``. Rank 0's death (this rank's heartbeat writes ``{"dead": ranks}`` into the
    key, see ``lifecycle``) or the phase's timeout (an alarm writes ``_LATE``) are raised,
    without a wait that torch would report as timed out."""
    link.awaiting = key
    try:
        arrived = not link.dead and link.block(
            key, link.timeout, ring=lambda: link.alarm.set(key, _LATE)
        )
    finally:
        link.awaiting = None
    raw: dict[str, Any] = {}
    if arrived:
        raw = json.loads(link.store.get(key))
        link.store.delete_key(key)
    if "ok" in raw or "error" in raw:
        return raw
    if link.dead or "dead" in raw:
        raise link.dead_error(phase, link.dead or raw["dead"])
    raise CheckpointError(
        missing_message(
            link.operation, phase, [0], link.timeout, link.rank, link.world_size, link.called_as
        )
    )
