"""How the ranks of one tiered manager talk to each other.

Small JSON payloads (what each node holds, the free space, whether a copy arrived) are
exchanged through the coordinator, so that an error on one rank is agreed and a missing
rank is named; checkpoints travel over the tiers' own gloo group (``transfer.py``), made
on first need, so that a restore from the local tier does not wait for it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from ..distributed import Coordinator, Phase, world
from ..distributed.background_groups import background_group, lower_priority
from ..errors import CheckpointError


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
        coord = Coordinator("tiers", self.tag, timeout=self.timeout, called_as=CALLED_AS)
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
            # gloo's threads of this group copy every byte received: they yield to training
            # like the replicator's (distributed/background_groups.py).
            timeout = timedelta(seconds=self.timeout)
            self.group = background_group(BACKGROUND_NICENESS, timeout=timeout)
        return self.group


CALLED_AS = "TieredCheckpointManager(...) and its save, async_save, load_latest, latest and close"
"""What the manager's agreements and loads are, to the user (``Coordinator``'s
``called_as``): a rank missing from one was told ``shardsafe.tiers must be called``."""


BACKGROUND_NICENESS = 19
"""The tiers' background threads' niceness (a local save's write, its replication): the
lowest, as the async save's writer's, so that every background writer of shardsafe
yields alike to a training that keeps the cores busy. Measured against 10 (six runs each
of ``benchmarks/tiered_recovery.py``, 4 ranks on 2 cores): training kept 0.87-0.92 of its
speed while a save was replicated (0.86-0.90 at 10), and a save every step cost
0.61-0.68 of a step (0.61-0.66): no difference beyond the noise here. On an idle core
the threads run at full speed either way."""


background_priority = functools.partial(lower_priority, BACKGROUND_NICENESS)
"""Lower the calling thread to :data:`BACKGROUND_NICENESS` (a thread pool's initializer)."""


def steps_differ(
    step: int, rank: int, theirs: int, other: int, *, same_save: bool = True, then: str = ""
) -> CheckpointError:
    """The error for ranks that passed different steps to one collective save: ``step``
    on ``rank`` but ``theirs`` on ``other`` (``same_save``: found by pairing the ranks'
    local saves in order; ``then``: what follows from it, as a sentence)."""
    at = " (at the same local save)" if same_save else ""
    return CheckpointError(
        f"the ranks saved different steps: step {step} on rank {rank} but step {theirs} on "
        f"rank {other}{at}. TieredCheckpointManager.save/async_save is collective: pass the "
        f"same step on every rank{'. ' + then if then else ''}"
    )
