"""A ``torch.distributed.checkpoint`` (DCP) checkpoint as a converter's source.

DCP's ``.metadata`` (read with the allowlisting unpickler of ``dcp_metadata``) lists every
flattened key (``model.fc.weight``, ``optim.state.fc.weight.exp_avg``,
``optim.param_groups.0.lr``), each tensor's chunks (one per shard that was saved, DDP
replicas once) and, in ``storage_data``, the ``.distcp`` file, offset and length of each
chunk. DCP writes each chunk there as ``torch.save(chunk)``: it is read back by byte range
with ``torch.load(weights_only=True)`` (tensors and plain data only) on exactly that
range, one chunk at a time. ``planner_data`` maps each flattened key back to its path in
the nested state (``("optim", "param_groups", 0, "lr")``), which rebuilds the tree that
``entries.to_entries`` turns into shardsafe entries (torchtitan's flat layout first made
nested, see ``flat_layout``).
"""

from __future__ import annotations

import io
import math
from typing import IO, Any, cast

import torch

from .. import dtypes
from ..checkpoint.format.geometry import tiling_problem
from ..checkpoint.storage.protocol import FileReader, Storage
from ..errors import CheckpointCorruptError
from ..pickles import load_torch
from .bounds import aliased, loaded, require_dense, resolved
from .dcp_metadata import MAX_METADATA_BYTES, METADATA_NAME, parse_metadata
from .entries import is_optimizer, to_entries
from .flat_layout import unflatten
from .open_files import OpenFiles
from .source import Source, SourceChunk, SourceTensor, Unbacked, checked, one_chunk

MAX_BYTES_ITEM = 256 << 20
"""A non-tensor item (a hyperparameter, a step count) is read whole; refuse a huge one."""


class RangeFile(io.RawIOBase):
    """Bytes ``[offset, offset + length)`` of an opened file, as a seekable file object
    (``torch.load`` reads through it; nothing outside the range is reachable)."""

    def __init__(self, reader: FileReader, offset: int, length: int) -> None:
        super().__init__()
        if offset + length > reader.size:
            raise CheckpointCorruptError(
                f"{reader.name} is truncated: the DCP metadata places an item at bytes "
                f"{offset}..{offset + length}, but the file holds {reader.size}"
            )
        self._reader, self._offset, self._length, self._pos = reader, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        self._pos = max(0, base + pos)
        return self._pos

    def readinto(self, out: Any) -> int:
        view = memoryview(out).cast("B")
        n = max(0, min(view.nbytes, self._length - self._pos))
        if n:
            self._reader.read_into(self._offset + self._pos, view[:n])
            self._pos += n
        return n


def load_range(reader: FileReader, offset: int, length: int, what: str) -> Any:
    """``torch.load(weights_only=True)`` of one DCP item's byte range, through the pickle
    gate (``pickles.load_torch``)."""
    view = io.BufferedReader(RangeFile(reader, offset, length))
    return load_torch(
        cast(IO[bytes], view), f"{what} in {reader.name} (bytes {offset}..{offset + length})"
    )


def read(storage: Storage) -> Source:
    """The DCP checkpoint in ``storage`` as a :class:`Source`."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    where = storage.where(METADATA_NAME)
    md = parse_metadata(storage.read_small(METADATA_NAME, MAX_METADATA_BYTES), where)
    files = OpenFiles(storage)
    try:
        tree: dict[Any, Any] = {}
        stand_ins: dict[int, tuple[str, Any]] = {}
        for fqn, item in md.state_dict_metadata.items():
            path = (md.planner_data or {}).get(fqn) or tuple(fqn.split(".", 1))
            if isinstance(item, BytesStorageMetadata):
                info = _info(md, MetadataIndex(fqn), where)
                if info.length > MAX_BYTES_ITEM:
                    raise CheckpointCorruptError(f"{where}: item {fqn!r} is {info.length} bytes")
                leaf = load_range(files.get(info.relative_path), info.offset, info.length, fqn)
            else:
                leaf = torch.empty(tuple(item.size), dtype=item.properties.dtype, device="meta")
                stand_ins[id(leaf)] = (fqn, item)
            _insert(tree, path, leaf, where)
        tree = _listify(tree)

        viewed: dict[str, torch.Tensor] = {}  # the tensors inside non-tensor items

        def make(key: str, stand_in: torch.Tensor) -> SourceTensor:
            if id(stand_in) not in stand_ins:  # a tensor inside a non-tensor item
                viewed[key] = stand_in
                return loaded(storage.directory, key, stand_in)
            fqn, item = stand_ins[id(stand_in)]
            dtype, size = item.properties.dtype, tuple(item.size)
            if not item.chunks:  # an empty tensor: DCP stores no bytes for it
                return one_chunk(
                    key, dtype, size, lambda: torch.empty(size, dtype=dtype, device="cpu")
                )
            problem = tiling_problem(
                size, [(tuple(c.offsets), tuple(c.sizes)) for c in item.chunks]
            )
            if problem is not None:
                raise CheckpointCorruptError(
                    f"{where}: the chunks of {fqn!r} do not cover its size {list(size)} exactly "
                    f"once: they {problem}"
                )
            chunks = tuple(_chunk(md, files, fqn, item, c, where) for c in item.chunks)
            unbacked = _unbacked(md, files, fqn, item, where)
            return SourceTensor(key, dtype, size, chunks, unbacked=unbacked)

        values, tensors = to_entries(unflatten(_with_empty_states(_top_level(tree, where))), make)
        # Many views of one storage inside a bytes item: each is written whole, counted
        # against the limit as torch_file.read counts them (a 274 KB DCP checkpoint wrote
        # 1.3 GB, found in review).
        aliased(where, tensors, viewed)
    except BaseException:
        files.close()
        raise
    return Source("dcp", storage.directory, values, tensors, [files.close])


def _info(md: Any, index: Any, where: str) -> Any:
    info = md.storage_data.get(index)
    if info is None:
        raise CheckpointCorruptError(
            f"{where} lists {index.fqn!r} (offset {index.offset}) but says nowhere where its "
            "bytes are"
        )
    return info


def _chunk(md: Any, files: OpenFiles, fqn: str, item: Any, chunk: Any, where: str) -> SourceChunk:
    from torch.distributed.checkpoint.metadata import MetadataIndex

    offsets, shape = tuple(chunk.offsets), tuple(chunk.sizes)
    info = _info(md, MetadataIndex(fqn, torch.Size(offsets)), where)
    dtype = item.properties.dtype

    def load() -> torch.Tensor:
        reader = files.get(info.relative_path)
        tensor = load_range(reader, info.offset, info.length, f"tensor {fqn!r}")
        if not isinstance(tensor, torch.Tensor):
            raise CheckpointCorruptError(f"{reader.name}: {fqn!r} holds no tensor")
        require_dense(reader.name, fqn, tensor)
        return checked(fqn, resolved(tensor), dtype, shape)

    return SourceChunk(offsets, shape, load)


def _unbacked(md: Any, files: OpenFiles, fqn: str, item: Any, where: str) -> Unbacked | None:
    """The chunks of ``item`` declared larger than the bytes of the range that stores
    them (cut at its file's end). DCP stores a chunk as ``torch.save`` of it: its bytes
    plus a container, unless it is an overlapping view or the metadata lies. Ranges never
    share bytes (``check_metadata``), so the other chunks together are no larger than the
    files: assembling the tensor (``SourceTensor.load_whole``) allocates those plus these.
    """
    from torch.distributed.checkpoint.metadata import MetadataIndex

    itemsize = dtypes.itemsize(item.properties.dtype)
    elements = held = 0
    file = ""
    for c in item.chunks:
        info = _info(md, MetadataIndex(fqn, torch.Size(c.offsets)), where)
        reader = files.get(info.relative_path)
        present = max(0, min(info.length, reader.size - info.offset))
        count = math.prod(c.sizes)
        if count * itemsize > present:
            elements, held = elements + count, held + present
            file = files.storage.where(info.relative_path)
    return Unbacked(elements, held, file) if elements else None


def _insert(tree: dict[Any, Any], path: tuple[Any, ...], leaf: Any, where: str) -> None:
    node = tree
    for part in path[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise CheckpointCorruptError(f"{where}: the key paths {path!r} clash")
    if path[-1] in node:
        raise CheckpointCorruptError(f"{where}: two items have the key path {path!r}")
    node[path[-1]] = leaf


def _listify(node: Any) -> Any:
    """Dicts keyed 0..n-1 by ints were lists in the state DCP flattened."""
    if not isinstance(node, dict):
        return node
    out = {k: _listify(v) for k, v in node.items()}
    if out and all(type(k) is int for k in out) and sorted(out) == list(range(len(out))):
        return [out[i] for i in range(len(out))]
    return out


def _with_empty_states(tree: dict[str, Any]) -> dict[str, Any]:
    """Each optimizer's ``state`` back where DCP dropped it. DCP stores leaves, so an
    optimizer with no state yet or ever (``SGD`` without momentum: ``{"state": {},
    "param_groups": [...]}``) comes back as ``{"param_groups": [...]}``, which would be
    plain data that ``shardsafe.load`` refuses to put into the optimizer."""
    out = dict(tree)
    for name, sub in tree.items():
        if isinstance(sub, dict) and set(sub) == {"param_groups"}:
            candidate = {"state": {}, **sub}
            if is_optimizer(candidate):
                out[name] = candidate
    return out


def _top_level(tree: Any, where: str) -> dict[str, Any]:
    if not isinstance(tree, dict) or not all(isinstance(k, str) for k in tree):
        raise CheckpointCorruptError(f"{where}: the top-level keys are not names")
    return tree
