"""Writing a checkpoint from one process, one tensor at a time (what the converters use).

``save`` collects live objects whose tensors are all in memory already. A converter has
no live objects: its tensors come from another checkpoint's files, and holding them all
would need as much memory as the checkpoint is large. Here each chunk comes with a
``load`` function that is called only when the writer reaches it, and its tensor is
dropped before the next one is loaded, so the memory is one chunk at a time.

Everything after that is ``save``'s own code, not a second copy of it: the planner
(``plan_save``), the file writer with its block CRCs (``writing.write_own_files``), the
directory rules (``target_directory``: a new or empty directory, or an interrupted save's
recorded leftovers, which are all it clears) and the commit
(``saving.commit``: data files durable first, ``manifest.json`` last, atomically). The
result is then verified like ``shardsafe verify`` does, from the committed manifest.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .. import dtypes
from ..errors import CheckpointCorruptError, CheckpointError
from ..protocol import SavedValue
from .format.manifest import Manifest
from .format.manifest_format import CRC_BLOCK_BYTES
from .format.tensor_bytes import byte_view, memory
from .io.writing import write_own_files
from .io.written import WriteOptions, WrittenFile
from .loading import read_manifest_from
from .options import DEFAULT_BUFFER_BYTES
from .plan.offer import ChunkOffer
from .plan.save_plan import (
    SavePlan,
    part_file_name,
    plan_save,
    set_apart_small,
    split_into_parts,
)
from .saving import BACKGROUND_PIECE_BYTES, check_loadable, commit
from .storage import target_directory
from .storage.protocol import Storage
from .verifying import find_problems


@dataclass(frozen=True)
class StreamedChunk:
    """A box of tensor ``key`` whose data ``load()`` produces when it is written."""

    key: str
    dtype: torch.dtype
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    load: Callable[[], torch.Tensor]
    release: Callable[[], None] | None = None
    """Called once the chunk is written (a memory-mapped source drops its pages)."""

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * dtypes.itemsize(self.dtype)


class LazyChunkBytes:
    """The bytes of streamed chunks, loaded on first use and kept one at a time.

    ``on_bytes`` is told how many bytes each chunk had once it is loaded (a progress bar).
    """

    def __init__(
        self, chunks: list[StreamedChunk], on_bytes: Callable[[int], None] | None = None
    ) -> None:
        self.chunks = chunks
        self.on_bytes = on_bytes
        self._index = -1
        self._view: torch.Tensor | None = None

    def pieces(self, index: int, start: int, end: int) -> Iterator[memoryview]:
        if index != self._index:
            self.close()  # drop the previous chunk before loading the next
            self._view = self._load(index)
            self._index = index
        assert self._view is not None
        yield memory(self._view)[start:end]

    def close(self) -> None:
        """Let go of the chunk loaded last."""
        self._view = None
        if self._index >= 0:
            release = self.chunks[self._index].release
            self._index = -1
            if release is not None:
                release()

    def _load(self, index: int) -> torch.Tensor:
        chunk = self.chunks[index]
        tensor = chunk.load()
        if tensor.dtype != chunk.dtype or tuple(tensor.shape) != chunk.shape:
            raise CheckpointCorruptError(
                f"{chunk.key!r}: the source holds {dtypes.dtype_name(tensor.dtype)}"
                f"{list(tensor.shape)} where its metadata declares "
                f"{dtypes.dtype_name(chunk.dtype)}{list(chunk.shape)}"
            )
        view = byte_view(tensor.detach().cpu().contiguous())
        if self.on_bytes is not None:
            self.on_bytes(chunk.nbytes)
        return view


def write_checkpoint(
    storage: Storage,
    values: dict[str, SavedValue],
    chunks: list[StreamedChunk],
    *,
    on_bytes: Callable[[int], None] | None = None,
) -> Manifest:
    """Write and commit a one-file checkpoint of ``values`` whose tensors are ``chunks``.

    The directory must be new or empty (``save``'s rule). On any error nothing is
    committed and what was written is removed. Returns the committed manifest, verified.
    """
    write_uncommitted(storage, values, chunks, on_bytes=on_bytes).commit({})
    return verify_committed(storage)


@dataclass(frozen=True)
class Parts:
    """Chunks written once for several writers (``tiers/node_share.py``): ``part_of``
    maps a chunk (its index in the chunk list) to the part whose file holds it; this
    writer writes the file of part ``own`` of ``count`` and links in the others."""

    part_of: dict[int, int]
    count: int
    own: int


@dataclass
class Uncommitted:
    """A checkpoint whose own data files are written and durable, not yet committed:
    :meth:`commit` it, with the records of the files others wrote (``elsewhere``, each
    with the names of its tensors, linked into the directory by then), or
    :meth:`abandon` it."""

    storage: Storage
    plan: SavePlan
    values: dict[str, SavedValue]
    written: dict[str, WrittenFile]
    extra_info: Mapping[str, Any] | None
    existed: bool
    elsewhere: dict[str, list[str]]

    def commit(self, theirs: dict[str, WrittenFile]) -> None:
        if set(theirs) != set(self.elsewhere):
            self.abandon()
            raise CheckpointError(
                f"the files written elsewhere are {sorted(self.elsewhere)}, but the records "
                f"given are of {sorted(theirs)}"
            )
        try:
            written = {**self.written, **theirs}
            commit(self.storage, self.plan, self.values, [written], None, self.extra_info)
        except BaseException:
            self.abandon()
            raise

    def abandon(self) -> None:
        """Remove what was written (and linked) for it, unless it was committed before."""
        if not self.existed:
            target_directory.remove_uncommitted(self.storage)


def write_uncommitted(
    storage: Storage,
    values: dict[str, SavedValue],
    chunks: list[StreamedChunk],
    *,
    on_bytes: Callable[[int], None] | None = None,
    buffer_bytes: int = DEFAULT_BUFFER_BYTES,
    background: bool = False,
    extra_info: Mapping[str, Any] | None = None,
    small_apart: int = 0,
    parts: Parts | None = None,
) -> Uncommitted:
    """Write the data files of a checkpoint of ``values`` whose tensors are ``chunks``, up
    to its commit (:meth:`Uncommitted.commit`), without reading them back: for bytes
    checksummed as they were written from memory, where a second pass would only double
    the cost (:func:`write_checkpoint` verifies after committing). ``background``:
    checksum and write in cache-sized pieces on this one thread (beside a training loop,
    as ``async_save`` does); ``extra_info`` joins the manifest's ``info``; ``small_apart``:
    chunks of fewer bytes go into a file of their own (``plan.save_plan.set_apart_small``);
    ``parts``: the files of the other parts are neither written nor read (a chunk of
    theirs may have no data here)."""
    existed = target_directory.refuse_committed(storage)
    try:
        token = target_directory.prepare(storage)
        storage.remove(target_directory.probe_name(token))  # no other rank looks for it
        offers = [
            ChunkOffer(0, i, c.key, c.dtype, c.global_shape, c.offsets, c.shape, False)
            for i, c in enumerate(chunks)
        ]
        plan = plan_save([offers], "sharded", list(values))
        if small_apart:
            plan = set_apart_small(plan, small_apart)
        elsewhere: dict[str, list[str]] = {}
        if parts is not None and parts.part_of:
            plan = split_into_parts(plan, parts.part_of, parts.count)
            theirs = {part_file_name(p, parts.count) for p in parts.part_of.values()}
            theirs.discard(part_file_name(parts.own, parts.count))
            elsewhere = {
                f.name: [e.name for e in f.entries] for f in plan.files if f.name in theirs
            }
        check_loadable(plan, values, extra_info)
        target_directory.record_plan(storage, token, [f.name for f in plan.files])
        cache_bytes = BACKGROUND_PIECE_BYTES if background else 0
        options = WriteOptions(CRC_BLOCK_BYTES, buffer_bytes, cache_bytes)
        sources = LazyChunkBytes(chunks, on_bytes)
        mine = [f for f in plan.files_of(0) if f.name not in elsewhere]
        try:
            written = write_own_files(mine, sources, storage, options)
        finally:
            sources.close()
    except BaseException:
        if not existed:
            target_directory.remove_uncommitted(storage)
        raise
    return Uncommitted(storage, plan, values, written, extra_info, existed, elsewhere)


def verify_committed(storage: Storage) -> Manifest:
    """Read the committed manifest back and check every byte, as ``shardsafe.verify`` does."""
    manifest = read_manifest_from(storage)
    problems = find_problems(storage, manifest)
    if problems:
        raise CheckpointError(
            f"the checkpoint written to {storage.directory} does not verify: "
            + "; ".join(problems[:5])
        )
    return manifest
