"""The one gate every untrusted ``torch.save`` file passes: its pickle scanned, then loaded.

shardsafe never pickles, but it reads what others pickled: ``torch.save`` files and
Lightning ``.ckpt`` files (the converters, Lightning resume, ``interop``) and the
``torch.save`` items inside DCP's ``.distcp`` files. ``torch.load(weights_only=True)`` runs
no code, but it hands the pickle to an unpickler as it is. :func:`load_torch` reads the
archive's ``data.pkl`` with torch's own zip reader (the bytes ``torch.load`` will
unpickle), passes it through :func:`~.scan.scan` with
:data:`TORCH_POLICY`, refuses records that unpack to more than the archive holds and the
legacy pre-1.6 format (several pickles followed by raw bytes), and only then calls
``torch.load``. DCP's ``.metadata`` goes through the same scan with its own policy
(``converters/dcp_metadata.py``).
"""

from __future__ import annotations

import io
import mmap
import sys
from typing import IO, Any

import torch

from .. import dtypes
from .._text import terminal_safe
from ..errors import CheckpointCorruptError, CheckpointError
from . import calls
from .machine import Machine
from .nodes import ATOM, GLOBAL, PERSISTENT, TUPLE
from .policy import Policy
from .scan import scan

_TORCH_CALLS = {
    # torch's tensor rebuilds, which torch checks (a storage reference; sizes that fit it).
    # Not _rebuild_from_type_v2 or _rebuild_parameter_with_state: they call any global they
    # are given and set any attribute on the tensor, and plain state never uses them.
    **dict.fromkeys(
        (("torch._utils", n) for n in ("_rebuild_tensor", "_rebuild_tensor_v2",
                                       "_rebuild_tensor_v3", "_rebuild_parameter")),
        calls.ANY,
    ),
    ("torch", "Size"): calls.SIZE,
    ("torch", "device"): calls.SCALARS,
    ("torch.serialization", "_get_layout"): calls.SCALARS,
    ("collections", "OrderedDict"): calls.NO_ARGS,  # then filled by SETITEMS
    ("collections", "Counter"): calls.MAPPING,  # MultiStepLR's milestones
    ("_codecs", "encode"): calls.LATIN1,  # bytes, in protocol 2
    ("builtins", "set"): calls.ELEMENTS,
    ("builtins", "frozenset"): calls.ELEMENTS,
    ("builtins", "complex"): calls.SCALARS,
}  # fmt: skip
_STORAGE_TYPES = ("Float", "Double", "Half", "BFloat16", "Long", "Int", "Short", "Char", "Byte",
                  "Bool", "ComplexFloat", "ComplexDouble")  # fmt: skip

TORCH_POLICY = Policy(
    kind="torch.save file",
    holds="what torch.load(weights_only=True) reads (tensors and plain data)",
    globals=frozenset(_TORCH_CALLS)
    | {("torch.storage", "UntypedStorage")}
    | {("torch", f"{name}Storage") for name in _STORAGE_TYPES}
    | {("torch", name) for name in dtypes.all_names()},
    calls=_TORCH_CALLS,
    buildable={("collections", "OrderedDict"): frozenset({"_metadata"})},  # a state dict's
    mappings=frozenset({("collections", "OrderedDict")}),
    hashes_as={("torch", "Size"): ()},
    persistent_ids=True,
    fix_names=True,
)
"""What ``torch.save`` writes for tensors, parameters and plain data (a model's or an
optimizer's state dict, a Lightning checkpoint without custom objects): a subset of
``torch.load(weights_only=True)``'s own allowlist, without sparse, quantized, nested and
subclass tensors (which no converter writes out), tensors carrying attributes and
``bytearray``, each callable held to the arguments ``torch.save`` gives
it (``calls.py``)."""

_ZIP_MAGIC = b"PK\x03\x04"


def load_torch(stream: IO[bytes], where: str) -> Any:
    """``torch.load(stream, weights_only=True)`` on CPU, once the archive has passed
    :func:`check_archive`. Anything wrong is a CheckpointCorruptError naming ``where``."""
    check_archive(stream, where)
    return _torch_load(stream, where, mapped=False)


def load_torch_mapped(path: str, where: str) -> tuple[Any, bool]:
    """Like :func:`load_torch` for the file at ``path``, a name for an already opened file
    (``/proc/self/fd/N``: it is read twice, so it must not be a name someone can swap), its
    storages memory-mapped from the file where that is safe; and whether they are.

    Not where torch would write into the mapping: a big-endian archive (torch byteswaps the
    mapped storages in place, in private pages that a converter drops after use, so a
    second view would read unswapped bytes) or a ``MAP_SHARED`` default (the swap would
    reach the file). Those are read into memory instead."""
    with open(path, "rb") as stream:
        if check_archive(stream, where) and not _shared_mapping():
            return _torch_load(path, where, mapped=True), True
        return _torch_load(stream, where, mapped=False), False


def check_archive(stream: IO[bytes], where: str) -> bool:
    """Refuse ``stream`` (rewound after) unless it is a zip archive as ``torch.save`` writes
    it whose ``data.pkl`` passes :func:`~.scan.scan` with :data:`TORCH_POLICY` and whose
    records together unpack to at most the archive's size (``torch.save`` stores them
    uncompressed: a compressed record could make a small file allocate gigabytes); return
    whether its storages are in this machine's byte order (so ``torch.load`` will not
    byteswap them: ``load_torch_mapped`` maps only then)."""
    size = stream.seek(0, io.SEEK_END)
    stream.seek(0)
    if stream.read(4) != _ZIP_MAGIC:
        raise CheckpointCorruptError(
            f"{where} is not in the zip format torch.save has written since torch 1.6 (it "
            "may be the legacy format, several pickles followed by raw bytes, which "
            "shardsafe does not unpickle). If you trust it, re-save it with "
            "torch.save(torch.load(path, weights_only=True), new_path)."
        )
    stream.seek(0)
    try:
        archive = torch._C.PyTorchFileReader(stream)
        records = archive.get_all_records()
        sizes = {name: archive.get_record_size(name) for name in records}
        unpacked = sum(sizes.values())
        if unpacked > size:
            raise CheckpointCorruptError(
                f"{where}: its records unpack to {unpacked} bytes, more than the whole file "
                f"holds ({size}): compressed records, which torch.save never writes"
            )
        if "data.pkl" not in records:
            raise CheckpointCorruptError(f"{where} is a zip archive without torch's data.pkl")
        pickled = archive.get_record("data.pkl")
        order = archive.get_record("byteorder") if "byteorder" in records else None
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointCorruptError(
            f"{where} is not a readable torch.save archive: {type(e).__name__}: "
            f"{terminal_safe(str(e)[:500])}"
        ) from None
    finally:
        stream.seek(0)
    _check_storage_sizes(scan(pickled, where, TORCH_POLICY), sizes, where)
    return _byte_order(order) == sys.byteorder


def _check_storage_sizes(machine: Machine, sizes: dict[str, int], where: str) -> None:
    """Refuse a storage the pickle declares larger or smaller than its record.

    ``torch.load`` checks this when it reads records into memory, but not when it maps the
    file (``mmap=True``, :func:`load_torch_mapped`): it cuts each storage out of the
    whole file at its record's offset, as long as the pickle says. A few bytes of record
    then gave a tensor the bytes after it (the next record, zip headers), and thousands of
    1-byte records, each declared to run to the end, made a 4 MB file convert to 9 GiB,
    every byte of it counted as the file's own (found in review)."""
    for node, kind in enumerate(machine.kinds):
        if kind != PERSISTENT:
            continue
        pid = (machine.children[node] or [-1])[0]
        reference = _storage_reference(machine, pid)
        if reference is None:
            raise CheckpointCorruptError(
                f"{where}: its pickle holds the storage reference {machine.describe(pid)}, "
                "which is not ('storage', type, key, location, size) as torch.save writes "
                "it: the file is damaged or crafted"
            )
        key, declared = reference
        if declared is None:
            continue  # a storage type torch does not know: torch.load refuses it
        record = f"data/{key}"
        if record not in sizes:
            raise CheckpointCorruptError(
                f"{where}: its pickle refers to the storage '{terminal_safe(key)}', which has "
                f"no record '{terminal_safe(record)}' in the archive: the file is damaged"
            )
        if declared != sizes[record]:
            raise CheckpointCorruptError(
                f"{where}: its pickle declares the storage '{terminal_safe(key)}' as "
                f"{declared} bytes, but its record '{terminal_safe(record)}' holds "
                f"{sizes[record]}: the file is damaged or crafted (torch.save writes each "
                "storage's bytes as its record, and torch.load(weights_only=True) refuses it too)"
            )


def _storage_reference(machine: Machine, node: int) -> tuple[str, int | None] | None:
    """The key and byte size of the persistent id ``('storage', type, key, location,
    numel)`` at ``node``, as ``torch.load`` reads it (``numel`` elements of ``type``'s
    size; ``None`` for a storage type torch does not know); ``None`` if it is not one."""
    parts = machine.children[node] if node >= 0 and machine.kinds[node] == TUPLE else None
    if parts is None or len(parts) != 5:
        return None
    kind, key, numel = machine.values[parts[1]], machine.text(parts[2]), machine.values[parts[4]]
    if machine.kinds[parts[1]] != GLOBAL or key is None or machine.kinds[parts[4]] != ATOM:
        return None
    if type(numel) is not int or numel < 0:
        return None
    return key, None if (size := _item_size(kind)) is None else numel * size


def _item_size(storage_type: tuple[str, str]) -> int | None:
    """Bytes per element of a pickled storage type, ``None`` if torch does not know it."""
    if storage_type[1] == "UntypedStorage":
        return 1
    try:
        dtype = torch.storage._get_dtype_from_pickle_storage_type(storage_type[1])
    except Exception:  # torch's own refusal comes when it loads
        return None
    return int(dtype.itemsize)


def _byte_order(record: bytes | None) -> str:
    """The byte order ``torch.load`` reads an archive's storages in (its rules)."""
    if record is not None:
        return record.decode("ascii", "replace")
    default = torch.serialization.get_default_load_endianness()
    if default == torch.serialization.LoadEndianness.BIG:
        return "big"
    if default == torch.serialization.LoadEndianness.NATIVE:
        return sys.byteorder
    return "little"


def _shared_mapping() -> bool:
    flags = torch.serialization.get_default_mmap_options()
    return flags is not None and flags == getattr(mmap, "MAP_SHARED", None)


def _torch_load(file: str | IO[bytes], where: str, *, mapped: bool) -> Any:
    try:
        return torch.load(file, map_location="cpu", weights_only=True, mmap=mapped)
    except CheckpointError:
        raise
    except Exception as e:  # torch raises many types for a damaged archive
        said = str(e).split("\nException raised from", 1)[0]  # not torch's C++ stack
        # Escaped: the message quotes the file (a record's name), and a newline there
        # forged a line of the command's output (found in review).
        raise CheckpointCorruptError(
            f"cannot read {where} with torch.load(weights_only=True): {type(e).__name__}: "
            f"{terminal_safe(said[:1000])}. shardsafe reads only files made of tensors and "
            "plain data; re-save it without custom objects."
        ) from None
