"""Carrying out a save plan on one rank: streaming tensor bytes into data files.

Sharded layout (or one rank): each rank writes its own files from memory, with no
communication. Consolidated layout: the consolidating rank writes every file, receiving
other ranks' bytes as raw messages (``consolidate_receiver.py``) that they send
(``consolidate_sender.py``).

Errors are raised, never returned: whatever a rank's writing raises becomes its error in
the write phase, agreed on every rank. A rank whose writing fails removes the files it
created; the other ranks remove theirs once the failure is agreed.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

from ...protocol import Chunk
from ..plan.save_plan import CONSOLIDATING_RANK, FilePlan, SavePlan
from ..storage.protocol import Storage
from .chunk_bytes import ChunkBytes
from .consolidate_receiver import ConsolidatedReceiver
from .consolidate_sender import ConsolidatedSender
from .safetensors_io import StreamWriter
from .written import WriteOptions, WrittenFile, finish, open_file, remove_quietly


class ByteSource(Protocol):
    """Where a writer gets a chunk's bytes: this rank's chunks in memory
    (:class:`~.chunk_bytes.ChunkBytes`), or chunks loaded one at a time as they are written
    (``streaming.LazyChunkBytes``, what the converters use)."""

    def pieces(self, index: int, start: int, end: int) -> Iterator[memoryview]: ...


def write_plan(
    plan: SavePlan,
    rank: int,
    chunks: list[Chunk],
    storage: Storage,
    options: WriteOptions,
    group: Any = None,
) -> dict[str, WrittenFile]:
    """Write this rank's share of ``plan``; return what it wrote, by file name.

    ``group``: the process group the consolidated layout's bytes travel over (``None``:
    the default group; an asynchronous save passes its own, so that it never issues
    operations on the group the training uses).
    """
    sources = ChunkBytes(chunks, options.buffer_bytes)
    if plan.layout == "sharded" or plan.world_size == 1:
        return write_own_files(plan.files_of(rank), sources, storage, options)
    if rank == CONSOLIDATING_RANK:
        return ConsolidatedReceiver(plan, sources, storage, options, group).run()
    return ConsolidatedSender(plan, rank, sources, options, group).run()


def write_own_files(
    files: list[FilePlan], sources: ByteSource, storage: Storage, options: WriteOptions
) -> dict[str, WrittenFile]:
    """Write ``files``, each entry's bytes from its one source chunk, in order; on any
    failure remove them all."""
    results: dict[str, WrittenFile] = {}
    try:
        for fplan in files:
            writer = open_file(fplan, storage, options)
            try:
                for entry in fplan.entries:
                    (src,) = entry.sources
                    _copy(writer, sources.pieces(src.index, 0, src.nbytes))
                results[fplan.name] = finish(writer)
            except BaseException:
                writer.abort()
                raise
    except BaseException:
        remove_quietly(storage, [f.name for f in files])
        raise
    return results


def _copy(writer: StreamWriter, pieces: Iterator[memoryview]) -> None:
    """Write every piece. A function of its own so that no reference to the last piece
    outlives it: a streaming source loads its next chunk only after this returns, and the
    previous chunk must be free by then (one chunk in memory at a time)."""
    for piece in pieces:
        writer.write(piece)
