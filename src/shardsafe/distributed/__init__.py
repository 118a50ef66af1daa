"""Coordination of ranks: phases, the timed entry barrier, error agreement, heartbeats.

``coordinator`` (the phase blocks), ``heartbeat`` (dead-rank detection), ``reports``
(how a failure is told to every rank), ``phases`` (their names), ``group`` (the default
process group as shardsafe sees it).
"""

from __future__ import annotations

from .coordinator import Coordinator, PhaseOutcome
from .group import comm_device, world
from .heartbeat import DEAD_AFTER_S
from .phases import Phase

__all__ = ["DEAD_AFTER_S", "Coordinator", "Phase", "PhaseOutcome", "comm_device", "world"]
