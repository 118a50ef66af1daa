"""Reading DCP's ``.metadata`` (a pickle) without letting it run anything.

``torch.distributed.checkpoint`` stores its checkpoint's index as ``pickle.dump(Metadata)``.
A plain ``pickle.load`` of a file from someone else runs whatever its ``__reduce__``
payloads name (``os.system``, ``eval``...). Here the unpickler resolves a global only if
it is on an explicit allowlist: DCP's own metadata dataclasses and enum, ``torch.Size``,
torch's dtypes and layouts (through torch's own ``_get_layout``), ``OrderedDict``, and the
path classes a ``StorageMeta.checkpoint_id`` may hold. Anything else is refused with a
:class:`CheckpointCorruptError` naming the global, before it is called. The result is
then checked field by field, so the rest of the converter may trust its types. The file
is capped in size (:data:`MAX_METADATA_BYTES`) before unpickling.
"""

from __future__ import annotations

import collections
import io
import math
import pathlib
import pickle
from typing import Any

import torch

from ..errors import CheckpointCorruptError

METADATA_NAME = ".metadata"
MAX_METADATA_BYTES = 1 << 30
"""Larger than any real index (a million tensors' worth), small enough to refuse a bomb."""

_DCP = "torch.distributed.checkpoint.metadata"
_FS = "torch.distributed.checkpoint.filesystem"
_ALLOWED: dict[tuple[str, str], Any] = {}


def _allowed() -> dict[tuple[str, str], Any]:
    if not _ALLOWED:
        from torch.distributed.checkpoint import filesystem, metadata

        for name in (
            "Metadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "MetadataIndex",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        ):
            _ALLOWED[_DCP, name] = getattr(metadata, name)
        _ALLOWED[_FS, "_StorageInfo"] = filesystem._StorageInfo
        _ALLOWED["torch", "Size"] = torch.Size
        _ALLOWED["torch.serialization", "_get_layout"] = torch.serialization._get_layout
        _ALLOWED["collections", "OrderedDict"] = collections.OrderedDict
        for cls in (pathlib.PosixPath, pathlib.PurePosixPath, pathlib.WindowsPath):
            _ALLOWED["pathlib", cls.__name__] = cls
        _ALLOWED["pathlib", "PureWindowsPath"] = pathlib.PureWindowsPath
    return _ALLOWED


class _RestrictedUnpickler(pickle.Unpickler):
    """Resolves only allowlisted globals (see the module docstring)."""

    def __init__(self, data: bytes, where: str) -> None:
        super().__init__(io.BytesIO(data))
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        found = _allowed().get((module, name))
        if found is None:
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
    try:
        md = _RestrictedUnpickler(raw, where).load()
    except CheckpointCorruptError:
        raise
    except Exception as e:  # a damaged pickle: any of pickle's many error types
        raise CheckpointCorruptError(
            f"{where} is not a readable DCP metadata file: {type(e).__name__}: {e}"
        ) from None
    check_metadata(md, where)
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
    planner_data = md.planner_data
    if planner_data is not None:
        if not isinstance(planner_data, dict):
            raise bad("planner_data is not a dict")
        for key, path in planner_data.items():
            if not (isinstance(path, tuple) and all(isinstance(p, (str, int)) for p in path)):
                raise bad(f"planner_data[{key!r}] is not a tuple of names and indices")


def _check_tensor(fqn: str, item: Any, bad: Any) -> None:
    from torch.distributed.checkpoint import metadata

    props = item.properties
    if not isinstance(props, metadata.TensorProperties) or not isinstance(props.dtype, torch.dtype):
        raise bad(f"{fqn!r} has no valid dtype")
    if not _is_shape(item.size):
        raise bad(f"{fqn!r} has an invalid size")
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


def _is_int(value: Any) -> bool:
    return type(value) is int


def _is_shape(value: Any) -> bool:
    return isinstance(value, (tuple, list)) and all(_is_int(n) and n >= 0 for n in value)
