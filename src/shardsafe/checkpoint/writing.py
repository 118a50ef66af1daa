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

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol, TypedDict

from ..protocol import Chunk
from .chunk_bytes import ChunkBytes
from .safetensors_io import StreamWriter
from .save_plan import CONSOLIDATING_RANK, FileEntry, FilePlan, SavePlan
from .storage import CacheAvoidingSink, Storage


class WrittenFile(TypedDict):
    """What a rank reports about one data file it wrote (or, ``bytes`` 0, checksummed)."""

    bytes: int
    crc: dict[str, list[int]]
    header_crc32: int
    """-1 from a rank that only checksummed tensors another rank wrote."""


class ByteSource(Protocol):
    """Where a writer gets a chunk's bytes: this rank's chunks in memory
    (:class:`~.chunk_bytes.ChunkBytes`), or chunks loaded one at a time as they are written
    (``streaming.LazyChunkBytes``, what the converters use)."""

    def pieces(self, index: int, start: int, end: int) -> Iterator[memoryview]: ...


@dataclass(frozen=True)
class WriteOptions:
    block_bytes: int
    buffer_bytes: int
    cache_bytes: int = 0
    """Checksum and write in pieces of this size on one thread (a background save);
    0: checksum on a helper thread in parallel (``StreamWriter``)."""
    direct_until: threading.Event | None = None
    """A background save: keep files out of the page cache until this is set (someone
    waits for the save), in pieces of ``cache_bytes`` (``CacheAvoidingSink``)."""


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
        from .consolidate_receiver import ConsolidatedReceiver

        return ConsolidatedReceiver(plan, sources, storage, options, group).run()
    from .consolidate_sender import ConsolidatedSender

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


def open_file(
    fplan: FilePlan,
    storage: Storage,
    options: WriteOptions,
    checksummed_elsewhere: frozenset[str] = frozenset(),
) -> StreamWriter:
    header = [(e.name, e.dtype, e.shape) for e in fplan.entries]
    data_bytes = sum(e.nbytes for e in fplan.entries)
    sink = storage.create(fplan.name, size_hint=data_bytes)
    # A capability, not a requirement: a user's storage (``storage=``) may not have it.
    if (
        options.direct_until is not None
        and options.cache_bytes
        and isinstance(sink, CacheAvoidingSink)
    ):
        try:
            sink.avoid_page_cache(options.direct_until, options.cache_bytes)
        except BaseException:
            sink.abort()
            raise
    return StreamWriter(
        sink, header, options.block_bytes, checksummed_elsewhere, cache_bytes=options.cache_bytes
    )


def finish(writer: StreamWriter) -> WrittenFile:
    size, crcs = writer.finish()
    return {
        "bytes": size,
        "crc": {name: list(v) for name, v in crcs.items()},
        "header_crc32": writer.header_crc32,
    }


def sent_whole(fplan: FilePlan) -> list[FileEntry]:
    """Entries whose bytes are one other rank's chunk: that rank checksums them itself,
    in parallel with the writer, instead of the writer checksumming everything."""
    return [
        e for e in fplan.entries if len(e.sources) == 1 and e.sources[0].rank != CONSOLIDATING_RANK
    ]


def remove_quietly(storage: Storage, names: list[str]) -> None:
    """Remove files this rank created after its writing failed (best effort)."""
    for name in names:
        try:
            storage.remove(name)
        except Exception:
            continue
