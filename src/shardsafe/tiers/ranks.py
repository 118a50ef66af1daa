"""How the ranks of one tiered manager talk to each other.

Small JSON payloads (what each node holds, the free space, whether a copy arrived) are
exchanged through the coordinator, so that an error on one rank is agreed and a missing
rank is named; checkpoints travel over the tiers' own gloo group (``transfer.py``), made
on first need, so that a restore from the local tier does not wait for it.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ..distributed import Coordinator, Phase, world


class Ranks:
    """This rank, the world, and the two ways the ranks of one manager agree and send."""

    def __init__(self, tag: str, timeout: float) -> None:
        self.rank, self.world_size = world()
        self.tag = tag
        """What the ranks agree under (``tiers:<name>``)."""
        self.timeout = timeout
        self.group: Any = None
        """The transfers' own gloo group, once :meth:`transfers` has made it."""

    def exchange(self, phase: Phase, payload: Any | Callable[[], Any]) -> list[Any]:
        """Every rank's JSON ``payload`` (errors agreed, missing ranks named). A callable
        is called inside the agreed phase: what it reads from this rank's local directory
        (and the error if it cannot) reaches every rank, instead of one rank raising
        alone while the others wait for it until the timeout."""
        coord = Coordinator("tiers", self.tag, timeout=self.timeout)
        coord.enter(self.timeout)
        try:
            with coord.phase(phase) as outcome:
                outcome.payload = payload() if callable(payload) else payload
            return outcome.payloads  # kept in the store until every rank has read them
        finally:
            coord.close()

    def transfers(self) -> Any:
        """The transfers' gloo group (collective the first time: every rank reaches this
        at the same point, the first local save or a restore that needs a peer)."""
        if self.group is None and self.world_size > 1:
            before = _threads()
            self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=self.timeout))
            # gloo's own threads for this group (its device's event loop, which copies the
            # bytes received, and its workers) yield to training like the replicator's.
            for tid in _threads() - before:
                background_priority(tid)
        return self.group


def _threads() -> set[int]:
    """This process's thread ids (Linux; empty elsewhere)."""
    try:
        return {int(name) for name in os.listdir("/proc/self/task")}
    except OSError:
        return set()


BACKGROUND_NICENESS = 10


def background_priority(tid: int | None = None) -> None:
    """Lower a thread's scheduling priority (Linux: niceness is per thread; default: the
    calling thread), so that where cores are scarce the training loop's threads run
    first and the tiers' writes and transfers take the time left over."""
    with contextlib.suppress(OSError, AttributeError):
        tid = threading.get_native_id() if tid is None else tid
        os.setpriority(
            os.PRIO_PROCESS, tid, max(os.getpriority(os.PRIO_PROCESS, tid), BACKGROUND_NICENESS)
        )
