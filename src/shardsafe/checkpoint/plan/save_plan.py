"""The save plan: who writes which data files, decided identically on every rank from
what every rank offered (``offer.py``).

Pure: no process group, no I/O. Input is each rank's chunk offers (the shapes of what
it holds, not the data); output is the list of data files, the rank that writes each, the
tensors in each file and where their bytes come from. How bytes that live on other ranks
reach the writer of a consolidated file is ``transfers.py``'s job.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass, field

import torch

from ... import dtypes
from ...errors import CheckpointError
from ..format import geometry
from ..format.manifest_format import Layout
from .offer import ChunkOffer

CONSOLIDATING_RANK = 0
"""The rank that writes every file of a consolidated checkpoint."""


@dataclass(frozen=True)
class FileEntry:
    """One tensor in a data file: a chunk (sharded layout) or a whole tensor (consolidated)."""

    name: str
    key: str
    dtype: torch.dtype
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    sources: tuple[ChunkOffer, ...]

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
    layout: Layout
    world_size: int
    tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]]
    files: list[FilePlan]

    def files_of(self, rank: int) -> list[FilePlan]:
        return [f for f in self.files if f.writer == rank]


def shard_file_name(rank: int, world_size: int) -> str:
    return f"shard-{rank:05d}-of-{world_size:05d}.safetensors"


def small_file_name(file_name: str) -> str:
    """The file the small chunks of ``file_name`` are set apart in (:func:`set_apart_small`):
    ``shard-00000-of-00001.safetensors`` -> ``small-00000-of-00001.safetensors``."""
    return "small-" + file_name.removeprefix("shard-")


def set_apart_small(plan: SavePlan, below: int) -> SavePlan:
    """``plan`` with each file's chunks of fewer than ``below`` bytes moved to a second
    file of the same writer (:func:`small_file_name`).

    Why: a node-local rank checkpoint of a data-parallel rank holds the same large tensors
    as its peers' but its own small ones (RNG states, a sampler's generator). Kept apart,
    the large tensors' file is byte-identical between replicas, so a peer that already
    holds it needs none of its bytes sent (``tiers/transfer.py``)."""
    files: list[FilePlan] = []
    for f in plan.files:
        large = [e for e in f.entries if e.nbytes >= below]
        small = [e for e in f.entries if e.nbytes < below]
        if large and small:
            files.append(FilePlan(f.name, f.writer, large))
            files.append(FilePlan(small_file_name(f.name), f.writer, small))
        else:
            files.append(f)
    return SavePlan(plan.layout, plan.world_size, plan.tensors, files)


def part_file_name(part: int, parts: int) -> str:
    """The file of part ``part`` of ``parts`` of a node's shared chunks
    (:func:`split_into_parts`)."""
    return f"part-{part:05d}-of-{parts:05d}.safetensors"


def split_into_parts(plan: SavePlan, part_of: dict[int, int], parts: int) -> SavePlan:
    """``plan`` (one writer's) with each entry whose chunk ``part_of`` names (by offer
    index) moved to the file of its part (:func:`part_file_name`), in the plan's order.

    Why: the ranks of one node holding the same data-parallel tensors each write one
    part of them, and link the others' part files into their own rank checkpoint
    (``tiers/node_share.py``); every rank's plan of a part is then the same file."""
    files: list[FilePlan] = []
    moved: dict[int, FilePlan] = {}
    for f in plan.files:
        kept = [e for e in f.entries if part_of.get(e.sources[0].index) is None]
        for e in f.entries:
            part = part_of.get(e.sources[0].index)
            if part is not None:
                name = part_file_name(part, parts)
                moved.setdefault(part, FilePlan(name, f.writer)).entries.append(e)
        if kept:
            files.append(FilePlan(f.name, f.writer, kept))
    files.extend(moved[part] for part in sorted(moved))
    return SavePlan(plan.layout, plan.world_size, plan.tensors, files)


_PLAIN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,100}")


def consolidated_file_name(value_name: str, position: int) -> str:
    """``model`` -> ``model.safetensors``; names unfit for a file get a numbered one (as
    does ``ema.``, whose ``ema..safetensors`` the manifest's checks refuse: its save was
    refused as "malformed", found in review)."""
    if _PLAIN_NAME.fullmatch(value_name) and ".." not in f"{value_name}.":
        return f"{value_name}.safetensors"
    return f"value-{position:03d}.safetensors"


def entry_of(key: str) -> str:
    """The state entry a tensor key belongs to: ``optimizer/fc.weight/m`` -> ``optimizer``."""
    return key.split("/", 1)[0]


def plan_save(offers: list[list[ChunkOffer]], layout: Layout, value_order: list[str]) -> SavePlan:
    """Decide the files of a checkpoint. ``offers[r]`` is what rank ``r`` holds."""
    world_size = len(offers)
    by_key: dict[str, list[ChunkOffer]] = {}
    for chunks in offers:
        for c in chunks:
            by_key.setdefault(c.key, []).append(c)
    tensors = {key: _check_key(key, chunks) for key, chunks in by_key.items()}
    if layout == "sharded":
        files = _plan_sharded(by_key, world_size)
    else:
        files = _plan_consolidated(by_key, value_order)
    _refuse_reserved_names(files)
    return SavePlan(layout, world_size, tensors, files)


RESERVED_NAME = "__metadata__"
"""The one name a safetensors header keeps for itself: no tensor can be stored under it."""


def _refuse_reserved_names(files: list[FilePlan]) -> None:
    """Refuse a tensor whose name in its data file would be ``__metadata__``.

    A safetensors header holds its metadata under that key, so a tensor of that name
    would replace it, and every reader (shardsafe's, safetensors') refuses the file: the
    save would commit a checkpoint that never loads. Refused while planning, before
    anything is written, naming the key (the whole key in the sharded layout; the key
    past its state entry's name in the consolidated one)."""
    for f in files:
        for e in f.entries:
            if e.name == RESERVED_NAME:
                raise CheckpointError(
                    f"cannot save tensor {e.key!r}: it would be stored as {RESERVED_NAME!r} "
                    f"in {f.name}, the name a safetensors header keeps for its metadata, "
                    "and the checkpoint could not be loaded. Rename it (or, for a plain "
                    "tensor, nest it under another name); nothing was written"
                )


def _check_key(key: str, chunks: list[ChunkOffer]) -> tuple[torch.dtype, tuple[int, ...]]:
    first = chunks[0]
    for c in chunks[1:]:
        if (c.dtype, c.global_shape) != (first.dtype, first.global_shape):
            raise CheckpointError(
                f"ranks disagree about tensor {key!r}: rank {first.rank} has "
                f"{dtypes.dtype_name(first.dtype)}{list(first.global_shape)}, rank {c.rank} has "
                f"{dtypes.dtype_name(c.dtype)}{list(c.global_shape)}. Every rank must save the "
                "same model structure."
            )
        if (c.replicated, c.lowest_rank_wins, c.copies_allowed) != (
            first.replicated, first.lowest_rank_wins, first.copies_allowed,
        ):  # fmt: skip
            how = (
                "replicated on some ranks and sharded on others"
                if c.replicated != first.replicated
                else "a buffer (the lowest rank's copy) on some ranks and a replica on others"
                if c.lowest_rank_wins != first.lowest_rank_wins
                else "a DTensor shard on some ranks and another rank's own tensor on others"
            )
            raise CheckpointError(
                f"tensor {key!r} is {how} (ranks {first.rank} and {c.rank}): every rank "
                "holding a key must hold it the same way"
            )
    if first.replicated:
        if not first.lowest_rank_wins:
            _check_replicas(key, chunks)
            _check_samples(key, chunks)
        return first.dtype, first.global_shape
    copies = copies_of(chunks)
    for same in copies:
        _check_replicas(key, same)
        _check_samples(key, same)
    problem = geometry.tiling_problem(
        first.global_shape, [(c[0].offsets, c[0].shape) for c in copies]
    )
    if problem is not None:
        raise CheckpointError(
            f"the shards of {key!r} held by ranks {sorted({c.rank for c in chunks})} do not "
            f"cover its shape {list(first.global_shape)} exactly once: they {problem}"
        )
    return first.dtype, first.global_shape


def copies_of(chunks: list[ChunkOffer]) -> list[list[ChunkOffer]]:
    """A sharded tensor's chunks, grouped by the box they cover: ranks offering the same
    box hold copies of one shard, stored once. HSDP's replicas hold copies (a ``Replicate``
    mesh dimension), and so do sibling submeshes: under TP x FSDP2 a parameter tensor
    parallelism leaves whole is sharded over each ``dp`` submesh, so every ``tp`` rank
    holds the shard of its ``dp`` coordinate. (Boxes that overlap without being equal are
    still refused, and so are equal boxes of chunks that are not DTensor shards,
    ``copies_allowed``: two ranks' own state under one key.)"""
    if not chunks[0].copies_allowed:
        return [[c] for c in chunks]
    groups: dict[tuple[tuple[int, ...], tuple[int, ...]], list[ChunkOffer]] = {}
    for c in chunks:
        groups.setdefault((c.offsets, c.shape), []).append(c)
    return list(groups.values())


def _check_replicas(key: str, chunks: list[ChunkOffer]) -> None:
    """Every holder of a replicated tensor (or of copies of one shard) that checksummed its
    copy (``verify_replicas``, or ``Chunk.always_verify``) has the same bytes."""
    shown = _versions({c.rank: c.checksum for c in chunks if c.checksum is not None})
    if shown is not None:
        raise CheckpointError(
            f"the copies of {key!r} differ between ranks: {shown}. It is "
            f"saved as {_saved_as(chunks[0])}, so either the replicas have diverged (e.g. "
            "a gradient not all-reduced, or a rank-dependent update), or it is state each "
            "rank keeps for itself, which shardsafe keeps per rank only for a stateful "
            "object's tensors of up to 64 KiB (a sampler's generator): hold larger "
            "per-rank state as a DTensor sharded over the ranks; nothing was written"
        )


def _check_samples(key: str, chunks: list[ChunkOffer]) -> None:
    """Every holder of a module's or an optimizer's replicated tensor has the same sampled
    elements (``offer.sample_checksums``). Ranks that each name different tensors alike
    (pipeline stages numbering their layers from 0) saved one rank's under the name, and
    the load gave every stage that rank's layer, and mixed optimizer state, with no error."""
    shown = _versions({c.rank: c.sample for c in chunks if c.sample is not None})
    if shown is not None:
        raise CheckpointError(
            f"the copies of {key!r} differ between ranks: {shown} (sampled elements). It "
            f"is saved as {_saved_as(chunks[0])}. If the ranks hold different tensors "
            "under one name (pipeline stages that number their layers from 0, experts "
            "numbered per rank), name them by their global index (stage s's layer i as "
            "layers.{s * layers_per_stage + i}), as a checkpoint loaded at another split "
            "needs; if they are replicas, they have diverged (e.g. a gradient not "
            "all-reduced, or a rank-dependent update). Nothing was written"
        )


def _versions(by_rank: dict[int, int]) -> str | None:
    """Which ranks hold which version of a copy (``None`` if they all hold one)."""
    by_crc: dict[int, list[int]] = {}
    for rank, crc in by_rank.items():
        by_crc.setdefault(crc, []).append(rank)
    if len(by_crc) < 2:
        return None
    groups = sorted(by_crc.values())
    holders = [("ranks " if len(r) > 1 else "rank ") + ", ".join(map(str, r)) for r in groups]
    verb = "hold" if len(groups[0]) > 1 else "holds"
    others = ", ".join(f"{h} another" for h in holders[1:])
    return f"{holders[0]} {verb} one version, {others}"


def _saved_as(first: ChunkOffer) -> str:
    return (
        "one tensor replicated on all of them"
        if first.shape == first.global_shape
        else f"one shard (offsets {list(first.offsets)}, shape {list(first.shape)}) "
        "that each of them holds"
    )


def _plan_sharded(by_key: dict[str, list[ChunkOffer]], world_size: int) -> list[FilePlan]:
    """Every rank writes what only it holds; a replicated tensor (or a shard several ranks
    hold copies of) goes to the least-loaded of the ranks holding it (all ranks under DDP,
    a stage's data-parallel group under pipeline parallelism), largest first, so writers
    stay balanced; a buffer (``lowest_rank_wins``) to the lowest rank holding it."""
    load = [0] * world_size
    assigned: list[list[ChunkOffer]] = [[] for _ in range(world_size)]
    replicated = []
    for key in sorted(by_key):
        chunks = by_key[key]
        if chunks[0].replicated:
            replicated.append(chunks)
            continue
        for same in copies_of(chunks):
            if len(same) > 1:  # copies of one shard: placed like a replicated tensor
                replicated.append(same)
                continue
            (c,) = same
            assigned[c.rank].append(c)
            load[c.rank] += c.nbytes
    for chunks in sorted(replicated, key=lambda cs: (-cs[0].nbytes, cs[0].key, cs[0].offsets)):
        if chunks[0].lowest_rank_wins:
            best = min(chunks, key=lambda c: c.rank)
        else:
            best = min(chunks, key=lambda c: (load[c.rank], c.rank))
        assigned[best.rank].append(best)
        load[best.rank] += best.nbytes
    held = Counter((c.key, c.rank) for chunks in by_key.values() for c in chunks)
    files = []
    for rank, chunks in enumerate(assigned):
        if not chunks:
            continue
        entries = [
            FileEntry(_chunk_name(c, held), c.key, c.dtype, c.offsets, c.shape, (c,))
            for c in sorted(chunks, key=_whole_first)
        ]
        files.append(FilePlan(shard_file_name(rank, world_size), rank, entries))
    return files


def _whole_first(c: ChunkOffer) -> tuple[bool, str, tuple[int, ...]]:
    """A file's order: whole tensors first, by key, then pieces of tensors, by key.

    A load reads a file in this order too (``loading._in_file_order``, which sees only the
    manifest, hence "whole" rather than "replicated"). It puts the replicated tensors that
    every rank of a load reads (FSDP2's AdamW ``step`` scalars) together right after the
    header, served by the header's own ranged GET; in key order they would be spread over
    the whole file, each read costing a GET of another rank's shards."""
    return (c.shape != c.global_shape, c.key, c.offsets)


def _chunk_name(c: ChunkOffer, held: Counter[tuple[str, int]]) -> str:
    """``c.key``, with its offsets added where its rank holds several pieces of the tensor
    (``held``: how many pieces of each key each rank offers, counted once per plan; a scan
    of every offer of the key for each chunk took ranks^2 steps per FSDP2 tensor)."""
    if held[(c.key, c.rank)] == 1 or c.replicated:
        return c.key
    return f"{c.key}@{','.join(map(str, c.offsets))}"


def _plan_consolidated(
    by_key: dict[str, list[ChunkOffer]], value_order: list[str]
) -> list[FilePlan]:
    """One file per state value, written by rank 0, each tensor whole."""
    files: dict[str, FilePlan] = {}
    file_of: dict[str, str] = {}
    for key in sorted(by_key):
        chunks = by_key[key]
        value = entry_of(key)
        if chunks[0].replicated:
            sources: tuple[ChunkOffer, ...] = (  # rank 0's if it holds one, else the lowest
                min(chunks, key=lambda c: (c.rank != CONSOLIDATING_RANK, c.rank)),
            )
        else:  # one copy of each shard, rank 0's if it holds one, else the lowest's
            sources = tuple(
                sorted(
                    (min(same, key=lambda c: (c.rank != CONSOLIDATING_RANK, c.rank))
                     for same in copies_of(chunks)),
                    key=lambda c: c.offsets,
                )
            )  # fmt: skip
        if value not in file_of:
            file_of[value] = _unused_file_name(value, value_order, set(file_of.values()))
        fname = file_of[value]
        plan = files.setdefault(fname, FilePlan(fname, CONSOLIDATING_RANK))
        name = key[len(value) + 1 :] if key != value else key
        if not name:
            raise CheckpointError(_unnamed_in_consolidated(value))
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


def _unnamed_in_consolidated(value: str) -> str:
    """A tensor under the empty key ``""`` right below its entry: a consolidated file names
    each tensor by its key inside the entry (what safetensors' readers see), and ``""``
    is no name. The check of the manifest refused it after writing, naming neither."""
    return (
        f"cannot save state[{value!r}] with layout='consolidated': it holds a tensor under the "
        f"empty key '', which a consolidated file cannot name (each tensor in "
        f"{value}'s file is named by its key); rename that key, or save with layout='sharded' "
        "(nothing was written)"
    )


def _unused_file_name(value: str, value_order: list[str], taken: set[str]) -> str:
    """The value's file name; never one another value already uses (e.g. ``value-000``)."""
    position = value_order.index(value) if value in value_order else len(value_order)
    fname, n = consolidated_file_name(value, position), 0
    while fname in taken:
        n += 1
        fname = f"value-{position:03d}-{n}.safetensors"
    return fname
