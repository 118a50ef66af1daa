"""Choosing what to restore: the newest step every rank can get, and from where.

Each rank reports the rank checkpoints it found intact in its node's directory (every
rank of a node sees the same directory; each rank directory is checked by one rank of
the node, ``Topology.surveyed_by``, and the reports are pooled by node). Rank 0 chooses
(:func:`choose`, pure): the newest step for which every rank ``r`` of the current world
has a copy saved at this world size, either on its own node (restored from there:
``local``) or on another node (sent to it by a rank of that node first: ``peer``).
Among several holders the one sending least is asked. The copies of one step restored
together are all of one save of one run (their ``run`` token, ``rank_checkpoint.run_of``,
names both: ``replication.save_token``): a copy an abandoned run left (one that could not
be deleted) never completes a step beside the copies a resumed run wrote of it, nor a
rank's copy of a step's earlier save beside another's of its later one; of two saves both
complete at a step, the later one's are restored. A run that a later run at another world
size went on from (its copies are there, under a later run's token) is abandoned: its
steps are never restored, however complete (a job back at its first world size after a
run at another one, which resumed from the persistent tier, restored the first run's
newer local step and replaced the later run's copy of it). If the persistent tier holds a
newer step than any complete local one, or no local step is complete, the persistent
tier is used (``persistent``); if nothing exists anywhere, nothing is restored (but the
newest step saved at another world size is named, ``Choice.stranded``: ``load_latest``
refuses to start afresh over it; and the newest step only some ranks hold,
``Choice.incomplete``: ``load_latest`` warns that the fresh start leaves it unused).
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
    incomplete: tuple[int, tuple[int, ...]] | None = None
    """With nothing to restore (``step`` None): the newest step of this world size that
    some ranks hold a copy of, and the ranks with no copy of it on any node:
    ``load_latest`` warns that a fresh start leaves those copies unused."""


Held = tuple[int, int, int] | tuple[int, int, int, str]
"""A rank checkpoint a rank can read: ``(step, rank, world_size)``, and the token of the
run that wrote it (``""`` if not given)."""


def choose(
    held: list[Iterable[Held]],
    topology: Topology,
    persistent_step: int | None,
    excluded: set[tuple[int, int, int]] = frozenset(),  # type: ignore[assignment]
) -> Choice:
    """The restore plan. ``held[h]``: every rank checkpoint rank ``h`` can read (its
    node's); ``excluded``: ``(holder node, step, rank)`` copies found bad (a failed
    transfer), not to be asked for again."""
    world = topology.world_size
    nodes_holding: dict[tuple[int, str, int], set[int]] = {}  # (step, run, rank) -> nodes
    elsewhere: set[tuple[int, int]] = set()  # (step, world size) of other worlds' copies
    resumed_elsewhere = ""  # the newest run token of those copies
    for holder, copies in enumerate(held):
        node = topology.node_of[holder]
        for copy in copies:
            step, rank, saved_world = copy[:3]
            run = copy[3] if len(copy) > 3 else ""
            if saved_world != world:
                elsewhere.add((step, saved_world))
                resumed_elsewhere = max(resumed_elsewhere, _run_part(str(run)))
            elif 0 <= rank < world and (node, step, rank) not in excluded:
                nodes_holding.setdefault((step, str(run), rank), set()).add(node)
    # Newest step first; at one step, the latest run first (its token sorts last).
    for step, run in sorted({(step, run) for step, run, _ in nodes_holding}, reverse=True):
        if persistent_step is not None and persistent_step > step:
            break
        if _run_part(run) < resumed_elsewhere:
            continue  # abandoned: a later run went on at another world size
        if all((step, run, r) in nodes_holding for r in range(world)):
            return _plan(step, {r: nodes_holding[(step, run, r)] for r in range(world)}, topology)
    if persistent_step is not None:
        return Choice(persistent_step, [PERSISTENT] * world)
    return Choice(
        None,
        [],
        stranded=max(elsewhere, default=None),
        incomplete=_newest_incomplete(nodes_holding, world, resumed_elsewhere),
    )


def _newest_incomplete(
    nodes_holding: dict[tuple[int, str, int], set[int]], world: int, resumed_elsewhere: str
) -> tuple[int, tuple[int, ...]] | None:
    """The newest step (of a run not abandoned) that some ranks hold, and the ranks
    without a copy of it anywhere; ``None`` if no rank holds one."""
    held: dict[tuple[int, str], set[int]] = {}
    for step, run, rank in nodes_holding:
        if _run_part(run) >= resumed_elsewhere:
            held.setdefault((step, run), set()).add(rank)
    if not held:
        return None
    step, run = max(held)
    return step, tuple(r for r in range(world) if r not in held[(step, run)])


def _run_part(token: str) -> str:
    """The run of a save's token (``replication.save_token``: the run's, then 8 hex digits
    of the save): runs compare by it, a later run's sorting last."""
    return token[:-8] if len(token) > 8 else ""


def _plan(step: int, nodes_holding: dict[int, set[int]], topology: Topology) -> Choice:
    """``nodes_holding``: by rank, the nodes holding its copy of ``step`` (of one run)."""
    tiers, sends = [], {}
    load: dict[int, int] = {}
    for rank in range(topology.world_size):
        nodes = nodes_holding[rank]
        if topology.node_of[rank] in nodes:
            tiers.append(LOCAL)
            continue
        tiers.append(PEER)
        candidates = [h for n in sorted(nodes) for h in topology.nodes[n]]
        sender = min(candidates, key=lambda h: (load.get(h, 0), h))
        load[sender] = load.get(sender, 0) + 1
        sends[rank] = sender
    return Choice(step, tiers, sends)
