"""Coordination of ranks: phases, the timed entry barrier, error agreement, heartbeats.

``coordinator`` (the phase blocks), ``heartbeat`` (dead-rank detection), ``reports``
(how a failure is told to every rank), ``phases`` (their names), ``group`` (the default
process group as shardsafe sees it), ``clients`` (store connections for blocking waits),
``store_requests`` (counting what the store serves).
"""

from __future__ import annotations

from .coordinator import Coordinator, PhaseOutcome
from .group import comm_device, world
from .heartbeat import DEAD_AFTER_S
from .phases import Phase
from .store_requests import reset_store_requests, store_requests

__all__ = [
    "DEAD_AFTER_S",
    "Coordinator",
    "Phase",
    "PhaseOutcome",
    "comm_device",
    "reset_store_requests",
    "store_requests",
    "world",
]
