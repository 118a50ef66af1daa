"""Reading DCP's ``.metadata`` (a pickle) without letting it run anything.

``torch.distributed.checkpoint`` stores its checkpoint's index as ``pickle.dump(Metadata)``.
A plain ``pickle.load`` of a file from someone else runs whatever its ``__reduce__``
payloads name (``os.system``, ``eval``...). Here the unpickler resolves a global only if
it is on an explicit allowlist: DCP's own metadata dataclasses and enum, ``torch.Size``,
torch's dtypes and layouts (through torch's own ``_get_layout``), ``OrderedDict``, and the
path classes a ``StorageMeta.checkpoint_id`` may hold. Anything else is refused with a
:class:`CheckpointCorruptError` naming the global, before it is called. The result is
then checked field by field, so the rest of the converter may trust its types. The file
is capped in size (:data:`MAX_METADATA_BYTES`) and passed through
:func:`~shardsafe.pickles.scan` before unpickling: nesting, sharing and memo bombs are
refused, and ``BUILD`` may fill only the DCP dataclass instances the pickle itself made,
with their own fields (never a class, a function or a cache); globals come from a fixed
table, so reading a ``.metadata`` imports nothing.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import io
import itertools
import math
import pathlib
import pickle
from typing import Any

import torch

from .. import _tree, dtypes
from ..checkpoint.format.manifest_format import shape_problem
from ..errors import CheckpointCorruptError
from ..pickles import ANY_FIELDS, MAX_PICKLE_BYTES, Policy, calls, scan

METADATA_NAME = ".metadata"
MAX_METADATA_BYTES = MAX_PICKLE_BYTES
"""A million stored chunks' worth; the pickle gate's own limit."""

_DCP = "torch.distributed.checkpoint.metadata"
_FS = "torch.distributed.checkpoint.filesystem"
_DATACLASSES = ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                "ChunkStorageMetadata", "MetadataIndex", "StorageMeta")  # fmt: skip
_PATHS = ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")


@functools.cache
def _allowed() -> dict[tuple[str, str], Any]:
    """``(module, name)`` -> object: every global a DCP ``.metadata`` names, from a fixed
    table (dtypes included: never ``getattr(torch, name)``, which can import packages)."""
    from torch.distributed.checkpoint import filesystem, metadata

    found: dict[tuple[str, str], Any] = {
        (_DCP, name): getattr(metadata, name)
        for name in (*_DATACLASSES, "TensorProperties", "_MEM_FORMAT_ENCODING")
    }
    found[_FS, "_StorageInfo"] = filesystem._StorageInfo
    found["torch", "Size"] = torch.Size
    found["torch.serialization", "_get_layout"] = torch.serialization._get_layout
    found["collections", "OrderedDict"] = collections.OrderedDict
    found.update((("pathlib", name), getattr(pathlib, name)) for name in _PATHS)
    found.update((("torch", name), dtypes.any_from_name(name)) for name in dtypes.all_names())
    return found


@functools.cache
def _policy() -> Policy:
    """What a ``.metadata`` may hold (see ``shardsafe.pickles``): DCP's dataclasses, made
    with no arguments and filled by ``BUILD`` with their own fields only
    (``TensorProperties`` by its ``__setstate__``); layouts, enum members, sizes and paths
    made from numbers and strings, never filled; dtypes named, never called. A
    ``MetadataIndex`` key hashes as its fields do (``pickles/hashing.py``)."""
    from torch.distributed.checkpoint import filesystem, metadata

    classes = [(_DCP, name, getattr(metadata, name)) for name in _DATACLASSES]
    classes.append((_FS, "_StorageInfo", filesystem._StorageInfo))
    buildable: dict[tuple[str, str], frozenset[str] | None] = {
        (module, name): frozenset(f.name for f in dataclasses.fields(cls))
        for module, name, cls in classes
    }
    buildable[_DCP, "TensorProperties"] = ANY_FIELDS
    made = {
        **dict.fromkeys(buildable, calls.NO_ARGS),
        (_DCP, "_MEM_FORMAT_ENCODING"): calls.SCALARS,
    }
    made.update({("torch", "Size"): calls.SIZE, ("collections", "OrderedDict"): calls.NO_ARGS})
    made["torch.serialization", "_get_layout"] = calls.SCALARS
    made.update(dict.fromkeys((("pathlib", name) for name in _PATHS), calls.SCALARS))
    # The fields its hash is made of: a field with hash=False (``index``, in torch 2.13)
    # is left out of the real hash, and counted in, it hid keys forced to one hash.
    index = tuple(
        f.name
        for f in dataclasses.fields(metadata.MetadataIndex)
        if (f.compare if f.hash is None else f.hash)
    )
    return Policy(
        kind="DCP metadata file",
        holds="DCP's checkpoint metadata",
        globals=frozenset(_allowed()),
        calls=made,
        buildable=buildable,
        hashes_as={(_DCP, "MetadataIndex"): index, ("torch", "Size"): ()},
    )


class _RestrictedUnpickler(pickle.Unpickler):
    """Resolves globals from the fixed table only (see the module docstring)."""

    def __init__(self, data: bytes, where: str) -> None:
        super().__init__(io.BytesIO(data))
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        found = _allowed().get((module, name))
        if found is None:  # the scan refused it already; kept as a second lock
            raise CheckpointCorruptError(
                f"{self.where} asks to load {module}.{name}, which is not part of DCP's "
                "checkpoint metadata; refusing it (a pickle naming other globals can run "
                "code). If this checkpoint comes from a newer torch, convert it with that "
                "torch's own tools; otherwise do not trust it."
            )
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise CheckpointCorruptError(f"{self.where} holds a persistent reference; refusing it")


def parse_metadata(raw: bytes, where: str) -> Any:
    """The ``Metadata`` in ``raw``, unpickled with the allowlist and type-checked."""
    if len(raw) > MAX_METADATA_BYTES:
        raise CheckpointCorruptError(f"{where} is {len(raw)} bytes, larger than any DCP index")
    scan(raw, where, _policy())
    try:
        md = _RestrictedUnpickler(raw, where).load()
    except CheckpointCorruptError:
        raise
    except Exception as e:  # a damaged pickle: any of pickle's many error types
        raise CheckpointCorruptError(
            f"{where} is not a readable DCP metadata file: {type(e).__name__}: {e}"
        ) from None
    try:
        check_metadata(md, where)
    except AttributeError as e:  # a dataclass the pickle made but never filled
        raise CheckpointCorruptError(f"{where} is not valid DCP metadata: {e}") from None
    return md


def check_metadata(md: Any, where: str) -> None:
    """Refuse metadata whose fields are not what DCP writes (so nothing downstream is
    surprised by a hostile file that used only allowed classes)."""
    from torch.distributed.checkpoint import filesystem, metadata

    def bad(what: str) -> CheckpointCorruptError:
        return CheckpointCorruptError(f"{where} is not valid DCP metadata: {what}")

    if not isinstance(md, metadata.Metadata):
        raise bad(f"it holds a {type(md).__name__}, not a Metadata")
    if not isinstance(md.state_dict_metadata, dict):
        raise bad("state_dict_metadata is not a dict")
    for fqn, item in md.state_dict_metadata.items():
        if not isinstance(fqn, str):
            raise bad(f"key {fqn!r} is not a string")
        if isinstance(item, metadata.TensorStorageMetadata):
            _check_tensor(fqn, item, bad)
        elif not isinstance(item, metadata.BytesStorageMetadata):
            raise bad(f"{fqn!r} is a {type(item).__name__}")
    if not isinstance(md.storage_data, dict):
        raise bad("storage_data is not a dict (not a file-system DCP checkpoint?)")
    for index, info in md.storage_data.items():
        if not isinstance(index, metadata.MetadataIndex) or not isinstance(index.fqn, str):
            raise bad(f"storage_data key {index!r} is not a MetadataIndex")
        if not isinstance(info, filesystem._StorageInfo):
            raise bad(f"storage_data[{index.fqn!r}] is not a _StorageInfo")
        ok = (
            isinstance(info.relative_path, str)
            and _is_int(info.offset)
            and _is_int(info.length)
            and info.offset >= 0
            and info.length >= 0
        )
        if not ok:
            raise bad(f"storage_data[{index.fqn!r}] has an invalid file name, offset or length")
        transforms: Any = getattr(info, "transform_descriptors", None)
        if transforms:
            raise CheckpointCorruptError(
                f"{where}: {index.fqn!r} is stored with transforms "
                f"{list(transforms)} (compression or encryption), which the "
                "converter does not read; load it with dcp.load and save it again without"
            )
    _check_ranges(md.storage_data, bad)
    planner_data = md.planner_data
    if planner_data is not None:
        if not isinstance(planner_data, dict):
            raise bad("planner_data is not a dict")
        for key, path in planner_data.items():
            if not (isinstance(path, tuple) and all(isinstance(p, (str, int)) for p in path)):
                raise bad(f"planner_data[{key!r:.200}] is not a tuple of names and indices")
            if not 0 < len(path) <= _tree.MAX_DEPTH:
                raise bad(
                    f"planner_data[{key!r:.200}] is a path {len(path)} names long; a state "
                    f"nests 1 to {_tree.MAX_DEPTH} levels deep"
                )


def _check_tensor(fqn: str, item: Any, bad: Any) -> None:
    from torch.distributed.checkpoint import metadata

    props = item.properties
    if not isinstance(props, metadata.TensorProperties) or not isinstance(props.dtype, torch.dtype):
        raise bad(f"{fqn!r} has no valid dtype")
    if not _is_shape(item.size):
        raise bad(f"{fqn!r} has an invalid size")
    problem = shape_problem(item.size, dtypes.itemsize(props.dtype))
    if problem is not None:  # chunks lie inside the size, so this bounds theirs too
        raise bad(f"{fqn!r} {problem}")
    if not isinstance(item.chunks, list):
        raise bad(f"{fqn!r} has no list of chunks")
    for chunk in item.chunks:
        if not (
            isinstance(chunk, metadata.ChunkStorageMetadata)
            and _is_shape(chunk.offsets)
            and _is_shape(chunk.sizes)
            and len(chunk.offsets) == len(chunk.sizes) == len(item.size)
            and all(o + n <= s for o, n, s in zip(chunk.offsets, chunk.sizes, item.size))
        ):
            raise bad(f"{fqn!r} has a chunk outside its size")
    if math.prod(item.size) and not item.chunks:
        raise bad(f"{fqn!r} has no chunks")


def _check_ranges(storage_data: dict[Any, Any], bad: Any) -> None:
    """No two items share bytes of a file. DCP writes each item once, at an offset of its
    own; items sharing bytes would let one small range stand for any number of chunks,
    while a converter bounds what it allocates for a chunk by the bytes of its range."""
    spans = sorted(
        (info.relative_path, info.offset, info.offset + info.length, index.fqn)
        for index, info in storage_data.items()
        if info.length
    )
    for (file, _, end, fqn), (next_file, start, _, next_fqn) in itertools.pairwise(spans):
        if file == next_file and start < end:  # sorted: an overlap shows between neighbours
            raise bad(f"items {fqn!r} and {next_fqn!r} share bytes of {file} (from byte {start})")


def _is_int(value: Any) -> bool:
    return type(value) is int


def _is_shape(value: Any) -> bool:
    return isinstance(value, (tuple, list)) and all(_is_int(n) and n >= 0 for n in value)
