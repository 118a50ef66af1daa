"""``save``: the phases of writing a checkpoint and the agreement between them.

enter (timed barrier) -> collect (adapters turn state into chunks; ranks exchange the
shapes of what they hold) -> plan (identical on every rank) -> write (data files, each
fsynced) -> commit (rank 0 writes ``manifest.json`` last, atomically).

Every phase ends with an exchange (``shardsafe.distributed``), so an error on any rank
stops all ranks at the same point with the same error, and nothing is committed.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch

from .._version import __version__
from ..adapters import find_adapter
from ..adapters.base import Adapter, Context
from ..adapters.module import param_names
from ..distributed import Coordinator
from ..errors import CheckpointCorruptError, CheckpointError
from . import dtypes
from .entries import Chunk, SavedValue, SaveItem
from .manifest import (
    LAYOUTS,
    MANIFEST_NAME,
    MAX_NAME_CHARS,
    MAX_NDIM,
    ChunkRecord,
    Manifest,
    TensorRecord,
    parse,
)
from .planner import ChunkInfo, SavePlan, plan_save
from .storage import LocalStorage
from .writer import FileResult, WriteOptions, write_plan

DEFAULT_BUFFER_BYTES = 64 << 20
CRC_BLOCK_BYTES = 16 << 20
DEFAULT_TIMEOUT_S = 1800.0

State = Mapping[str, Any]


class StorageFactory(Protocol):
    """Makes the storage layer for a checkpoint directory: ``LocalStorage`` or a subclass
    of it (``follow=False``: the directory itself must not be a symlink)."""

    def __call__(self, directory: str, *, follow: bool = ...) -> LocalStorage: ...


def save(
    path: str,
    state: State,
    *,
    layout: str,
    entry_timeout: float,
    timeout: float,
    buffer_bytes: int,
    storage: StorageFactory | None = None,
    before_write: Callable[[], None] | None = None,
    on_commit: Callable[[], None] | None = None,
) -> None:
    """Run the phases of a save. ``before_write`` and ``on_commit`` run on rank 0 only,
    inside the collect and commit phases, so their failures are agreed like any other."""
    _check_save_args(path, state, layout, buffer_bytes)
    store = (storage or LocalStorage)(path)
    try:
        existed = store.is_directory()
        if existed and store.exists(MANIFEST_NAME):
            raise CheckpointError(
                f"{path} already holds a committed checkpoint; shardsafe never overwrites one. "
                "Save to a new directory (CheckpointManager does this per step) or delete it "
                "first."
            )
        store.close()  # reopened when written: rank 0 may create it in between
        coord = Coordinator("save", path, timeout=timeout)
        coord.enter(entry_timeout)
        try:
            _phases(coord, store, state, layout, buffer_bytes, before_write, on_commit)
        except CheckpointError:
            if coord.rank == 0 and not existed:
                _remove_uncommitted(store)  # everything in it was this save's
            raise
        finally:
            coord.close()
    finally:
        store.close()


def _remove_uncommitted(storage: LocalStorage) -> None:
    """Delete a directory this failed save created, unless a manifest got committed."""
    try:
        if not storage.is_directory() or storage.exists(MANIFEST_NAME):
            return
        for name in storage.names():
            storage.remove(name)
        storage.close()
        os.rmdir(storage.directory)
    except (OSError, CheckpointError):
        return  # best effort: a leftover is cleared by the next save into it


def _phases(
    coord: Coordinator,
    storage: LocalStorage,
    state: State,
    layout: str,
    buffer_bytes: int,
    before_write: Callable[[], None] | None,
    on_commit: Callable[[], None] | None,
) -> None:
    items, error = _collect(state, coord, storage, before_write)
    offers = coord.exchange("collect", _offer(items) if error is None else None, error)
    written: dict[str, FileResult] = {}
    try:
        plan, adapters = _plan(items, offers, state, layout, coord.rank)
        options = WriteOptions(CRC_BLOCK_BYTES, buffer_bytes)
        written, error = write_plan(plan, coord.rank, _chunks(items), storage, options)
    except Exception as e:  # e.g. a peer died mid-transfer: report it, do not hang
        error = e
    items.clear()  # drop references to staged state before waiting on others
    try:
        results = coord.exchange(
            "write", written if error is None else None, error, only_rank0_reads=True
        )
    except CheckpointError:
        for name in written:
            storage.remove(name)
        raise
    error = None
    if coord.rank == 0:
        error = _commit(storage, plan, offers, adapters, results, on_commit)
    coord.exchange("commit", None, error)


def _check_save_args(path: str, state: State, layout: str, buffer_bytes: int) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is not one of {LAYOUTS}")
    if buffer_bytes < 1 << 20:
        raise ValueError(f"buffer_bytes={buffer_bytes} is too small; use at least 1 MiB")
    if not isinstance(state, Mapping) or not state:
        raise ValueError(
            "state must be a non-empty dict of name -> value, e.g. "
            "{'model': model, 'optimizer': optimizer}"
        )
    for name in state:
        if not isinstance(name, str) or not name or "/" in name or name.startswith("@"):
            raise ValueError(
                f"state key {name!r} must be a non-empty string without '/' "
                "that does not start with '@'"
            )


def _collect(
    state: State,
    coord: Coordinator,
    storage: LocalStorage,
    before_write: Callable[[], None] | None,
) -> tuple[dict[str, tuple[Adapter, SaveItem]], BaseException | None]:
    items: dict[str, tuple[Adapter, SaveItem]] = {}
    try:
        if coord.rank == 0:
            if before_write is not None:
                before_write()
            _prepare_directory(storage)
        names = param_names(state)
        for name, obj in state.items():
            adapter = find_adapter(obj, name)
            ctx = Context(name, coord.rank, coord.world_size, names)
            item = adapter.save(obj, ctx)
            for chunk in item.chunks:
                _check_chunk(chunk, name)
            items[name] = (adapter, item)
    except Exception as e:
        return items, e
    return items, None


MAX_KEY_CHARS = MAX_NAME_CHARS - 1024
"""Longest tensor key ``save`` takes: room is left for the offsets a chunk name adds."""


def _check_chunk(chunk: Chunk, name: str) -> None:
    """Refuse, before anything is written, a tensor that ``load`` would refuse."""
    if not dtypes.is_supported(chunk.tensor.dtype):
        raise CheckpointError(
            f"tensor {chunk.key!r} has dtype {chunk.tensor.dtype}, which safetensors cannot store"
        )
    if len(chunk.key) > MAX_KEY_CHARS:
        raise CheckpointError(
            f"tensor key {chunk.key[:60]!r}... of state[{name!r}] is {len(chunk.key)} "
            f"characters long; a checkpoint holds keys of at most {MAX_KEY_CHARS}"
        )
    if chunk.key != name and not chunk.key.startswith(name + "/"):
        raise CheckpointError(
            f"an adapter gave state[{name!r}] a tensor key {chunk.key!r} outside its own "
            f"namespace; keys must be {name!r} or start with {name + '/'!r} (use ctx.key())"
        )
    if chunk.tensor.dim() > MAX_NDIM:
        raise CheckpointError(
            f"tensor {chunk.key!r} has {chunk.tensor.dim()} dimensions; a checkpoint holds at "
            f"most {MAX_NDIM}"
        )


INCOMPLETE_MARKER = ".shardsafe-incomplete"
"""Present while shardsafe writes a directory, removed after the commit: it tells a later
save that the files in an uncommitted directory are its own leftovers to clear."""


def _prepare_directory(storage: LocalStorage) -> None:
    """Make the directory, or clear an interrupted save's leftovers; refuse anything else.

    Only a directory that is empty or carries this library's marker is written into, so a
    save can never delete files it did not write (a Hugging Face ``model.safetensors``).
    """
    storage.make_directory()
    names = storage.names()
    if names and INCOMPLETE_MARKER not in names:
        raise CheckpointError(
            f"{storage.directory} is not empty (it holds {names[0]!r}"
            f"{f' and {len(names) - 1} more' if len(names) > 1 else ''}) and is not left over "
            "from an interrupted shardsafe save. shardsafe saves only into a new or empty "
            "directory, so that it never deletes files it did not write; pick another path."
        )
    for name in names:
        if name != INCOMPLETE_MARKER:
            storage.remove(name)  # a subdirectory is refused: shardsafe never makes one
    storage.touch(INCOMPLETE_MARKER)


def _offer(items: dict[str, tuple[Adapter, SaveItem]]) -> dict[str, Any]:
    return {
        "values": {
            name: {"kind": item.kind, "meta": item.meta} for name, (_, item) in items.items()
        },
        "chunks": [
            ChunkInfo(
                0,
                i,
                c.key,
                c.tensor.dtype,
                c.global_shape,
                c.offsets,
                tuple(c.tensor.shape),
                c.replicated,
            ).to_json()
            for i, c in enumerate(_chunks(items))
        ],
    }


def _chunks(items: dict[str, tuple[Adapter, SaveItem]]) -> list[Chunk]:
    return [c for _, item in items.values() for c in item.chunks]


def _plan(
    items: dict[str, tuple[Adapter, SaveItem]],
    offers: list[Any],
    state: State,
    layout: str,
    rank: int,
) -> tuple[SavePlan, dict[str, Adapter]]:
    names = list(state)
    for r, offer in enumerate(offers):
        if sorted(offer["values"]) != sorted(names):
            raise CheckpointError(
                f"rank {r} saved state keys {sorted(offer['values'])}, rank "
                f"{rank} {sorted(names)}; every rank must pass the same keys"
            )
    infos = [
        [ChunkInfo.from_json(r, i, raw) for i, raw in enumerate(offer["chunks"])]
        for r, offer in enumerate(offers)
    ]
    return plan_save(infos, layout, names), {n: a for n, (a, _) in items.items()}


def _commit(
    storage: LocalStorage,
    plan: SavePlan,
    offers: list[Any],
    adapters: dict[str, Adapter],
    results: list[dict[str, FileResult]],
    on_commit: Callable[[], None] | None,
) -> BaseException | None:
    try:
        manifest = _build_manifest(plan, offers, adapters, results)
        raw = _loadable(manifest)
        # The data files' directory entries must be durable before the manifest that
        # names them is: a power loss must not leave a manifest without its files.
        storage.sync_directory()
        storage.commit(MANIFEST_NAME, raw)
        storage.remove(INCOMPLETE_MARKER)
        if on_commit is not None:
            on_commit()
    except Exception as e:
        return e
    return None


def _loadable(manifest: Manifest) -> bytes:
    """The manifest's bytes, once the parser ``load`` uses has accepted them: what save
    writes, load, inspect and verify accept."""
    raw = manifest.to_json()
    try:
        parse(raw)
    except CheckpointCorruptError as e:
        raise CheckpointError(
            f"refusing to commit a checkpoint that shardsafe could not load back: {e}"
        ) from None
    return raw


def _build_manifest(
    plan: SavePlan,
    offers: list[Any],
    adapters: dict[str, Adapter],
    results: list[dict[str, FileResult]],
) -> Manifest:
    # The writer reports each file's size; senders may report checksums of what they sent.
    files: dict[str, int] = {}
    header_crcs: dict[str, int] = {}
    for per_rank in results:
        for name, res in per_rank.items():
            files[name] = max(files.get(name, 0), res["bytes"])
            if res["header_crc32"] >= 0:
                header_crcs[name] = res["header_crc32"]
    crcs = {
        (name, tname): tuple(v)
        for per_rank in results
        for name, res in per_rank.items()
        for tname, v in res["crc"].items()
    }
    chunks: dict[str, list[ChunkRecord]] = {key: [] for key in plan.tensors}
    for fplan in plan.files:
        for e in fplan.entries:
            chunks[e.key].append(
                ChunkRecord(fplan.name, e.name, e.offsets, e.shape, crcs[(fplan.name, e.name)])
            )
    tensors = {
        key: TensorRecord(dtype, shape, tuple(chunks[key]))
        for key, (dtype, shape) in plan.tensors.items()
    }
    values = {}
    for name, adapter in adapters.items():
        kind = offers[0]["values"][name]["kind"]
        meta = adapter.merge([offer["values"][name]["meta"] for offer in offers])
        values[name] = SavedValue(name, kind, meta)
    info = {
        "shardsafe_version": __version__,
        "torch_version": torch.__version__,
        "created_unix": time.time(),
    }
    return Manifest(
        plan.layout, plan.world_size, CRC_BLOCK_BYTES, values, tensors, files, info, header_crcs
    )
