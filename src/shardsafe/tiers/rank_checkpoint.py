"""A rank checkpoint: everything one rank holds, as an ordinary checkpoint.

The local tier must let a rank restore itself from its own node, without reading another
rank's bytes, so it is not deduplicated like a sharded save: each rank writes every
chunk it holds (a DDP rank its whole model), with no process group involved. Each chunk
is stored as a whole tensor of its own shape, so the directory is a checkpoint every
shardsafe tool accepts (``shardsafe verify`` checks it); where each piece sits in its
global tensor is recorded in the manifest's ``info`` (``rank_checkpoint``), with the
rank, the world size and the step.

Loading goes through :func:`view`, which turns that checkpoint back into what the rank
saved: each tensor's global shape with the rank's piece at its offsets, and each entry's
metadata merged by its adapter as if every rank had held this rank's (so a per-rank RNG
entry finds its record at this rank's index). The reader refuses a region the pieces do
not cover (``reader.CheckpointReader._pieces``), so a rank whose sharding differs from the
one that saved gets a :class:`~shardsafe.CheckpointMismatchError`, never a half-filled
tensor.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from ..adapters.registry import adapter_for
from ..checkpoint import streaming
from ..checkpoint.format.manifest import ChunkRecord, Manifest, TensorRecord
from ..checkpoint.format.manifest_format import shape_problem
from ..checkpoint.plan.collecting import Collected
from ..checkpoint.storage.locations import is_url
from ..checkpoint.storage.protocol import Storage
from ..checkpoint.streaming import StreamedChunk, Uncommitted
from ..dtypes import dtype_name
from ..errors import CheckpointCorruptError, CheckpointError, CheckpointMismatchError
from ..protocol import Chunk, SavedValue
from . import partitions

INFO_KEY = "rank_checkpoint"
SMALL_APART_BYTES = 1 << 20
"""Chunks under this size are written to a second data file (``small-...``): a data-parallel
rank's large tensors then fill a file byte-identical to its replicas' on other nodes, which
replication links instead of sending (``transfer.py``); the small file holds what is most
often each rank's own (RNG states, a sampler's generator)."""


def write(
    storage: Storage, items: Collected, *, rank: int, world_size: int, step: int, run: str = ""
) -> int:
    """Write and commit the rank checkpoint of ``items`` (staged copies) into ``storage``;
    return the bytes of the data files written."""
    written = write_uncommitted(
        storage, items, rank=rank, world_size=world_size, step=step, shared=None, run=run
    )
    written.commit({})
    return sum(w["bytes"] for w in written.written.values())


def write_uncommitted(
    storage: Storage,
    items: Collected,
    *,
    rank: int,
    world_size: int,
    step: int,
    shared: Mapping[Candidate, int] | None,
    parts: int = 1,
    own_part: int = 0,
    run: str = "",
    root: str = "",
) -> Uncommitted:
    """The rank checkpoint of ``items`` written but for its commit; with ``shared`` (which
    part of the node each shared chunk is in, ``node_share.py``), the chunks of the other
    parts are left to their writers (their staged tensors hold no data). ``run``: the
    writing manager's :func:`run_of` token; ``root``: its persistent tier (:func:`root_of`)."""
    values: dict[str, SavedValue] = {}
    chunks: list[StreamedChunk] = []
    placements: dict[str, list[list[int]]] = {}
    part_of: dict[int, int] = {}
    for name, (_, item) in items.items():
        values[name] = SavedValue(name, item.kind, item.meta)
        for chunk in item.chunks:
            if chunk.key in placements:
                raise CheckpointError(
                    f"state[{name!r}] gives this rank two pieces of tensor {chunk.key!r}; the "
                    "local tier stores one piece per tensor and rank. Save this state to the "
                    "persistent tier only (local_every=None)"
                )
            placements[chunk.key] = [list(chunk.offsets), list(chunk.global_shape)]
            key = candidate(chunk) if shared else None
            part = shared.get(key) if shared and key is not None else None
            if part is not None:
                part_of[len(chunks)] = part
            shape = tuple(chunk.tensor.shape)
            tensor = chunk.tensor
            chunks.append(
                StreamedChunk(
                    chunk.key,
                    tensor.dtype,
                    shape,
                    (0,) * len(shape),
                    shape,
                    lambda t=tensor: t,  # type: ignore[misc]
                )
            )
    info = {
        "rank": rank,
        "world_size": world_size,
        "step": step,
        "run": run,
        "placements": placements,
    }
    if root:
        info["root"] = root
    partitioned = partitions.recorded(items)
    if partitioned:
        info[partitions.KEY] = partitioned
    return streaming.write_uncommitted(
        storage,
        values,
        chunks,
        background=True,
        extra_info={INFO_KEY: info},
        small_apart=SMALL_APART_BYTES,
        parts=streaming.Parts(part_of, parts, own_part) if part_of else None,
    )


Candidate = tuple[str, str, tuple[int, ...], tuple[int, ...], tuple[int, ...]]
"""A chunk the ranks of a node may share (``node_share.py``): its key, dtype, shape,
offsets and global shape."""


def candidate(chunk: Chunk) -> Candidate | None:
    """``chunk`` as a node's ranks may write it once between them: a replicated chunk of
    at least :data:`SMALL_APART_BYTES`, which every rank holding it holds the same (as
    the persistent tier's saves assume, writing it once in all); not a buffer (each rank
    restores its own), nor a rank's own small state."""
    if not chunk.replicated or chunk.lowest_rank_wins or chunk.per_rank_if_different:
        return None
    tensor = chunk.tensor
    if tensor.numel() * tensor.element_size() < SMALL_APART_BYTES:
        return None
    return (
        chunk.key,
        dtype_name(tensor.dtype),
        tuple(tensor.shape),
        tuple(chunk.offsets),
        tuple(chunk.global_shape),
    )


def saved_by(manifest: Manifest) -> tuple[int, int, int]:
    """``(rank, world_size, step)`` of a rank checkpoint's manifest, validated."""
    info = manifest.info.get(INFO_KEY)
    if not isinstance(info, dict):
        raise CheckpointCorruptError(
            "the manifest is not a rank checkpoint's (no 'rank_checkpoint')"
        )
    fields = [info.get("rank"), info.get("world_size"), info.get("step")]
    rank, world_size, step = (v if type(v) is int and v >= 0 else -1 for v in fields)
    if min(rank, world_size, step) < 0:
        raise CheckpointCorruptError(
            "the manifest's 'rank_checkpoint' does not hold a rank, a world size and a step"
        )
    if rank >= world_size:
        raise CheckpointCorruptError(f"rank {rank} is outside its world size {world_size}")
    return rank, world_size, step


RUN_CHARS = frozenset("0123456789abcdef")
MAX_RUN_CHARS = 64


def run_of(manifest: Manifest) -> str:
    """The token of the run that wrote a rank checkpoint (``""`` for one written before
    tokens were recorded), validated: lower-case hex of at most :data:`MAX_RUN_CHARS`.

    Every rank of one ``TieredCheckpointManager`` writes the same token for one save: the
    run's, agreed when the manager is made (a fresh one per run), then the save's number
    (``replication.save_token``). Copies of one step written by two runs (an abandoned
    run's copy that could not be deleted, beside a resumed run's), or by two saves of the
    step, are never restored together (``recovery.choose``)."""
    info = manifest.info.get(INFO_KEY)
    run = info.get("run", "") if isinstance(info, dict) else ""
    if not isinstance(run, str) or len(run) > MAX_RUN_CHARS or not set(run) <= RUN_CHARS:
        raise CheckpointCorruptError(
            f"the manifest's 'rank_checkpoint' run is not a token of at most {MAX_RUN_CHARS} "
            "lower-case hex digits"
        )
    return run


MAX_ROOT_CHARS = 4096


def root_of(manifest: Manifest) -> str:
    """The persistent tier of the run that wrote a rank checkpoint, as that run's manager
    named it (:func:`persistent_identity`; ``""`` for one written before it was recorded).

    A local directory given to a second run (another ``run_dir``, the same
    ``local_checkpoint_dir``) held the first run's steps, and that run resumed from them,
    by step number alone: another model's weights, optimizer and losses."""
    info = manifest.info.get(INFO_KEY)
    root = info.get("root", "") if isinstance(info, dict) else ""
    if not isinstance(root, str) or len(root) > MAX_ROOT_CHARS:
        raise CheckpointCorruptError(
            f"the manifest's 'rank_checkpoint' root is not a text of at most {MAX_ROOT_CHARS} "
            "characters"
        )
    return root


def persistent_identity(root: str) -> str:
    """What a rank checkpoint records of its run's persistent root: the URL, or the local
    directory with its links resolved (a run given it spelled otherwise is the same run)."""
    return root if is_url(root) else os.path.realpath(root)


def view(state: Mapping[str, Any], *, rank: int, world_size: int) -> Callable[[Manifest], Manifest]:
    """The manifest ``load`` plans from, made from a rank checkpoint's (see the module
    docstring); refuses one saved by another rank or at another world size."""

    def make(manifest: Manifest) -> Manifest:
        saved_rank, saved_world, _ = saved_by(manifest)
        if (saved_rank, saved_world) != (rank, world_size):
            raise CheckpointMismatchError(
                f"this rank checkpoint was saved by rank {saved_rank} of {saved_world}, not "
                f"rank {rank} of {world_size}"
            )
        partitions.refuse_another_partition(manifest, manifest.info[INFO_KEY], state, rank)
        tensors = placed_tensors(manifest)
        values = {name: _as_merged(saved, state, rank) for name, saved in manifest.values.items()}
        return replace(manifest, world_size=world_size, tensors=tensors, values=values)

    return make


def placed_tensors(manifest: Manifest) -> dict[str, TensorRecord]:
    """Each tensor of a rank checkpoint as the piece of its global tensor that it is;
    refuses placements that are not valid (``CheckpointCorruptError``). The survey
    checks them too (``NodeDir.held``): a copy whose placements its load refuses is never
    chosen, where a well-formed manifest with a bad placement was chosen, refused by the
    load, found sound by its checksums, and chosen again at every restart."""
    placements = manifest.info[INFO_KEY].get("placements")
    if not isinstance(placements, dict) or set(placements) != set(manifest.tensors):
        raise CheckpointCorruptError(
            "the rank checkpoint's placements do not name exactly its tensors"
        )
    return {key: _placed(key, rec, placements[key]) for key, rec in manifest.tensors.items()}


def _placed(key: str, rec: TensorRecord, placement: Any) -> TensorRecord:
    """``rec`` (one whole piece) as the piece of its global tensor that it is."""
    chunks = list(rec.chunks)
    ok = (
        len(chunks) == 1
        and isinstance(placement, list)
        and len(placement) == 2
        and all(isinstance(p, list) and len(p) == len(rec.shape) for p in placement)
        and all(type(v) is int and v >= 0 for p in placement for v in p)
    )
    if not ok:
        raise CheckpointCorruptError(f"the rank checkpoint's placement of {key!r} is not valid")
    offsets, global_shape = (tuple(p) for p in placement)
    problem = shape_problem(global_shape, 1)
    outside = any(o + n > g for o, n, g in zip(offsets, rec.shape, global_shape))
    if problem is not None or outside:
        raise CheckpointCorruptError(
            f"the rank checkpoint places {key!r} (shape {list(rec.shape)}) at offsets "
            f"{list(offsets)} of a tensor of shape {list(global_shape)}, which "
            f"{problem or 'does not hold it'}"
        )
    piece = chunks[0]
    if math.prod(piece.shape) != math.prod(rec.shape):  # the parser checked; kept explicit
        raise CheckpointCorruptError(f"the rank checkpoint's piece of {key!r} is not whole")
    placed = ChunkRecord(piece.file, piece.name, offsets, piece.shape, piece.crc32)
    return TensorRecord(rec.dtype, global_shape, (placed,))


def _as_merged(saved: SavedValue, state: Mapping[str, Any], rank: int) -> SavedValue:
    """The entry as a whole-world save records it, had every rank up to this one held
    this rank's metadata; an entry the state does not ask for is left as saved."""
    obj = state.get(saved.name) if saved.name in state else None
    if obj is None:
        return saved
    adapter, obj = adapter_for(obj, saved.name)
    if adapter.kind != saved.kind:
        return saved  # the planner refuses it, naming both kinds
    try:  # metadata read from disk, not yet validated: a failure is corruption
        meta = adapter.merge([saved.meta] * (rank + 1))
    except (CheckpointCorruptError, CheckpointMismatchError):
        raise
    except Exception as e:
        raise CheckpointCorruptError(
            f"{saved.entry} (a {saved.kind!r} value) is malformed: "
            f"{type(adapter).__name__}.merge failed with {type(e).__name__}: {e}"
        ) from e
    return SavedValue(saved.name, saved.kind, meta)
