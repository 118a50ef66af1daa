"""Which rank of a node receives each file that several of its ranks need from peers.

When a node is lost, each of its ranks receives its whole rank checkpoint from a peer on
another node. Under data parallelism those checkpoints hold the same large tensors, in
byte-identical files: the node's part files (``node_share.py``), or the data file of a
first, unshared save. Sent once per rank, the node's link carries them once per rank;
instead, each such file is received by one of the node's ranks that need it, and the
others hard-link it from that rank's directory once it has arrived, checked
(``restore.py``). A node of ``n`` data-parallel ranks then receives about ``1/n`` of what
it did, and stores it once.

The plan is computed the same on every rank from what the senders report: each sender
reads the manifests of the copies it is about to send and reports every data file's
size and fingerprint (``transfer.fingerprints``). Files of equal name and fingerprint
needed by several ranks of a node go, largest first, to the rank among them with the
fewest bytes so far (ties: the lowest rank). Nothing here is trusted for correctness: a
rank links a node-mate's file only if the fingerprint the mate computed from the
manifest it received equals the one of its own manifest, and only the very inode the
mate reported.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

Files = Mapping[str, tuple[int, str]]
"""A copy's data files, as reported: name -> ``(size, fingerprint)``."""


def together(sends: Mapping[int, int], node_of: Sequence[int]) -> bool:
    """Whether some node has two or more ranks receiving a copy (only then is there
    anything to plan: the same on every rank, from the choice alone)."""
    nodes = [node_of[rank] for rank in sends]
    return len(set(nodes)) < len(nodes)


def delegate(copies: Mapping[int, Files], node_of: Sequence[int]) -> dict[int, dict[str, int]]:
    """For each receiving rank (``copies``: the files of the copy it will receive), the
    files it does not ask for, each with the node-mate that receives it instead."""
    by_node: dict[int, list[int]] = {}
    for rank in sorted(copies):
        by_node.setdefault(node_of[rank], []).append(rank)
    out: dict[int, dict[str, int]] = {rank: {} for rank in copies}
    for receivers in by_node.values():
        holders: dict[tuple[str, int, str], list[int]] = {}
        for rank in receivers:
            for name, (size, digest) in copies[rank].items():
                holders.setdefault((name, size, digest), []).append(rank)
        loads = dict.fromkeys(receivers, 0)
        for (name, size, _), ranks in sorted(holders.items(), key=lambda h: (-h[0][1], h[0])):
            if len(ranks) < 2:
                continue
            chosen = min(ranks, key=lambda r: (loads[r], r))
            loads[chosen] += size
            for rank in ranks:
                if rank != chosen:
                    out[rank][name] = chosen
    return out


def parse_files(raw: object) -> dict[str, tuple[int, str]]:
    """A reported ``{name: [size, fingerprint]}`` (JSON from a rank of this job), its
    shape checked; anything else: no files (nothing is delegated for that copy)."""
    if not isinstance(raw, dict):
        return {}
    found = {}
    for name, entry in raw.items():
        if (
            isinstance(name, str)
            and isinstance(entry, list)
            and len(entry) == 2
            and type(entry[0]) is int
            and isinstance(entry[1], str)
        ):
            found[name] = (entry[0], entry[1])
    return found
