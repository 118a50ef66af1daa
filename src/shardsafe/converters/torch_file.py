"""``torch.save`` files (and Lightning ``.ckpt``) as a converter's source and destination.

Reading is ``torch.load(weights_only=True)``, so the file cannot run code as it is read,
with ``mmap=True`` for a local file in torch's zip format: tensors stay in the file until
they are written out, one at a time. A Lightning checkpoint's ``state_dict`` (a file with
``pytorch-lightning_version``) becomes the module entry ``model``; any other file's
``state_dict`` keeps its name. A Lightning checkpoint's other keys (``epoch``,
``global_step``, the index-keyed ``optimizer_states``, ...) are kept as plain values,
losslessly (to load index-keyed optimizer state into a live optimizer, see
``shardsafe.interop.import_torch_checkpoint``).
A file holding only tensors (a model's ``state_dict()``) becomes the module ``model``.

Writing produces one file that ``torch.load(weights_only=True)`` reads: modules as
``{fqn: tensor}``, optimizers as FQN-keyed state dicts; a Lightning checkpoint in
Lightning's own layout (``lightning_layout.py``), which Lightning loads. ``torch.save``
itself needs every tensor in memory at once, so the archive is written here instead: the
pickle of the structure first (tensors as references to storage records, exactly the
form torch.save pickles them in), then each tensor's bytes as its own stored (uncompressed) record,
aligned to 64 bytes as torch aligns them, one tensor in memory at a time. The result is
a pickle: the converter warns that loading it with ``weights_only=False`` runs code.
"""

from __future__ import annotations

import collections
import ctypes
import io
import math
import mmap
import pickle
import struct
import sys
import zipfile
from collections.abc import Callable, Mapping
from typing import Any

import torch

from .. import dtypes
from ..checkpoint.format.tensor_bytes import byte_view, memory
from ..checkpoint.storage.protocol import Storage
from ..errors import CheckpointCorruptError, CheckpointError
from ..pickles import load_torch, load_torch_mapped
from .bounds import aliased, loaded, view_span
from .dcp_read import RangeFile
from .entries import is_module, nested, to_entries
from .lightning_layout import VERSION_KEY, lightning_layout
from .sink_stream import SinkStream
from .source import Source, SourceTensor, TensorRef

PICKLE_WARNING = (
    "the result is a pickle (torch.save format): load it with "
    "torch.load(path, weights_only=True); with weights_only=False, a file from someone "
    "else can run code"
)
MAX_IN_MEMORY_BYTES = 64 << 30
_ARCHIVE = "archive"
_ALIGN = 64
PIECE_BYTES = 16 << 20


def read(storage: Storage, name: str) -> Source:
    """The ``torch.save`` file ``name`` in ``storage`` as a :class:`Source`."""
    where = storage.where(name)
    if storage.kind(name) != "file":
        raise CheckpointError(f"{where} is {storage.describe(name)}, not a file")
    raw, mapped = _load(storage, name, where)
    if not isinstance(raw, dict) or not all(isinstance(k, str) for k in raw):
        raise CheckpointError(
            f"{where} does not hold a dict with string keys, so it has no named entries to convert"
        )
    tree: dict[str, Any]
    if _lightning_state_dict(raw):
        tree = {("model" if k == "state_dict" else k): v for k, v in raw.items()}  # in order
    elif is_module(raw):
        tree = {"model": raw}
    else:
        tree = raw

    viewed: dict[str, torch.Tensor] = {}

    def make(key: str, tensor: torch.Tensor) -> SourceTensor:
        # Only pages of the file mapping may be dropped: anonymous memory would be zeroed.
        release = (lambda: drop_pages(tensor)) if mapped else None
        viewed[key] = tensor
        return loaded(where, key, tensor, release)

    values, tensors = to_entries(tree, make)
    aliased(where, tensors, viewed)  # many views of one storage: each written whole
    return Source("torch", where, values, tensors)


def _lightning_state_dict(raw: dict[str, Any]) -> bool:
    """Whether ``raw`` is a Lightning checkpoint whose ``state_dict`` becomes the module
    ``model`` (``lightning_layout`` gives it its name back, knowing it by
    ``pytorch-lightning_version``). Only then: a plain file's ``{"state_dict": ...,
    "epoch": 3}`` (timm's, torchvision's) came back from ``--to torch`` as ``model``, and
    its user's code failed on ``KeyError: 'state_dict'`` (found in review). And only where
    ``model`` is free: ``{"state_dict": ..., "model": "resnet50"}`` would lose one of them;
    then both keep their names."""
    return VERSION_KEY in raw and isinstance(raw.get("state_dict"), dict) and "model" not in raw


_MADV_DONTNEED = 4
_libc: Any = None


def drop_pages(tensor: torch.Tensor) -> None:
    """Give back this process's copy of the pages of a tensor memory-mapped (privately,
    read-only use) from a file, once it has been written out (Linux
    ``madvise(MADV_DONTNEED)``; elsewhere nothing). Never call it on any other tensor:
    on anonymous memory it zeroes the pages.

    ``torch.load(mmap=True)`` maps the file privately: every page a conversion reads
    stays resident in the process until the whole file is unmapped, so converting a
    10 GB file would end with 10 GB resident. The mapping is private and never written,
    so dropping pages is safe: a later read (another view of the storage) faults them in
    again from the file. Which pages: see :func:`page_span`.
    """
    global _libc
    span = page_span(tensor)
    if not sys.platform.startswith("linux") or span is None:
        return
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    _libc.madvise(span[0], span[1] - span[0], _MADV_DONTNEED)


def page_span(tensor: torch.Tensor) -> tuple[int, int] | None:
    """``[start, end)`` addresses of the whole pages that lie inside ``tensor``'s storage
    and hold bytes its view reaches; ``None`` if there are none.

    Not ``data_ptr()`` plus ``numel * itemsize``: an expanded view (stride 0) of one
    element declares any number of them, and that span runs past the file's mapping into
    whatever memory follows. ``torch.load(mmap=True)`` maps the whole file once and makes
    each storage a slice of that mapping (one that claims more bytes than the file holds
    is cut at its end), and a view never reaches outside its storage; so pages wholly
    inside the storage belong to the mapping. A page the storage only partly covers is
    left alone: at either end of the file it may lie outside the mapping, and keeping
    two pages per tensor resident costs nothing.
    """
    if tensor.layout != torch.strided or tensor.device.type != "cpu":
        return None
    storage = tensor.untyped_storage()
    base, size = storage.data_ptr(), storage.nbytes()
    first, end = view_span(tensor)
    end = min(end, size)
    if base == 0 or end <= first:
        return None
    page = mmap.PAGESIZE
    start = max((base + first) // page * page, -(-base // page) * page)
    stop = min(-(-(base + end) // page) * page, (base + size) // page * page)
    return (start, stop) if stop > start else None


def _load(storage: Storage, name: str, where: str) -> tuple[Any, bool]:
    """The file's contents, and whether its tensors are memory-mapped from the file. The
    file is opened once; a local one is mapped through its descriptor's path, so the name
    cannot be swapped between the checks and the load (``pickles.load_torch_mapped``)."""
    with storage.open_reader(name) as reader:
        path = reader.mapping_path()
        if path is not None:
            return load_torch_mapped(path, where)
        if reader.size > MAX_IN_MEMORY_BYTES:  # an object: read whole (docs/converting.md)
            raise CheckpointError(f"{where} is too large to read from an object store")
        return load_torch(_whole(reader), where), False


class _Storage:
    """Stands for one tensor's storage record while the structure is pickled."""

    def __init__(self, key: str, record: str, tensor: SourceTensor) -> None:
        self.key, self.record, self.tensor = key, record, tensor


class _Pickler(pickle.Pickler):
    """Pickles :class:`TensorRef` s the way ``torch.save`` pickles tensors."""

    def __init__(self, file: io.BytesIO, source: Source) -> None:
        super().__init__(file, protocol=2)
        self.source = source
        self.storages: list[_Storage] = []

    def reducer_override(self, obj: Any) -> Any:
        if not isinstance(obj, TensorRef):
            return NotImplemented
        t = self.source.tensors.get(obj.key)
        if t is None:  # the manifest is checksummed, so it was written this way
            raise CheckpointCorruptError(
                f"the checkpoint's metadata refers to tensor {obj.key!r}, which it does not hold"
            )
        ref = _Storage(obj.key, str(len(self.storages)), t)
        self.storages.append(ref)
        stride = tuple(math.prod(t.shape[i + 1 :]) for i in range(len(t.shape)))
        hooks: collections.OrderedDict[Any, Any] = collections.OrderedDict()
        args = (ref, 0, tuple(t.shape), stride, False, hooks)
        if _storage_type(t.dtype) is torch.UntypedStorage:
            return torch._utils._rebuild_tensor_v3, (*args, t.dtype)
        return torch._utils._rebuild_tensor_v2, args

    def persistent_id(self, obj: Any) -> Any:
        if not isinstance(obj, _Storage):
            return None
        kind = _storage_type(obj.tensor.dtype)
        size = math.prod(obj.tensor.shape)
        if kind is torch.UntypedStorage:  # counted in bytes, as torch.save counts it
            size *= dtypes.itemsize(obj.tensor.dtype)
        return ("storage", kind, obj.record, "cpu", size)


def _storage_type(dtype: torch.dtype) -> Any:
    """The storage class ``torch.save`` records for a tensor of ``dtype``: a typed one
    (``FloatStorage``) where torch has one, else ``UntypedStorage`` with the dtype passed
    to ``_rebuild_tensor_v3`` (float8, uint16/32/64: torch's own "new dtypes")."""
    name = torch.storage._dtype_to_storage_type_map().get(dtype)
    return torch.UntypedStorage if name is None else getattr(torch, name)


def refuse_existing(storage: Storage, name: str) -> None:
    """Refuse an output file that exists: nothing is ever overwritten."""
    if storage.is_directory() and storage.exists(name):
        raise CheckpointError(f"{storage.where(name)} exists; nothing is ever overwritten")


def write(
    source: Source, storage: Storage, name: str, on_bytes: Callable[[int], None] | None = None
) -> int:
    """Write ``source`` as the ``torch.save`` file ``name``; return its size."""
    refuse_existing(storage, name)
    storage.make_directory()
    buf = io.BytesIO()
    pickler = _Pickler(buf, source)
    pickler.dump(torch_tree(source))
    sink = storage.create(name, size_hint=source.total_bytes)
    stream = SinkStream(sink)
    try:
        with zipfile.ZipFile(stream, "w", compression=zipfile.ZIP_STORED) as zf:  # type: ignore[call-overload]
            _record(zf, stream, "data.pkl", [memoryview(buf.getbuffer())])
            _record(zf, stream, ".format_version", [memoryview(b"1")])
            _record(zf, stream, ".storage_alignment", [memoryview(b"64")])
            _record(zf, stream, "byteorder", [memoryview(b"little")])
            for ref in pickler.storages:
                _write_tensor(zf, stream, ref, on_bytes)
            _record(zf, stream, "version", [memoryview(b"3\n")])
            _record(zf, stream, ".data/serialization_id", [memoryview(b"0" * 40)])
        size = sink.finish()
    except BaseException:
        sink.abort()
        storage.remove(name)
        raise
    try:
        verify(storage, name, source, pickler.storages)
    except BaseException:
        storage.remove(name)  # a file that does not read back as written is not left
        raise
    return size


def torch_tree(source: Source) -> dict[str, Any]:
    """What the file holds: ``source``'s nested entries, in Lightning's own layout for a
    Lightning checkpoint (``lightning_layout.py``), so that Lightning loads the file."""
    tree = nested(source)
    return lightning_layout(tree, source.where) or tree


def _write_tensor(
    zf: zipfile.ZipFile, stream: SinkStream, ref: _Storage, on_bytes: Callable[[int], None] | None
) -> None:
    tensor = ref.tensor.load_whole().contiguous()
    data = memory(byte_view(tensor))
    pieces = [data[i : i + PIECE_BYTES] for i in range(0, data.nbytes, PIECE_BYTES)]
    _record(zf, stream, f"data/{ref.record}", pieces or [memoryview(b"")])
    if on_bytes is not None:
        on_bytes(data.nbytes)
    del tensor, data, pieces
    ref.tensor.done()


def _record(zf: zipfile.ZipFile, stream: SinkStream, name: str, pieces: list[memoryview]) -> None:
    """One stored record, its data aligned to 64 bytes (padding in an extra field, as
    torch's own writer pads)."""
    full = f"{_ARCHIVE}/{name}"
    info = zipfile.ZipInfo(full, date_time=(1980, 1, 1, 0, 0, 0))
    info.compress_type = zipfile.ZIP_STORED
    info.file_size = sum(p.nbytes for p in pieces)
    header = 30 + len(full.encode()) + 4 + 20  # fixed part, name, "FB" field, zip64 field
    pad = -(stream.pos + header) % _ALIGN
    info.extra = b"FB" + struct.pack("<H", pad) + b"Z" * pad
    with zf.open(info, "w", force_zip64=True) as out:
        for piece in pieces:
            out.write(piece)


def verify(storage: Storage, name: str, source: Source, storages: list[_Storage]) -> None:
    """Read the archive back: every record's bytes against its zip CRC32 (zipfile checks
    it as a record is read to its end), piece by piece; and, for a local file, the pickle
    through ``torch.load(weights_only=True, mmap=True)`` of the same descriptor (no data
    read), each tensor's dtype and shape."""
    where = storage.where(name)
    try:
        with storage.open_reader(name) as reader:
            with zipfile.ZipFile(_whole(reader)) as zf:
                for info in zf.infolist():
                    with zf.open(info) as member:
                        while member.read(PIECE_BYTES):
                            pass
            # The file just checked, through its descriptor: never reopened by name, which
            # may name another file (or a link) by now.
            path = reader.mapping_path()
            if path is not None:
                loaded = torch.load(path, weights_only=True, mmap=True)
                _check_structure(loaded, source, where)
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointCorruptError(
            f"{where} does not read back as written: {type(e).__name__}: {e}"
        ) from None


def _whole(reader: Any) -> io.BufferedReader:
    return io.BufferedReader(RangeFile(reader, 0, reader.size))


def _check_structure(loaded: Any, source: Source, where: str) -> None:
    expected = torch_tree(source)

    def walk(a: Any, b: Any, path: str) -> None:
        if isinstance(b, TensorRef):
            t = source.tensors[b.key]
            if not (
                isinstance(a, torch.Tensor) and a.dtype == t.dtype and tuple(a.shape) == t.shape
            ):
                raise CheckpointCorruptError(f"{where}: {path} does not read back as written")
        elif isinstance(b, Mapping):
            # By position: torch.load keeps a dict's order, and a NaN key equals no key.
            if not isinstance(a, Mapping) or not _same_keys(list(a), list(b)):
                raise CheckpointCorruptError(f"{where}: {path} does not read back as written")
            for ka, kb in zip(a, b):
                walk(a[ka], b[kb], f"{path}[{kb!r}]")
        elif isinstance(b, (list, tuple)):
            if type(a) is not type(b) or len(a) != len(b):
                raise CheckpointCorruptError(f"{where}: {path} does not read back as written")
            for i, (x, y) in enumerate(zip(a, b)):
                walk(x, y, f"{path}[{i}]")

    walk(loaded, expected, "the file")


def _same_keys(a: list[Any], b: list[Any]) -> bool:
    """The same keys in the same order, a NaN key matching a NaN key."""
    return len(a) == len(b) and all(x == y or (x != x and y != y) for x, y in zip(a, b))
