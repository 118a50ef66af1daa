"""Which node each rank runs on, and which ranks hold a replica of whose checkpoint.

A replica exists to survive the loss of its owner's node, so it must never live on that
node. Nodes are told apart by torchrun's ``GROUP_RANK`` (the agent's node rank), else by
host name; ``SHARDSAFE_NODE`` overrides both (to simulate nodes on one machine). Nodes
are ordered by their lowest rank; rank ``r``, the ``i``-th rank of node ``n``, sends its
replicas to the ``i``-th rank (wrapping around) of nodes ``n + 1``, ..., ``n + replicas``
(modulo the node count). A node that is lost thus takes its ranks' checkpoints with it,
but every one of them is also on the next ``replicas`` nodes.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field


def node_name() -> str:
    """This process's node, as every rank on it names it."""
    override = os.environ.get("SHARDSAFE_NODE")
    if override:
        return f"node:{override}"
    group = os.environ.get("GROUP_RANK")
    if group is not None:
        return f"group:{group}"
    return f"host:{socket.gethostname()}"


def directory_identity(path: str) -> str:
    """What tells ``path``'s directory apart from every other on this host, also before it
    exists: the host's boot (``/proc/sys/kernel/random/boot_id``, else its name), and the
    device and inode of the nearest existing directory on the way to it, with the rest of
    the way. Two nodes given the same local directory on one host (two torchrun agents,
    one ``--local`` path) then say the same; two containers on one host, each with its
    own ``/dev/shm`` at the same path, do not (their mounts are different devices)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            host = f.read().strip()
    except OSError:
        host = socket.gethostname()
    here, rest = os.path.realpath(path), ""
    while True:
        try:
            found = os.stat(here)
            return f"{host}:{found.st_dev}:{found.st_ino}:{rest}"
        except OSError:
            parent = os.path.dirname(here)
            if parent == here:
                return f"{host}:{path}"
            rest = os.path.join(os.path.basename(here), rest) if rest else os.path.basename(here)
            here = parent


@dataclass(frozen=True)
class Topology:
    """The ranks of each node (``nodes``, ordered by lowest rank) and each rank's node."""

    nodes: tuple[tuple[int, ...], ...]
    node_of: tuple[int, ...]
    _sources: dict[int, dict[int, list[int]]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    """Per ``replicas``: every rank's sources, found in one pass (:meth:`sources`)."""

    @staticmethod
    def of(names: list[str]) -> Topology:
        """From every rank's :func:`node_name`, indexed by rank."""
        order: dict[str, list[int]] = {}
        for rank, name in enumerate(names):
            order.setdefault(name, []).append(rank)
        nodes = tuple(tuple(ranks) for ranks in order.values())
        node_of = [0] * len(names)
        for index, ranks in enumerate(nodes):
            for rank in ranks:
                node_of[rank] = index
        return Topology(nodes, tuple(node_of))

    @property
    def world_size(self) -> int:
        return len(self.node_of)

    def max_replicas(self) -> int:
        """Replicas on distinct other nodes that each rank can have."""
        return len(self.nodes) - 1

    def targets(self, rank: int, replicas: int) -> list[int]:
        """The ranks that keep ``rank``'s replicas, one per following node."""
        node = self.node_of[rank]
        index = self.nodes[node].index(rank)
        found = []
        for k in range(1, min(replicas, self.max_replicas()) + 1):
            peers = self.nodes[(node + k) % len(self.nodes)]
            found.append(peers[index % len(peers)])
        return found

    def sources(self, rank: int, replicas: int) -> list[int]:
        """The ranks whose replicas ``rank`` keeps. Every rank's are found at the first
        call, in one pass over the ranks' targets: asked for each rank (the budget check
        asks for all), a pass per call was quadratic in the world size (17 s at 4,096
        ranks, on every rank, before the first local write)."""
        if replicas not in self._sources:
            found: dict[int, list[int]] = {}
            for source in range(self.world_size):
                for target in self.targets(source, replicas):
                    found.setdefault(target, []).append(source)
            self._sources[replicas] = found
        return list(self._sources[replicas].get(rank, []))

    def surveyed_by(self, rank: int, replicas: int) -> set[int]:
        """The rank directories ``rank`` checks when its node's directory is surveyed:
        those it owns (its own, and its sources' replicas), and for the node's lowest rank
        also any rank no rank of the node owns; so each is checked once per node, not by
        every rank of it (the ranks' reports are pooled by node)."""
        owned = {rank, *self.sources(rank, replicas)}
        local = self.nodes[self.node_of[rank]]
        if rank != local[0]:
            return owned
        covered = {r for peer in local for r in (peer, *self.sources(peer, replicas))}
        return owned | (set(range(self.world_size)) - covered)

    def same_node(self, a: int, b: int) -> bool:
        return self.node_of[a] == self.node_of[b]
