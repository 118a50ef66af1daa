"""shardsafe checkpoints as a converter's source and destination.

Reading goes through :class:`~shardsafe.checkpoint.io.reader.CheckpointReader`: byte-range
reads, every block CRC-checked, a tensor assembled from the chunks of however many ranks
wrote it (FSDP2, ZeRO, any world size). Writing goes through
``checkpoint.streaming.write_checkpoint``: ``save``'s planner, writer and commit
(manifest last), then a full verify.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..checkpoint.format.manifest import Manifest
from ..checkpoint.format.safetensors_header import build_header
from ..checkpoint.io.reader import CheckpointReader
from ..checkpoint.loading import read_manifest_from
from ..checkpoint.plan.offer import ChunkOffer
from ..checkpoint.plan.rank_copies import rank_copy_as_one_rank
from ..checkpoint.plan.save_plan import plan_save
from ..checkpoint.storage.protocol import Storage
from ..checkpoint.streaming import StreamedChunk, write_checkpoint
from ..checkpoint.verifying import entry_problems
from .source import Source, SourceChunk, SourceTensor, single_value


def read(storage: Storage) -> Source:
    """The checkpoint in ``storage`` as a :class:`Source` (the manifest read and checked)."""
    manifest = read_manifest_from(storage)
    reader = CheckpointReader(storage, manifest)
    tensors = {}
    for key, rec in manifest.tensors.items():
        chunks = tuple(
            SourceChunk(c.offsets, c.shape, _reading(reader, key, c.offsets, c.shape))
            for c in rec.chunks
        )
        whole = _reading(reader, key, None, None)
        tensors[key] = SourceTensor(key, rec.dtype, rec.shape, chunks, whole)
    one_rank = rank_copy_as_one_rank(manifest)  # a tiered manager's copy: one rank
    refused = entry_problems(one_rank)
    return Source("shardsafe", storage.directory, one_rank.values, tensors, [reader.close], refused)


def _reading(
    reader: CheckpointReader,
    key: str,
    offsets: tuple[int, ...] | None,
    shape: tuple[int, ...] | None,
) -> Callable[[], torch.Tensor]:
    return lambda: reader.read(key, offsets, shape)


def write(
    source: Source, storage: Storage, on_bytes: Callable[[int], None] | None = None
) -> Manifest:
    """Write ``source`` as a committed, verified shardsafe checkpoint, chunk by chunk.

    Chunks are kept as the source stored them (a DCP checkpoint's shards stay shards), so
    each is read once and memory is one chunk; ``shardsafe.load`` reshards at any world
    size. Every entry is written as one record, as a checkpoint of world size 1 holds it
    (the converter chose saving rank 0's of per-rank copies: ``single_values``); one
    recorded per rank otherwise is refused by name (no load at world size 1 would take it).
    """
    _one_record_each(source)
    chunks = [
        StreamedChunk(t.key, t.dtype, t.shape, c.offsets, c.shape, c.load, c.release)
        for t in source.tensors.values()
        for c in t.chunks
    ]
    return write_checkpoint(storage, source.values, chunks, on_bytes=on_bytes)


def planned_files(source: Source) -> list[tuple[str, int]]:
    """What :func:`write` would write: each data file and its exact size (``--dry-run``;
    the manifest, written last, is not sized until then)."""
    _one_record_each(source)
    offers = [
        ChunkOffer(0, i, t.key, t.dtype, t.shape, c.offsets, c.shape, False)
        for i, (t, c) in enumerate((t, c) for t in source.tensors.values() for c in t.chunks)
    ]
    plan = plan_save([offers], "sharded", list(source.values))
    files = []
    for fplan in plan.files:
        header = build_header([(e.name, e.dtype, e.shape) for e in fplan.entries])
        files.append((fplan.name, len(header) + sum(e.nbytes for e in fplan.entries)))
    return files


def _one_record_each(source: Source) -> None:
    """Refuse, by name, an entry recorded per rank (see :func:`write`)."""
    for name, value in source.values.items():
        single_value(value.meta, name)
