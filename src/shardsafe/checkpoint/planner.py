"""Who writes what, decided identically on every rank from what every rank offered.

Pure: no process group, no I/O. Input is each rank's list of chunk descriptors (the
shapes of what it holds, not the data); output is the list of data files, their writer
ranks, the tensors in each file and where their bytes come from. For the consolidated
layout it also cuts the bytes that must cross ranks into messages of bounded size.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import CheckpointError
from . import dtypes, geometry

WRITER_RANK = 0
COALESCE_BELOW_BYTES = 1 << 20
"""Chunks smaller than this share messages; larger ones are sent as their own slices."""


@dataclass(frozen=True)
class ChunkInfo:
    """The shape of a chunk one rank offers; ``index`` is its place in that rank's list."""

    rank: int
    index: int
    key: str
    dtype: torch.dtype
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    replicated: bool

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * dtypes.itemsize(self.dtype)

    def to_json(self) -> list[object]:
        return [
            self.key,
            dtypes.dtype_name(self.dtype),
            list(self.global_shape),
            list(self.offsets),
            list(self.shape),
            self.replicated,
        ]

    @staticmethod
    def from_json(rank: int, index: int, raw: list[Any]) -> ChunkInfo:
        key, dtype, gshape, offsets, shape, replicated = raw
        dt = dtypes.from_name(dtype)
        assert dt is not None and isinstance(key, str)
        return ChunkInfo(
            rank, index, key, dt, tuple(gshape), tuple(offsets), tuple(shape), bool(replicated)
        )


@dataclass(frozen=True)
class FileEntry:
    """One tensor in a data file: a chunk (sharded layout) or a whole tensor (consolidated)."""

    name: str
    key: str
    dtype: torch.dtype
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    sources: tuple[ChunkInfo, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * dtypes.itemsize(self.dtype)

    @property
    def streamable(self) -> bool:
        """Its bytes are the sources' bytes concatenated (one source, or a dim-0 split)."""
        return len(self.sources) == 1 or geometry.splits_on_dim0_only(
            self.shape, [(s.offsets, s.shape) for s in self.sources]
        )


@dataclass
class FilePlan:
    name: str
    writer: int
    entries: list[FileEntry] = field(default_factory=list)


@dataclass
class SavePlan:
    layout: str
    world_size: int
    tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]]
    files: list[FilePlan]

    def files_of(self, rank: int) -> list[FilePlan]:
        return [f for f in self.files if f.writer == rank]


def shard_file_name(rank: int, world_size: int) -> str:
    return f"shard-{rank:05d}-of-{world_size:05d}.safetensors"


_PLAIN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,100}")


def consolidated_file_name(value_name: str, position: int) -> str:
    """``model`` -> ``model.safetensors``; names unfit for a file get a numbered one."""
    if _PLAIN_NAME.fullmatch(value_name) and ".." not in value_name:
        return f"{value_name}.safetensors"
    return f"value-{position:03d}.safetensors"


def value_of(key: str) -> str:
    """The state-dict name a tensor key belongs to: ``optimizer/fc.weight/m`` -> ``optimizer``."""
    return key.split("/", 1)[0]


def plan_save(offers: list[list[ChunkInfo]], layout: str, value_order: list[str]) -> SavePlan:
    """Decide the files of a checkpoint. ``offers[r]`` is what rank ``r`` holds."""
    world_size = len(offers)
    by_key: dict[str, list[ChunkInfo]] = {}
    for chunks in offers:
        for c in chunks:
            by_key.setdefault(c.key, []).append(c)
    tensors = {key: _check_key(key, chunks) for key, chunks in by_key.items()}
    if layout == "sharded":
        files = _plan_sharded(by_key, world_size)
    else:
        files = _plan_consolidated(by_key, value_order)
    return SavePlan(layout, world_size, tensors, files)


def _check_key(key: str, chunks: list[ChunkInfo]) -> tuple[torch.dtype, tuple[int, ...]]:
    first = chunks[0]
    for c in chunks[1:]:
        if (c.dtype, c.global_shape) != (first.dtype, first.global_shape):
            raise CheckpointError(
                f"ranks disagree about tensor {key!r}: rank {first.rank} has "
                f"{dtypes.dtype_name(first.dtype)}{list(first.global_shape)}, rank {c.rank} has "
                f"{dtypes.dtype_name(c.dtype)}{list(c.global_shape)}. Every rank must save the "
                "same model structure."
            )
        if c.replicated != first.replicated:
            raise CheckpointError(
                f"tensor {key!r} is replicated on some ranks and sharded on others"
            )
    problem = (
        None
        if first.replicated
        else geometry.tiling_problem(first.global_shape, [(c.offsets, c.shape) for c in chunks])
    )
    if problem is not None:
        raise CheckpointError(
            f"the shards of {key!r} held by ranks {sorted({c.rank for c in chunks})} do not "
            f"cover its shape {list(first.global_shape)} exactly once: they {problem}"
        )
    return first.dtype, first.global_shape


def _plan_sharded(by_key: dict[str, list[ChunkInfo]], world_size: int) -> list[FilePlan]:
    """Every rank writes what only it holds; replicated tensors go to the least-loaded rank."""
    load = [0] * world_size
    assigned: list[list[ChunkInfo]] = [[] for _ in range(world_size)]
    replicated = []
    for key in sorted(by_key):
        chunks = by_key[key]
        if chunks[0].replicated:
            replicated.append(chunks)
            continue
        for c in chunks:
            assigned[c.rank].append(c)
            load[c.rank] += c.nbytes
    for chunks in sorted(replicated, key=lambda cs: (-cs[0].nbytes, cs[0].key)):
        best = min(chunks, key=lambda c: (load[c.rank], c.rank))
        assigned[best.rank].append(best)
        load[best.rank] += best.nbytes
    files = []
    for rank, chunks in enumerate(assigned):
        if not chunks:
            continue
        entries = [
            FileEntry(_chunk_name(c, by_key), c.key, c.dtype, c.offsets, c.shape, (c,))
            for c in sorted(chunks, key=lambda c: (c.key, c.offsets))
        ]
        files.append(FilePlan(shard_file_name(rank, world_size), rank, entries))
    return files


def _chunk_name(c: ChunkInfo, by_key: dict[str, list[ChunkInfo]]) -> str:
    same_rank = [o for o in by_key[c.key] if o.rank == c.rank]
    if len(same_rank) == 1 or c.replicated:
        return c.key
    return f"{c.key}@{','.join(map(str, c.offsets))}"


def _plan_consolidated(
    by_key: dict[str, list[ChunkInfo]], value_order: list[str]
) -> list[FilePlan]:
    """One file per state value, written by rank 0, each tensor whole."""
    files: dict[str, FilePlan] = {}
    file_of: dict[str, str] = {}
    for key in sorted(by_key):
        chunks = by_key[key]
        value = value_of(key)
        if chunks[0].replicated:
            sources: tuple[ChunkInfo, ...] = (min(chunks, key=lambda c: c.rank != WRITER_RANK),)
        else:
            sources = tuple(sorted(chunks, key=lambda c: c.offsets))
        if value not in file_of:
            file_of[value] = _unused_file_name(value, value_order, set(file_of.values()))
        fname = file_of[value]
        plan = files.setdefault(fname, FilePlan(fname, WRITER_RANK))
        name = key[len(value) + 1 :] if key != value else key
        first = chunks[0]
        plan.entries.append(
            FileEntry(
                name, key, first.dtype, (0,) * len(first.global_shape), first.global_shape, sources
            )
        )
    for plan in files.values():
        # Bytes from one rank back to back: fewer, larger messages.
        plan.entries.sort(key=lambda e: (min(s.rank for s in e.sources), e.name))
    return [files[name] for name in sorted(files)]


def _unused_file_name(value: str, value_order: list[str], taken: set[str]) -> str:
    """The value's file name; never one another value already uses (e.g. ``value-000``)."""
    position = value_order.index(value) if value in value_order else len(value_order)
    fname, n = consolidated_file_name(value, position), 0
    while fname in taken:
        n += 1
        fname = f"value-{position:03d}-{n}.safetensors"
    return fname


# ---------------------------------------------------------------------------- transfers


@dataclass(frozen=True)
class Part:
    """Bytes ``[start, end)`` of chunk ``index`` of the sending rank."""

    index: int
    start: int
    end: int


@dataclass
class Message:
    src: int
    parts: list[Part] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(p.end - p.start for p in self.parts)


@dataclass(frozen=True)
class LocalBytes:
    """The writer's own bytes, written straight from its chunk."""

    part: Part


@dataclass(frozen=True)
class Received:
    message: int


@dataclass(frozen=True)
class Assemble:
    """A tensor split on more than dim 0: gathered whole, then written (rare: e.g. TP)."""

    entry: FileEntry
    pieces: tuple[tuple[ChunkInfo, tuple[int, ...]], ...]
    """Each source chunk with the messages carrying it (empty when it is the writer's)."""


Step = LocalBytes | Received | Assemble


def plan_transfers(
    files: list[FilePlan], max_message_bytes: int, writer: int = WRITER_RANK
) -> tuple[list[list[Step]], list[Message]]:
    """Cut what must cross ranks into messages of at most ``max_message_bytes``.

    Returns, per file, the writer's steps in file order, and all messages in the order the
    writer receives them (each sender sends its own messages in that same order).
    """
    messages: list[Message] = []
    steps_per_file: list[list[Step]] = []
    for plan in files:
        steps: list[Step] = []
        open_msg: Message | None = None
        for entry in plan.entries:
            if not entry.streamable:
                open_msg = None
                pieces = []
                for src in entry.sources:
                    ids = () if src.rank == writer else _split(src, messages, max_message_bytes)
                    pieces.append((src, ids))
                steps.append(Assemble(entry, tuple(pieces)))
                continue
            for src in entry.sources:
                if src.rank == writer:
                    open_msg = None
                    if src.nbytes:
                        steps.append(LocalBytes(Part(src.index, 0, src.nbytes)))
                    continue
                # Large chunks travel as slices of themselves (no copy on the sender);
                # only small ones are packed together to save per-message overhead.
                alone = src.nbytes >= COALESCE_BELOW_BYTES
                if alone:
                    open_msg = None
                start = 0
                while start < src.nbytes:
                    if (
                        open_msg is None
                        or open_msg.src != src.rank
                        or open_msg.nbytes >= max_message_bytes
                    ):
                        open_msg = Message(src.rank)
                        messages.append(open_msg)
                        steps.append(Received(len(messages) - 1))
                    take = min(src.nbytes - start, max_message_bytes - open_msg.nbytes)
                    open_msg.parts.append(Part(src.index, start, start + take))
                    start += take
                if alone:
                    open_msg = None
        steps_per_file.append(steps)
    return steps_per_file, messages


def _split(src: ChunkInfo, messages: list[Message], limit: int) -> tuple[int, ...]:
    ids = []
    for start in range(0, max(src.nbytes, 1), limit):
        if src.nbytes == 0:
            break
        messages.append(Message(src.rank, [Part(src.index, start, min(start + limit, src.nbytes))]))
        ids.append(len(messages) - 1)
    return tuple(ids)
