"""Choosing what to restore: the newest step every rank can get, and from where.

Each rank reports the rank checkpoints it found intact in its node's directory (every
rank of a node sees the same directory; each rank directory is checked by one rank of
the node, ``Topology.surveyed_by``, and the reports are pooled by node). Rank 0 chooses
(:func:`choose`, pure): the newest step for which every rank ``r`` of the current world
has a copy saved at this world size, either on its own node (restored from there:
``local``) or on another node (sent to it by a rank of that node first: ``peer``).
Among several holders the one sending least is asked. If the persistent tier holds a
newer step than any complete local one, or no local step is complete, the persistent
tier is used (``persistent``); if nothing exists anywhere, nothing is restored (but the
newest step saved at another world size is named, ``Choice.stranded``: ``load_latest``
refuses to start afresh over it).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from .topology import Topology

LOCAL, PEER, PERSISTENT = "local", "peer", "persistent"


@dataclass(frozen=True)
class Choice:
    """What rank 0 decided: the step, the tier of each rank, and who sends what."""

    step: int | None
    tiers: list[str]
    sends: dict[int, int] = field(default_factory=dict)
    """Receiving rank -> the rank that sends it its checkpoint."""
    stranded: tuple[int, int] | None = None
    """With nothing to restore (``step`` None): the newest step of a rank checkpoint saved
    at another world size, ``(step, world size)``, if any: what a silent fresh start would
    abandon."""


def choose(
    held: list[Iterable[tuple[int, int, int]]],
    topology: Topology,
    persistent_step: int | None,
    excluded: set[tuple[int, int, int]] = frozenset(),  # type: ignore[assignment]
) -> Choice:
    """The restore plan. ``held[h]``: ``(step, rank, world_size)`` of every rank checkpoint
    rank ``h`` can read (its node's); ``excluded``: ``(holder node, step, rank)`` copies
    found bad (a failed transfer), not to be asked for again."""
    world = topology.world_size
    nodes_holding: dict[tuple[int, int], set[int]] = {}
    elsewhere: set[tuple[int, int]] = set()  # (step, world size) of other worlds' copies
    for holder, copies in enumerate(held):
        node = topology.node_of[holder]
        for step, rank, saved_world in copies:
            if saved_world != world:
                elsewhere.add((step, saved_world))
            elif 0 <= rank < world and (node, step, rank) not in excluded:
                nodes_holding.setdefault((step, rank), set()).add(node)
    steps = sorted({step for step, _ in nodes_holding}, reverse=True)
    for step in steps:
        if persistent_step is not None and persistent_step > step:
            break
        if all((step, r) in nodes_holding for r in range(world)):
            return _plan(step, nodes_holding, topology)
    if persistent_step is not None:
        return Choice(persistent_step, [PERSISTENT] * world)
    return Choice(None, [], stranded=max(elsewhere, default=None))


def _plan(step: int, nodes_holding: dict[tuple[int, int], set[int]], topology: Topology) -> Choice:
    tiers, sends = [], {}
    load: dict[int, int] = {}
    for rank in range(topology.world_size):
        nodes = nodes_holding[(step, rank)]
        if topology.node_of[rank] in nodes:
            tiers.append(LOCAL)
            continue
        tiers.append(PEER)
        candidates = [h for n in sorted(nodes) for h in topology.nodes[n]]
        sender = min(candidates, key=lambda h: (load.get(h, 0), h))
        load[sender] = load.get(sender, 0) + 1
        sends[rank] = sender
    return Choice(step, tiers, sends)
