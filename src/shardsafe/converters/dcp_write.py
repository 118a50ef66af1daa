"""Writing a ``torch.distributed.checkpoint`` (DCP) checkpoint that ``dcp.load`` reads.

DCP's own writer wants the whole state dict in memory. This one writes the same format
one chunk at a time: each chunk is ``torch.save``'d into ``__0_0.distcp`` at the next
offset (what DCP's ``FileSystemWriter`` does), and ``.metadata`` - DCP's ``Metadata``
made of its own documented classes, pickled as DCP pickles it - is written last, so a
reader never sees metadata naming bytes that are not there yet. Chunks stay as the
source stored them (an FSDP2 checkpoint's shards stay shards): ``dcp.load`` reshards at
any world size.

Keys are flattened exactly as DCP flattens the state dict it is given (``_traverse``'s
rules: dicts always, lists only when they hold tensors or dicts, joined with "."), so
``dcp.load({"model": msd, "optimizer": osd})`` with ``get_state_dict``'s dicts finds
every key: ``model.<fqn>``, ``optimizer.state.<fqn>.<name>``,
``optimizer.param_groups.<i>.<hyper>``.
"""

from __future__ import annotations

import contextlib
import io
import math
import pickle
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import IO, Any, cast

import torch

from .. import _warnings, dtypes
from ..checkpoint.format.crc import crc32
from ..checkpoint.format.tensor_bytes import byte_view, memory
from ..checkpoint.storage.protocol import FileSink, Storage
from ..errors import CheckpointCorruptError, CheckpointError
from . import flat_layout
from .dcp_metadata import MAX_METADATA_BYTES, METADATA_NAME, parse_metadata
from .dcp_read import load_range
from .entries import nested
from .sink_stream import SinkStream
from .source import Source, SourceTensor, TensorRef

DATA_FILE = "__0_0.distcp"


@dataclass(frozen=True)
class Leaf:
    path: tuple[str | int, ...]
    value: Any
    keys: tuple[Any, ...] = ()
    """The path with the tree's own keys (``1``, where ``path`` has DCP's ``"1"``)."""

    @property
    def fqn(self) -> str:
        return ".".join(map(str, self.path))

    def shown(self) -> str:
        return "".join(f"[{k!r}]" for k in self.keys)


def flatten(tree: Mapping[str, Any]) -> list[Leaf]:
    """DCP's flattening (``_traverse.traverse_state_dict``), with :class:`TensorRef` s as
    its tensors; two paths that DCP would store under one name are refused."""
    leaves: list[Leaf] = []
    retyped: list[tuple[Any, ...]] = []  # paths to a key that is no string
    once = _Once()  # each question asked once per container: linear, however deep

    @once
    def terminal(value: Any) -> bool:
        if isinstance(value, Mapping):
            return False
        if not isinstance(value, list):
            return True
        return not any(
            isinstance(v, TensorRef) or (isinstance(v, (Mapping, list)) and not terminal(v))
            for v in value
        )

    @once
    def holds_no_leaf(value: Any) -> bool:
        """Whether DCP's flattening finds no leaf in ``value``: it holds only empty dicts."""
        if isinstance(value, Mapping):
            return all(holds_no_leaf(v) for v in value.values())
        return isinstance(value, list) and not terminal(value) and all(map(holds_no_leaf, value))

    @once
    def rebuilt_terminal(value: list[Any]) -> bool:
        """Whether DCP, rebuilding the list from its leaves (``None`` for what held none),
        finds it terminal: ``dcp.load`` rebuilds the state it is given so before looking
        its keys up (``_flatten_sharded_tensors``), as ``dcp_to_torch_save`` does."""
        return not any(
            isinstance(v, TensorRef)
            or (isinstance(v, Mapping) and not holds_no_leaf(v))
            or (
                isinstance(v, list)
                and not terminal(v)
                and not holds_no_leaf(v)
                and not rebuilt_terminal(v)
            )
            for v in value
        )

    def visit(path: tuple[str | int, ...], keys: tuple[Any, ...], value: Any) -> None:
        if isinstance(value, (Mapping, list)) and holds_no_leaf(value):
            # Empty dicts have no leaf to store: ``{}`` vanished (a Lightning loop's
            # ``state_dict: {}``), and in a list shifted what follows out of the list
            # (found in review). Stored whole as a bytes item, as an empty list is.
            leaves.append(Leaf(path, value, keys))
        elif isinstance(value, Mapping):
            for k, v in value.items():
                if not isinstance(k, str) and not retyped:
                    retyped.append((*keys, k))
                visit((*path, str(k)), (*keys, k), v)
        elif terminal(value) or rebuilt_terminal(value):
            # ``[{}, 1]`` whole: DCP itself stores its ``1`` alone, then looks the list up
            # whole (its own save and load disagree on it); each reader finds it so.
            leaves.append(Leaf(path, value, keys))
        else:
            for i, v in enumerate(value):
                visit((*path, i), (*keys, i), v)

    for key, value in tree.items():
        visit((str(key),), (key,), value)
    check_distinct(leaves)
    if retyped:
        _warn_retyped(retyped[0])
    subclassed = _first_dict_subclass((), tree)
    if subclassed is not None:
        _warn_dict_type(*subclassed)
    return leaves


class _Once:
    """Answers of :func:`flatten`'s questions about a container, by question and by the
    container's id (the tree is alive and unchanged while it is flattened): asked at
    every level of a nested list, each had walked the whole list below it again."""

    def __init__(self) -> None:
        self._known: dict[tuple[str, int], bool] = {}

    def __call__(self, question: Callable[[Any], bool]) -> Callable[[Any], bool]:
        def asked(value: Any) -> bool:
            key = (question.__name__, id(value))
            found = self._known.get(key)
            if found is None:
                found = self._known[key] = question(value)
            return found

        return asked


def _first_dict_subclass(keys: tuple[Any, ...], value: Any) -> tuple[tuple[Any, ...], type] | None:
    """The path and type of the first mapping in ``value`` that is no plain dict."""
    if isinstance(value, Mapping):
        if keys and type(value) is not dict:
            return keys, type(value)
        items: Any = value.items()
    elif isinstance(value, (list, tuple)):
        items = enumerate(value)
    else:
        return None
    for k, v in items:
        found = _first_dict_subclass((*keys, k), v)
        if found is not None:
            return found
    return None


def _warn_retyped(keys: tuple[Any, ...]) -> None:
    """DCP keeps every key as text: a key of another type (an optimizer's numbered state,
    ``{0: ...}``) reads back as its text without a template, and ``load_state_dict`` of
    such an optimizer state drops the state in silence (found in review)."""
    where = "".join(f"[{k!r}]" for k in keys)
    _warnings.warn(
        f"shardsafe: DCP stores every key as text, so the key {keys[-1]!r} of {where} (and "
        f"any other key that is no string) reads back as {str(keys[-1])!r} unless loaded "
        "into a state dict of your own (dcp.load uses its keys); an optimizer's numbered "
        "state read back so no longer matches its param_groups. Convert --to torch or "
        "--to shardsafe to keep the keys' types",
        UserWarning,
    )


def _warn_dict_type(keys: tuple[Any, ...], kind: type) -> None:
    """DCP flattens every mapping into its leaves and rebuilds plain dicts: a
    ``Counter`` (MultiStepLR's ``milestones``) read back without a template is a dict,
    with no ``elements()`` (found in review). Stored whole instead, it would no longer
    be found by ``dcp.load`` of a state dict holding one, which looks up its leaves."""
    where = "".join(f"[{k!r}]" for k in keys)
    _warnings.warn(
        f"shardsafe: DCP stores every dict as a plain dict, so the {kind.__qualname__} at "
        f"{where} (and any other dict of another type) reads back as a dict unless loaded "
        "into a state dict of your own (dcp.load keeps its containers). Convert --to torch "
        "or --to shardsafe to keep its type",
        UserWarning,
    )


def check_distinct(leaves: list[Leaf]) -> None:
    """DCP stores a leaf under its path joined with "." (and ``dcp.load`` looks it up by
    the same join), so two paths that join alike (``['a.b']`` and ``['a']['b']``) would
    keep one and lose the other: refused, naming both, before anything is written."""
    seen: dict[str, Leaf] = {}
    for leaf in leaves:
        first = seen.setdefault(leaf.fqn, leaf)
        if first is not leaf:
            raise CheckpointError(
                f"cannot convert to DCP: {first.shown()} and {leaf.shown()} would both be "
                f"stored as {leaf.fqn!r} (DCP joins a path's keys with '.'), so one would be "
                f"lost; {_WAY_OUT}"
            )
    _check_one_node_per_path(leaves)


_WAY_OUT = "rename one of them, or convert to shardsafe or torch instead (nothing was written)"


def _check_one_node_per_path(leaves: list[Leaf]) -> None:
    """DCP records each leaf's path with dict keys as strings (``planner_data``), from
    which a reader without a template (``dcp_to_torch_save``, this package's) rebuilds
    the tree: ``[1]`` and ``['1']`` would become one node, merging or losing what is
    under them. Refused unless every recorded path stands for one path of the tree."""
    nodes: dict[tuple[str | int, ...], Leaf] = {}
    for leaf in leaves:
        for n in range(1, len(leaf.path) + 1):
            other = nodes.setdefault(leaf.path[:n], leaf)
            if other.keys[:n] != leaf.keys[:n]:
                raise CheckpointError(
                    f"cannot convert to DCP: {other.shown()} and {leaf.shown()} would both be "
                    f"stored under the path {leaf.path[:n]!r} (DCP names dict keys by "
                    f"str(key)), so a reader would lose one; {_WAY_OUT}"
                )


def refuse_non_empty(storage: Storage) -> bool:
    """Make the output directory; converters write only into a new or empty one, so that
    nothing of the user's is overwritten or mixed with the output. Returns whether it was
    created here (a failed conversion then removes it)."""
    existed = check_empty(storage)
    storage.make_directory()
    return not existed


def check_empty(storage: Storage) -> bool:
    """Whether the output directory exists; refuse it if it is not empty."""
    existed = storage.is_directory()
    if existed and storage.names():
        raise CheckpointError(
            f"{storage.directory} exists and is not empty; convert into a new directory "
            "(nothing is ever overwritten)"
        )
    return existed


def remove_if_created(storage: Storage, created: bool) -> None:
    """After a failure: remove the output directory if this conversion made it and left
    nothing in it (best effort)."""
    if created and not storage.names():
        with contextlib.suppress(OSError):
            storage.remove_directory()


def write(
    source: Source,
    storage: Storage,
    on_bytes: Callable[[int], None] | None = None,
    *,
    flat: bool = False,
) -> list[tuple[str, int]]:
    """Write ``source`` as a DCP checkpoint; return each file written and its bytes (the
    data file, then ``.metadata``). ``flat``:
    in torchtitan's layout (``flat_layout``: weights at the top level, optimizer state
    flattened)."""
    from torch.distributed.checkpoint import metadata

    tree = nested(source)
    if flat:
        tree = flat_layout.flatten(tree, {n: v.kind for n, v in source.values.items()})
    leaves = flatten(tree)
    created = refuse_non_empty(storage)
    sink = storage.create(DATA_FILE, size_hint=source.total_bytes)
    out = _DataFile(sink, source, on_bytes)
    try:
        for leaf in leaves:
            out.planner_data[leaf.fqn] = leaf.path
            if isinstance(leaf.value, TensorRef):
                out.tensor(leaf.fqn, source.tensors[leaf.value.key])
            else:
                out.plain(leaf.fqn, _plain(leaf.value, source))
        written = sink.finish()
    except BaseException:
        sink.abort()
        storage.remove(DATA_FILE)
        remove_if_created(storage, created)
        raise
    md = metadata.Metadata(
        state_dict_metadata=out.state_md,
        planner_data=out.planner_data,
        storage_data=out.storage_data,
        version="1.0.0",
    )
    blob = pickle.dumps(md)
    try:
        storage.sync_directory()
        storage.commit(METADATA_NAME, blob)
        verify(storage, out.crcs, [leaf.fqn for leaf in leaves])
    except BaseException:
        # A checkpoint that does not read back as written is not left for dcp.load
        # (which checks no checksums): the metadata goes first, then the data.
        storage.remove(METADATA_NAME)
        storage.remove(DATA_FILE)
        remove_if_created(storage, created)
        raise
    return [(DATA_FILE, written), (METADATA_NAME, len(blob))]


class _DataFile:
    """``__0_0.distcp`` being written, and the metadata of what is in it so far."""

    def __init__(
        self, sink: FileSink, source: Source, on_bytes: Callable[[int], None] | None
    ) -> None:
        self.stream, self.source, self.on_bytes = SinkStream(sink), source, on_bytes
        self.state_md: dict[str, Any] = {}
        self.storage_data: dict[Any, Any] = {}
        self.planner_data: dict[str, tuple[str | int, ...]] = {}
        self.crcs: dict[tuple[str, tuple[int, ...]], int] = {}

    def tensor(self, fqn: str, t: SourceTensor) -> None:
        """Each chunk of ``t``, ``torch.save``'d at the next offset (DCP's own encoding)."""
        from torch.distributed.checkpoint import filesystem, metadata

        chunks = []
        for c in t.chunks:
            start = self.stream.pos
            tensor = own_storage(c.load())
            torch.save(tensor, cast(IO[bytes], self.stream))
            self.crcs[fqn, tuple(c.offsets)] = tensor_crc(tensor)
            del tensor
            c.done()
            index = metadata.MetadataIndex(fqn, torch.Size(c.offsets))
            length = self.stream.pos - start
            self.storage_data[index] = filesystem._StorageInfo(DATA_FILE, start, length)
            chunks.append(metadata.ChunkStorageMetadata(torch.Size(c.offsets), torch.Size(c.shape)))
            if self.on_bytes is not None:
                self.on_bytes(math.prod(c.shape) * dtypes.itemsize(t.dtype))
        props = metadata.TensorProperties(dtype=t.dtype)
        self.state_md[fqn] = metadata.TensorStorageMetadata(props, torch.Size(t.shape), chunks)

    def plain(self, fqn: str, value: Any) -> None:
        """A non-tensor item: its ``torch.save`` bytes (what DCP's planner writes)."""
        from torch.distributed.checkpoint import filesystem, metadata

        start = self.stream.pos
        buf = io.BytesIO()
        torch.save(value, buf)
        self.stream.write(buf.getbuffer())
        index = metadata.MetadataIndex(fqn)
        self.storage_data[index] = filesystem._StorageInfo(DATA_FILE, start, len(buf.getbuffer()))
        self.state_md[fqn] = metadata.BytesStorageMetadata()


def tensor_crc(tensor: torch.Tensor) -> int:
    return crc32(memory(byte_view(tensor.contiguous())), 0)


def verify(
    storage: Storage, expected: dict[tuple[str, tuple[int, ...]], int], fqns: list[str]
) -> None:
    """Read the written checkpoint back as a DCP reader would (its metadata through the
    allowlist, every chunk by byte range) and compare each chunk's CRC32 with what was
    written; the metadata must list each of the ``fqns`` written, once (an item written
    twice under one name would be a lost one)."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    where = storage.where(METADATA_NAME)
    md = parse_metadata(storage.read_small(METADATA_NAME, MAX_METADATA_BYTES), where)
    listed = set(md.state_dict_metadata)
    if len(listed) != len(fqns) or listed != set(fqns):
        raise CheckpointCorruptError(
            f"{where} lists {len(listed)} items, but {len(fqns)} were written: not every "
            "item reads back as written"
        )
    with storage.open_reader(DATA_FILE) as reader:
        for (fqn, offsets), crc in expected.items():
            info = md.storage_data[MetadataIndex(fqn, torch.Size(offsets))]
            tensor = load_range(reader, info.offset, info.length, f"tensor {fqn!r}")
            if tensor_crc(tensor) != crc:
                raise CheckpointCorruptError(
                    f"{storage.where(DATA_FILE)}: {fqn!r} (chunk at {list(offsets)}) does not "
                    "read back as written"
                )


def own_storage(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as ``torch.save`` should write it: alone in a storage exactly its size,
    and with none of the attributes a pickle set on it.

    ``torch.save`` writes a tensor's whole storage: a view of a larger buffer (q, k and v
    of a fused one; a crafted file's thousand views of one 4 MB storage) was written
    with all of it, each time, 4 GB from 4 MB of input, past ``untrusted_bytes_limit``,
    which counts the views' own bytes. And it looks at ``_backward_hooks``, which a
    pickle's ``_rebuild_tensor_v2`` sets to any object it holds: ``torch.save`` then
    failed on a type or a string (both found in review). A detached tensor has none."""
    nbytes = tensor.numel() * tensor.element_size()
    own = (
        tensor.is_contiguous()
        and tensor.storage_offset() == 0
        and tensor.untyped_storage().nbytes() == nbytes
    )
    detached = tensor.detach()
    return detached if own else detached.clone(memory_format=torch.contiguous_format)


def _plain(value: Any, source: Source) -> Any:
    """A non-tensor leaf with any tensor inside it (rare: a list of tensors) loaded."""
    if isinstance(value, TensorRef):
        return own_storage(source.tensors[value.key].load_whole())
    if isinstance(value, list):
        return [_plain(v, source) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v, source) for v in value)
    if isinstance(value, dict):
        return {k: _plain(v, source) for k, v in value.items()}
    return value


def planned_files(source: Source) -> list[tuple[str, int]]:
    """``--dry-run``: the data file, sized by its tensor data (``.metadata`` follows)."""
    return [(DATA_FILE, source.total_bytes)]
