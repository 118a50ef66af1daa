"""Every key a coordinated operation keeps in the process group's store, built here alone.

One operation's keys live under a namespace of its own (:func:`namespace`): the
operation, the path as every rank spells it and the call number, so that a save one rank
abandoned is never confused with a later one. Inside it, per phase ``P``:

==============================  ==========================================================
``P/posted``                    counter: ranks that posted ``P`` (ok or error)
``P/wake``                      counter every waiting rank blocks on; what bumped it
                                (all posted, a failure, a death) is its value
``P/ok/<rank>``                 a rank's JSON payload (only where it has one)
``P/error/<rank>``              a failing rank's report (type, message)
``P/failed``                    counter: ranks that failed ``P``
``P/failing``, ``P/failing/i``  slot counter, and the rank that took slot ``i``
``P/part/<rank>``               rank 0's decision for a rank (``decide``)
==============================  ==========================================================

and per operation: ``progress/<rank>`` (the last phase a
rank posted without a payload: one key per rank, overwritten), ``dead`` (the ranks a
watcher saw die), ``closed`` and ``closed_all`` (the acknowledgement at close).

Outside any namespace, under :data:`PULSES`: ``beat/<rank>``, each rank's heartbeat
counter, shared by all its operations, and ``entered/<rank>``, the operation and call a
rank last entered (overwritten: one key per rank in all), which names where a rank that
never arrived went instead (another path, another step).

Once every rank has closed, rank 0 deletes them (``Lifecycle.forget``; payloads go by
``payloads``), so the store does not grow with every save; only a failed operation's
reports stay (a few keys per failure).
"""

from __future__ import annotations

import os

from .phases import Phase

PULSES = "shardsafe/pulse"
"""The prefix of the heartbeat counters (``beat/<rank>``), which no operation owns."""
DEAD = "dead"
CLOSED = "closed"
"""Counter: ranks other than 0 that have closed (seen the last outcome)."""
CLOSED_ALL = "closed_all"
"""Created by the last rank to close, for rank 0 to block on."""


def tag(operation: str, path: str) -> str:
    """What one operation on one path is called in every rank's keys. The path as every
    rank spells it, not made absolute: ranks on different nodes may run in different
    working directories, and a URL is no local path."""
    return f"{operation}:{path if '://' in path else os.path.normpath(path)}"


def namespace(operation_tag: str, call: int) -> str:
    """The prefix of every key of the ``call``-th operation called ``operation_tag``."""
    return f"shardsafe/{operation_tag}/{call}"


def beat(rank: int) -> str:
    return f"beat/{rank}"


def entered(rank: int) -> str:
    return f"entered/{rank}"


def arrival(operation_tag: str, call: int) -> str:
    """The value of ``entered/<rank>``: the call number, then the tag."""
    return f"{call} {operation_tag}"


def progress(rank: int) -> str:
    return f"progress/{rank}"


def posted(phase: Phase) -> str:
    return f"{phase.value}/posted"


def wake(phase: Phase) -> str:
    return f"{phase.value}/wake"


def payload(phase: Phase, rank: int) -> str:
    return f"{phase.value}/ok/{rank}"


def error(phase: Phase, rank: int) -> str:
    return f"{phase.value}/error/{rank}"


def failed(phase: Phase) -> str:
    return f"{phase.value}/failed"


def failing(phase: Phase) -> str:
    return f"{phase.value}/failing"


def failing_slot(phase: Phase, slot: int) -> str:
    return f"{phase.value}/failing/{slot}"


def part(phase: Phase, rank: int) -> str:
    return f"{phase.value}/part/{rank}"
