"""Background work's threads yield to training: ours, and gloo's for the groups it uses.

A background save or replication runs on threads of its own and sends bytes over a gloo
group of its own. gloo copies every byte on the event-loop and worker threads it starts
for each group, at the priority of the thread that made the group: the training's. On a
machine whose cores the training keeps busy that work then takes a full share of them.
So the threads that making such a group starts are lowered too (Linux, where niceness
is per thread; elsewhere nothing changes). The write or transfer then takes longer only
while training keeps every core busy; on an idle core it runs at full speed.
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Any

import torch.distributed as dist


def lower_priority(niceness: int, tid: int | None = None) -> None:
    """Raise a thread's niceness to at least ``niceness`` (default: the calling thread)."""
    with contextlib.suppress(OSError, AttributeError):
        tid = threading.get_native_id() if tid is None else tid
        os.setpriority(os.PRIO_PROCESS, tid, max(os.getpriority(os.PRIO_PROCESS, tid), niceness))


def background_group(niceness: int, **options: Any) -> Any:
    """``dist.new_group(backend="gloo", **options)`` (collective), its threads at
    ``niceness``. Call it where no other thread is being started (the training waits in
    the call that makes the group): every thread that appears meanwhile is lowered."""
    before = threads()
    group = dist.new_group(backend="gloo", **options)
    for tid in threads() - before:
        lower_priority(niceness, tid)
    return group


def threads() -> set[int]:
    """This process's thread ids (Linux; empty elsewhere)."""
    try:
        return {int(name) for name in os.listdir("/proc/self/task")}
    except OSError:
        return set()
