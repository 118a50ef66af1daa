"""The ranks of one node write the large data-parallel tensors they all hold once between
them, not once each.

Under DDP every rank holds the same parameters and optimizer state, and a rank
checkpoint holds all of its rank's state (so that the rank restores from its own node).
Written by every rank, each byte is staged (the training loop's stall), checksummed and
written once per rank of the node. Instead, each rank of a node stages and writes one
part of the large replicated chunks (``rank_checkpoint.candidate``) into a part file
(``part-<i>-of-<n>``), and hard-links the other ranks' part files into its own rank
directory before committing its manifest. Every rank directory is still a whole rank
checkpoint, restored, verified and replicated as before; the node stores the shared
bytes once, and each rank stages ``1/n`` of them.

How the ranks of a node agree, without a collective in the training loop: each local
write ends with an exchange among the node's ranks, over the tiers' gloo group, from the
writer thread (:meth:`NodeShare.settle`): whether the rank's part was written, its part
file's checksums and identity, and a digest of the chunks it could share. The split of
the *next* save follows from those, the same on every rank of the node: the chunks every
rank holds, each given to one rank, largest first to the rank with the fewest bytes so
far. The first local save's split is agreed before it stages, in the exchange of the
tiers' space check (:meth:`NodeShare.offer`, :meth:`NodeShare.start`): a node whose
ranks all can link and hold the same chunks shares from its first save on; otherwise
that save (like the one after a rank's snapshot failed) writes every chunk on every
rank. A chunk new since the last save is written by every rank holding it, and later
ones share (also after a failed write: its chunks were known). Data-parallel
ranks on other nodes compute the same split, so their part files are byte-identical and
replication still links them instead of sending them (``transfer.py``).

A part file is linked as its writer reported it: a regular file of the reported size,
the inode its writer stat-ed after writing it (a link or another file swapped in is
refused). Its bytes are not read again here: the committed manifest carries its
writer's checksums, and every load checks every byte against them, so a part damaged
later is found where any damaged file is (and the load falls back to the next source).
A chunk counts as the same on every rank when its key, dtype, shape and place are, as
the persistent tier's saves assume when they write a replicated tensor once in all.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..checkpoint.io.written import WrittenFile
from ..checkpoint.plan.collecting import Collected
from ..checkpoint.plan.save_plan import part_file_name
from ..checkpoint.storage.local import LocalStorage
from ..checkpoint.streaming import Uncommitted
from ..errors import CheckpointError
from .node_dir import NodeDir
from .rank_checkpoint import Candidate, candidate
from .ranks import steps_differ

NODE = 3
"""The gloo tag of the node's exchanges (``transfer.py`` uses 1 and 2)."""

MAX_MESSAGE_BYTES = 1 << 30
"""The largest exchange message taken from a node-mate (a digest, a few files' block
checksums; the candidates themselves only when the node's ranks disagree)."""


@dataclass(frozen=True)
class Split:
    """Which part (a rank's position on its node) writes each shared chunk."""

    part_of: dict[Candidate, int]
    parts: int


def candidates(items: Collected) -> dict[Candidate, int]:
    """The chunks of ``items`` a node's ranks may share, with their bytes."""
    found: dict[Candidate, int] = {}
    for _, item in items.values():
        for chunk in item.chunks:
            key = candidate(chunk)
            if key is not None:
                found[key] = chunk.tensor.numel() * chunk.tensor.element_size()
    return found


def split(shared: Mapping[Candidate, int], parts: int) -> Split | None:
    """Give each chunk to one of ``parts`` ranks, largest first to the rank with the
    fewest bytes so far (ties: the lowest position): the same on every rank given the
    same chunks. ``None`` if there is nothing to share."""
    if parts < 2 or not shared:
        return None
    loads = [0] * parts
    part_of: dict[Candidate, int] = {}
    for key in sorted(shared, key=lambda c: (-shared[c], c)):
        part = min(range(parts), key=lambda p: (loads[p], p))
        part_of[key] = part
        loads[part] += shared[key]
    return Split(part_of, parts)


def _digest(shared: Mapping[Candidate, int]) -> str:
    listed = sorted([list(_as_lists(c)), n] for c, n in shared.items())
    return hashlib.sha256(json.dumps(listed).encode()).hexdigest()


def _as_lists(c: Candidate) -> tuple[Any, ...]:
    return (c[0], c[1], list(c[2]), list(c[3]), list(c[4]))


def _as_candidate(raw: Any) -> Candidate:
    key, dtype, shape, offsets, global_shape = raw
    return (str(key), str(dtype), tuple(shape), tuple(offsets), tuple(global_shape))


@dataclass(frozen=True)
class Linked:
    """The other ranks' part files linked into a rank checkpoint: their writers' records
    (for the manifest) and their identities (device, inode), checked."""

    records: dict[str, WrittenFile]
    identities: dict[str, tuple[int, int]]


class NodeShare:
    """One rank's side of its node's sharing (see the module docstring)."""

    def __init__(self, node: NodeDir, rank: int, mates: list[int]) -> None:
        self.node, self.rank, self.mates = node, rank, list(mates)
        self.position = self.mates.index(rank)
        self.split: Split | None = None
        """The split of the next local save (``None``: every rank writes every chunk)."""
        self.broken = False
        self.links: bool | None = None
        """Whether hard links work in the node's directory (probed at the first exchange:
        where they do not, the node's ranks never share, and each writes all it holds)."""

    @property
    def active(self) -> bool:
        return len(self.mates) > 1 and not self.broken

    def offer(self, shared: Mapping[Candidate, int]) -> dict[str, Any]:
        """What this rank tells the others before its first local save (in the budget's
        exchange, so that the first save shares too): whether hard links work here
        (probed now), a digest of the chunks it could share, and their bytes."""
        try:
            self.links = self.node.links_work(self.rank)
        except (CheckpointError, OSError):
            self.links = False
        return {"links": self.links, "digest": _digest(shared), "bytes": sum(shared.values())}

    def start(self, shared: Mapping[Candidate, int], offers: list[Any]) -> None:
        """The first save's split, from every node-mate's :meth:`offer` (by position):
        of this rank's chunks if every rank of the node holds the same ones and can
        link, else none (the first save is then whole, and the exchange after it sets the
        next save's split, as after any save)."""
        self.split = split(shared, len(self.mates)) if first_shares(offers) else None

    def keep(self, items: Collected) -> set[int] | None:
        """The chunks (by offer index) this rank stages for the next save: all but the
        other parts' shared ones; ``None``: all."""
        current = self.split if self.active else None
        if current is None:
            return None
        kept: set[int] = set()
        index = 0
        for _, item in items.values():
            for chunk in item.chunks:
                key = candidate(chunk)
                if key is None or current.part_of.get(key, self.position) == self.position:
                    kept.add(index)
                index += 1
        return kept

    def settle(
        self,
        group: Any,
        step: int,
        shared: Mapping[Candidate, int] | None,
        written: Uncommitted | None,
        storage: LocalStorage | None,
    ) -> Linked:
        """After this rank's write of ``step`` (``written``, ``None`` if it failed; its
        shareable chunks ``shared``, ``None`` if unknown): exchange with the node's other
        ranks, set the next save's split, and link their part files that ``written``
        lacks into ``storage``; return those (:class:`Linked`). Raises if one is missing
        (that rank's write failed): the step is then not committed here either. A failed
        exchange (a rank gone) stops sharing for good."""
        try:
            own = _own_part(written, storage, part_file_name(self.position, len(self.mates)))
            lost: OSError | None = None
        except OSError as e:  # its part gone since written: still exchange (the others
            own, lost = ({}, {}), e  # wait for it, and would take the next one for this)
        if self.links is None:
            try:
                self.links = self.node.links_work(self.rank)
            except (CheckpointError, OSError):
                self.links = False
        message = {
            "links": self.links,
            "step": step,
            "ok": written is not None and lost is None,
            "files": own[0],
            "inodes": own[1],
            "digest": _digest(shared) if shared is not None else None,
        }
        try:
            messages = [_parsed(m) for m in self._exchange(group, message)]
            digests = [m["digest"] for m in messages]
            lists: list[Any] | None = None
            if None not in digests and len(set(digests)) > 1:  # every rank sees the same
                listed = [[list(_as_lists(c)), n] for c, n in (shared or {}).items()]
                lists = [m["shared"] for m in self._exchange(group, {"shared": listed})]
        except Exception as e:
            self.broken, self.split = True, None
            raise CheckpointError(
                f"rank {self.rank} stopped sharing its node's data-parallel tensors with "
                f"ranks {[m for m in self.mates if m != self.rank]}: the exchange after step "
                f"{step} failed: {type(e).__name__}: {e}. From here on it writes all of its "
                "state itself"
            ) from e
        links = all(m.get("links") is not False for m in messages)
        self.split = _next_split(shared, digests, lists, len(self.mates)) if links else None
        for position, theirs in enumerate(messages):
            if theirs["step"] != step:
                raise steps_differ(step, self.rank, theirs["step"], self.mates[position])
        if lost is not None:
            raise lost
        if written is None or storage is None or not written.elsewhere:
            return Linked({}, {})
        return self._link(step, written, storage, messages)

    def _link(
        self, step: int, written: Uncommitted, storage: LocalStorage, messages: list[Any]
    ) -> Linked:
        linked = Linked({}, {})
        positions = {part_file_name(p, len(self.mates)): p for p in range(len(self.mates))}
        for name, entries in written.elsewhere.items():
            position = positions.get(name)
            if position is None or position == self.position:
                raise CheckpointError(f"{name!r} is not another rank's part file")
            mate = self.mates[position]
            theirs = messages[position]
            record = theirs["files"].get(name) if theirs["ok"] else None
            if record is None or sorted(record.get("crc", {})) != sorted(entries):
                raise CheckpointError(
                    f"rank {mate}, on this node, has no part {position} of the node's shared "
                    f"tensors of step {step} (its write failed, or it held other tensors)"
                )
            identity = self.node.link_reported(
                step,
                mate,
                name,
                storage,
                reported=(theirs["inodes"].get(name) or [], record.get("bytes", -1)),
                what=f"the part file rank {mate} wrote",
                gone="its write of the step failed after the exchange, or the step is being "
                "saved again",
            )
            linked.records[name] = record
            linked.identities[name] = identity
        # The links' names durable before the manifest that names them is committed (the
        # files' bytes are: their writers finished them before the exchange).
        storage.sync_directory()
        return linked

    def _exchange(self, group: Any, message: dict[str, Any]) -> list[Any]:
        """Every rank of the node's ``message``, by position (this one's included)."""
        payload = json.dumps(message).encode()
        others = [m for m in self.mates if m != self.rank]
        length = torch.tensor([len(payload)], dtype=torch.int64)
        lengths = {m: torch.zeros(1, dtype=torch.int64) for m in others}
        _all(
            [dist.isend(length, m, group=group, tag=NODE) for m in others]
            + [dist.irecv(lengths[m], m, group=group, tag=NODE) for m in others]
        )
        sizes = {m: int(n.item()) for m, n in lengths.items()}
        for mate, size in sizes.items():
            if not 0 < size <= MAX_MESSAGE_BYTES:
                raise CheckpointError(f"rank {mate} announced a message of {size} bytes")
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        buffers = {m: torch.empty(sizes[m], dtype=torch.uint8) for m in others}
        _all(
            [dist.isend(data, m, group=group, tag=NODE) for m in others]
            + [dist.irecv(buffers[m], m, group=group, tag=NODE) for m in others]
        )
        return [
            message if m == self.rank else json.loads(buffers[m].numpy().tobytes())
            for m in self.mates
        ]


def first_shares(offers: list[Any]) -> bool:
    """Whether a node whose ranks made these :meth:`NodeShare.offer` s shares its first
    save: every rank can link and holds the same shareable chunks, some."""
    return (
        len(offers) > 1
        and all(isinstance(o, dict) and o.get("links") is True for o in offers)
        and len({o.get("digest") for o in offers}) == 1
        and all(o.get("bytes") == offers[0].get("bytes") for o in offers)
        and isinstance(offers[0].get("bytes"), int)
        and offers[0]["bytes"] > 0
    )


def _all(works: list[Any]) -> None:
    for work in works:
        work.wait()


def _own_part(
    written: Uncommitted | None, storage: LocalStorage | None, name: str
) -> tuple[dict[str, Any], dict[str, list[int]]]:
    """This rank's part file ``name`` if it wrote one: its record, and its identity
    (``stat`` by name in ``storage``, where this rank wrote it, right after writing it)."""
    if written is None or storage is None or name not in written.written:
        return {}, {}
    found = os.stat(name, dir_fd=storage.fd, follow_symlinks=False)
    return {name: written.written[name]}, {name: [found.st_dev, found.st_ino]}


def _parsed(message: Any) -> dict[str, Any]:
    """A node-mate's message, its shape checked (it is this library's, from this job)."""
    ok = (
        isinstance(message, dict)
        and type(message.get("step")) is int
        and isinstance(message.get("ok"), bool)
        and isinstance(message.get("files"), dict)
        and isinstance(message.get("inodes"), dict)
        and (message.get("digest") is None or isinstance(message.get("digest"), str))
    )
    if not ok:
        raise CheckpointError("a node-mate's message is not one this version sends")
    return dict(message)


def _next_split(
    shared: Mapping[Candidate, int] | None,
    digests: list[str | None],
    lists: list[Any] | None,
    parts: int,
) -> Split | None:
    """The split of the next save: of this rank's chunks if every rank of the node holds
    the same ones; of those every rank holds if they differ; none if a rank's are
    unknown (its save failed before collecting them)."""
    if shared is None or None in digests:
        return None
    if lists is None:
        return split(shared, parts)
    common: dict[Candidate, int] | None = None
    for listed in lists:
        held = {_as_candidate(c): int(n) for c, n in listed}
        common = held if common is None else {c: n for c, n in common.items() if held.get(c) == n}
    return split(common or {}, parts)
