"""One data file written: opening it, finishing it and what a rank reports about it.

Shared by the writers of both layouts (``writing.py`` for files a rank writes from its
own memory, ``consolidate_receiver.py``/``consolidate_sender.py`` for the consolidated
layout), so that neither imports the other.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TypedDict

from ..plan.save_plan import CONSOLIDATING_RANK, FileEntry, FilePlan
from ..storage.protocol import CacheAvoidingSink, Storage
from .safetensors_io import StreamWriter


class WrittenFile(TypedDict):
    """What a rank reports about one data file it wrote (or, ``bytes`` 0, checksummed)."""

    bytes: int
    crc: dict[str, list[int]]
    header_crc32: int
    """-1 from a rank that only checksummed tensors another rank wrote."""


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
