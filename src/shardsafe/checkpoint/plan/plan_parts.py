"""Each rank's part of the save plan, as rank 0 sends it: JSON, and only what that rank
needs to write.

Rank 0 alone plans a save (from every rank's offer) and sends each rank its part, so no
rank reads every other rank's offer and the store serves O(ranks) requests, not
O(ranks²). In the sharded layout a rank's part is its own file; in the consolidated one
every sender needs every file's entries (the order of the transfers to rank 0 follows
from them). The tensors table stays on rank 0: only the manifest uses it.

Pure: no process group, no I/O.
"""

from __future__ import annotations

from typing import Any

from ... import dtypes
from ..format.manifest_format import Layout
from .offer import ChunkOffer
from .save_plan import FileEntry, FilePlan, SavePlan


def part_of(plan: SavePlan, rank: int) -> dict[str, Any]:
    """What ``rank`` needs of ``plan`` to write (or send) its share, as JSON."""
    files = plan.files_of(rank) if plan.layout == "sharded" else plan.files
    return {
        "layout": plan.layout,
        "world_size": plan.world_size,
        "files": [_file_json(f) for f in files],
    }


def from_part(raw: dict[str, Any]) -> SavePlan:
    """The plan :func:`part_of` sent, as this rank uses it (no tensors table)."""
    files = [_file_from_json(f) for f in raw["files"]]
    layout: Layout = raw["layout"]  # rank 0 wrote it from its validated SaveOptions
    return SavePlan(layout, int(raw["world_size"]), {}, files)


def _file_json(f: FilePlan) -> dict[str, Any]:
    return {"name": f.name, "writer": f.writer, "entries": [_entry_json(e) for e in f.entries]}


def _entry_json(e: FileEntry) -> list[Any]:
    # A source is a chunk of the entry's own tensor: key and dtype are the entry's.
    sources = [
        [s.rank, s.index, list(s.global_shape), list(s.offsets), list(s.shape), s.replicated]
        for s in e.sources
    ]
    return [e.name, e.key, dtypes.dtype_name(e.dtype), list(e.offsets), list(e.shape), sources]


def _file_from_json(raw: dict[str, Any]) -> FilePlan:
    entries = []
    for name, key, dtype_name, offsets, shape, sources in raw["entries"]:
        dtype = dtypes.from_name(dtype_name)
        assert dtype is not None  # rank 0 wrote it from a dtype it knows
        chunks = tuple(
            ChunkOffer(r, i, key, dtype, tuple(g), tuple(o), tuple(s), bool(rep))
            for r, i, g, o, s, rep in sources
        )
        entries.append(FileEntry(name, key, dtype, tuple(offsets), tuple(shape), chunks))
    return FilePlan(raw["name"], int(raw["writer"]), entries)
