"""Coordination of ranks: phases, the timed entry barrier, error agreement, heartbeats.

``coordinator`` (the phase blocks: the face the engine sees), by job below it:
``store_keys`` (every key in the store, built in one place), ``agreement`` (publishing
an outcome, deciding the error every rank raises), ``lifecycle`` (entering, heartbeats,
closing), ``payloads`` (kept until every rank has read them), ``link`` (what they
share); ``heartbeat`` (dead-rank detection), ``reports`` (how a failure is told to every
rank), ``phases`` (their names), ``group`` (the default process group as shardsafe sees
it), ``clients`` (store connections for blocking waits), ``waiting`` (waits without a
store timeout), ``store_requests`` (counting what the store serves),
``background_groups`` (the gloo groups of background work, whose threads yield to
training).
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
