"""How much node-local space the local tier takes, checked before its first write.

A node keeps, for each of ``keep_local`` steps, the rank checkpoints of its own ranks and
the replicas it receives (``replicas`` other nodes' worth, for evenly sized nodes):
at most ``(1 + replicas) x the node's shards x keep_local`` bytes once retention has run
(a replica's file identical to one of the node's own is a link to it, ``transfer.py``;
the check reserves the full size, as a replica of sharded state needs it). At its
peak it holds more: the newest step every rank has replicated, kept until a newer one
is counted (it may be older than the ``keep_local`` newest); the step being written (or
received); and, of its own ranks' checkpoints, the step before it, written but still
being replicated (retention counts a step only once it is replicated). The check asks
for room for all of it, ``keep_local + 2`` steps plus one step of the node's own ranks'
checkpoints: free space plus what the tier's older steps already take (they are
replaced). The data-parallel tensors a node's ranks write once between them
(``node_share.py``), when they do from the first save on, count once for the node's
own checkpoints.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..checkpoint.plan.collecting import Collected
from ..errors import CheckpointError
from .topology import Topology


def staged_bytes(items: Collected) -> int:
    """Tensor bytes in one rank's snapshot: what its rank checkpoint holds."""
    return sum(
        chunk.tensor.numel() * chunk.tensor.element_size()
        for _, item in items.values()
        for chunk in item.chunks
    )


@dataclass(frozen=True)
class Report:
    """One rank's figures: its own checkpoint's bytes, and its node directory's space."""

    own_bytes: int
    free_bytes: int
    used_bytes: int

    def to_json(self) -> list[int]:
        return [self.own_bytes, self.free_bytes, self.used_bytes]

    @staticmethod
    def from_json(doc: list[int]) -> Report:
        own, free, used = (int(v) for v in doc)
        return Report(own, free, used)


@dataclass(frozen=True)
class Budget:
    """Bytes one step of the local tier takes on each node, and what the tier needs."""

    step_bytes: list[int]
    """Per node: its ranks' checkpoints plus the replicas it keeps, one step."""
    keep_local: int
    own_bytes: list[int]
    """Per node: its ranks' checkpoints, one step."""

    def required(self, node: int) -> int:
        """``keep_local`` steps, the newest step every rank has replicated and the one
        being written; and the node's own checkpoints of the step before, until it is
        replicated (see the module docstring)."""
        return self.step_bytes[node] * (self.keep_local + 2) + self.own_bytes[node]


def check(
    reports: list[Report],
    topology: Topology,
    replicas: int,
    keep_local: int,
    where: list[str],
    shared: list[int] | None = None,
) -> Budget:
    """The budget of every node; a :class:`CheckpointError` naming the first node without
    room for it (by its ranks and ``where[rank]``, each rank's local directory), the same
    on every rank. ``shared[node]``: the bytes of data-parallel tensors each rank of that
    node holds alike and the node writes once (``node_share.py``), counted once for its
    own ranks' checkpoints (the replicas it keeps are counted whole)."""
    step_bytes, own_bytes = [], []
    for node, ranks in enumerate(topology.nodes):
        sources = {s for r in ranks for s in topology.sources(r, replicas)} - set(ranks)
        once = (len(ranks) - 1) * (shared[node] if shared is not None else 0)
        own = sum(reports[r].own_bytes for r in ranks) - once
        step_bytes.append(own + sum(reports[r].own_bytes for r in sources))
        own_bytes.append(own)
    result = Budget(step_bytes, keep_local, own_bytes)
    for node, ranks in enumerate(topology.nodes):
        available = reports[ranks[0]].free_bytes + sum(reports[r].used_bytes for r in ranks)
        if result.required(node) > available:
            raise CheckpointError(
                f"the local tier needs {_gib(result.required(node))} on the node of ranks "
                f"{list(ranks)[:8]} ({where[ranks[0]]}): {_gib(step_bytes[node])} per step "
                f"(its ranks' checkpoints and the replicas it keeps) x (keep_local={keep_local} "
                "+ 1 being written + the newest step every rank has replicated), plus "
                f"{_gib(own_bytes[node])} (its ranks' previous step, until it is replicated), "
                f"but only {_gib(available)} is free there. Lower keep_local (or replicas, "
                "where you set them), save locally less state, or give the local path more "
                "room (a larger /dev/shm: docker --shm-size, or an NVMe path)"
            )
    return result


def _gib(n: int) -> str:
    if n < 2**20:
        return f"{n} bytes"
    return f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.1f} MiB"
