"""``shardsafe.verify(path)``: prove that a checkpoint's bytes are exactly what was saved.

A checkpoint verifies when the manifest's own checksum matches, every data file is
present, is a regular file of the size the manifest recorded, has a safetensors header
whose CRC32 matches and which agrees with the manifest and with the official
``safetensors.safe_open`` (so any safetensors tool can load it), every tensor's CRC32
blocks match, every tensor a state entry's metadata refers to is in the checkpoint, and
every entry's metadata passes the checks a load runs on it before restoring anything
(those that need no live object: ``_check_metadata``).
Every problem is reported, not just the first, one line each naming the file and, where
the problem is inside a tensor, its key, so one run tells how much of a damaged
checkpoint is still good.

A checkpoint written before shardsafe checksummed its manifest and headers verifies with
a note saying what could not be checked.

Every file is opened once, without following links, and read through that descriptor.
The cross-check with safetensors runs on a private copy of the header bytes that were
read and checksummed (with a sparse data section of the file's size), never on the
checkpoint's path, which could be swapped for a symlink or a FIFO in between. Memory is
one checksum block, whatever sizes the manifest claims.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .._text import natural_key
from ..errors import CheckpointError
from .finding import manifest_at
from .plan.rank_copies import rank_copy_as_one_rank
from .references import KEYS_SHOWN, missing_tensors, some
from .storage.locations import open_storage, path_text, store_errors_of

if TYPE_CHECKING:
    from ..protocol import SavedValue
    from .format.manifest import Manifest
    from .format.safetensors_header import HeaderEntry
    from .io.reader import CheckpointReader
    from .storage.protocol import Storage

_OUT_OF_MEMORY = "os error 12"
"""How safetensors' Rust reader reports ENOMEM (a mapping refused under ``ulimit -v``)."""
UNCHECKED = {
    "manifest": "the manifest's own content",
    "headers": "the data files' safetensors headers",
}
"""What an older checkpoint may carry no checksum for, and how a note names it."""


@dataclass(frozen=True, kw_only=True)
class VerifyReport:
    """What :func:`verify` found. ``ok`` is true when ``problems`` is empty."""

    path: str
    """The checkpoint, as given."""
    problems: tuple[str, ...]
    """One line per problem: files first (in name order), then tensors (in key order);
    each names the data file and, for a problem inside a tensor, its key."""
    notes: tuple[str, ...]
    """What could not be checked without that being a problem with the checkpoint (an
    older checkpoint's missing checksums; a file too large for safetensors to map here)."""
    unchecked: tuple[str, ...]
    """The parts this checkpoint carries no checksum for (``"manifest"``, ``"headers"``;
    empty for any checkpoint written by a current shardsafe)."""
    data_files: int
    """Data files the manifest lists, every one of them checked."""
    tensors: int
    """Tensor keys the manifest lists, every one of them checked."""
    data_bytes: int
    """Bytes of the data files, as the manifest recorded them."""

    @property
    def ok(self) -> bool:
        return not self.problems


def verify(
    path: str | os.PathLike[str], *, storage_options: Mapping[str, Any] | None = None
) -> VerifyReport:
    """Check every byte of the checkpoint at ``path`` (a directory or an object-store URL,
    with fsspec's ``storage_options`` as ``load`` takes them) against its checksums.

    Returns a report for anything wrong with the data files; raises
    :class:`~shardsafe.CheckpointNotFoundError` when ``path`` holds no committed
    checkpoint (naming the newest one if ``path`` is a checkpoint root) and
    :class:`~shardsafe.CheckpointCorruptError` when its manifest cannot be trusted, since
    then there is nothing to check the data against. One process; nothing is written.
    """
    text = path_text(path)
    notes: list[str] = []
    with store_errors_of(text), open_storage(text, storage_options=storage_options) as storage:
        manifest = manifest_at(text, storage)
        problems = find_problems(storage, manifest, notes)
    unchecked = tuple(part for part in UNCHECKED if part not in manifest.covers)
    if unchecked:
        notes.append(
            f"not checked: {' and '.join(UNCHECKED[part] for part in unchecked)}, which this "
            "checkpoint carries no checksum for (it was written by an older shardsafe)"
        )
    return VerifyReport(
        path=text,
        problems=tuple(problems),
        notes=tuple(notes),
        unchecked=unchecked,
        data_files=len(manifest.files),
        tensors=len(manifest.tensors),
        data_bytes=manifest.total_bytes,
    )


def find_problems(
    storage: Storage | str, manifest: Manifest, notes: list[str] | None = None
) -> list[str]:
    """One line per problem, files first (in name order), then tensors (in key order).

    ``notes`` collects what could not be checked here without being a problem with the
    checkpoint (safetensors' own reader unable to map a large file under a memory limit).
    """
    from .io.reader import CheckpointReader

    if isinstance(storage, str):
        with open_storage(storage) as opened:
            return find_problems(opened, manifest, notes)
    notes = [] if notes is None else notes
    keys = _keys_by_file(manifest)
    problems: list[str] = []
    with CheckpointReader(storage, manifest, keep_header_bytes=True) as reader:
        unreadable = reader.check_files()
        for name in sorted(manifest.files, key=natural_key):
            if name in unreadable:
                problems.append(f"{unreadable[name]}; it holds {some(keys[name])}")
            if name in reader.header_bytes:
                problems += _check_with_safetensors(reader, name, notes)
        # Tensors in an unreadable file were reported with it; check the rest.
        problems += _unique(
            reader.verify_all(skip_files=set(unreadable), threads=_threads(storage, manifest))
        )
    return problems + metadata_problems(manifest)


def _threads(storage: Storage, manifest: Manifest) -> int:
    """As a one-process load reads (``reader.threads_for``)."""
    from .io.reader import threads_for

    return threads_for(storage.cheap_rereads, lambda: len(manifest.files), None, 1)


def metadata_problems(manifest: Manifest) -> list[str]:
    """One line per state entry whose metadata a load refuses (:func:`_check_metadata`)
    or that refers to tensors the checkpoint does not hold (``references.py``): every
    byte can be intact and the checkpoint still unloadable, if its metadata was written
    wrong (or forged, checksums recomputed)."""
    try:  # a tiered manager's rank copy, read as a load by path reads it
        manifest = rank_copy_as_one_rank(manifest)
    except CheckpointError as e:  # its record is not one: no load takes it
        return [str(e)]
    return [line for lines in entry_problems(manifest).values() for line in lines]


def entry_problems(manifest: Manifest) -> dict[str, list[str]]:
    """:func:`metadata_problems` by state entry, in name order, for a manifest already
    read as one rank's (``rank_copy_as_one_rank``): only the entries with a problem."""
    problems: dict[str, list[str]] = {}
    for name in sorted(manifest.values, key=natural_key):
        try:
            _check_metadata(manifest.values[name], manifest)
        except CheckpointError as e:
            problems[name] = [f"state entry {name!r}: {e}"]
            continue
        missing = missing_tensors(manifest, [name])
        if missing:
            problems[name] = missing
    return problems


def _check_metadata(value: SavedValue, manifest: Manifest) -> None:
    """Raise what a load raises for an entry's metadata before it restores anything, as
    far as that is known without the live objects: the built-in adapters' own checks
    (called, not copied), on every saving rank's record. An entry of a kind no built-in
    adapter writes (a user's adapter's) is checked for the tensors it refers to only."""
    import torch

    from .. import _tree
    from ..adapters import module, optimizer, rng, values

    if value.kind == "module":
        module.check_module_meta(value)
    elif value.kind == "optimizer":
        meta = optimizer.check_optimizer_meta(value)
        groups = meta["param_groups"]
        # Each tensor a group refers to stands in as one (missing ones: ``references``).
        tensors = dict.fromkeys(_tree.tensor_refs(groups), torch.empty(0))
        optimizer.checked_hyper([_tree.decode(g["hyper"], tensors) for g in groups], value)
    elif value.kind == "value":
        values.full_requests(value)
    elif value.kind == "stateful":
        values.check_stateful_meta(value, manifest.world_size)
    elif value.kind == "rng":
        rng.check_rng_meta(value)


def _keys_by_file(manifest: Manifest) -> dict[str, list[str]]:
    keys: dict[str, dict[str, None]] = {name: {} for name in manifest.files}
    for key in sorted(manifest.tensors, key=natural_key):
        for chunk in manifest.tensors[key].chunks:
            keys[chunk.file][key] = None
    return {name: list(found) for name, found in keys.items()}


def _check_with_safetensors(reader: CheckpointReader, name: str, notes: list[str]) -> list[str]:
    """Problems the official safetensors reader has with a file's header.

    shardsafe parses headers itself (to check offsets before trusting them); this guards
    against the two parsers disagreeing, which would make a file that passes here fail
    in another tool. It reads a private copy of exactly the header bytes shardsafe read.
    """
    from safetensors import safe_open

    from .format.safetensors_header import parse_header

    raw = reader.header_bytes[name]
    size = reader.manifest.files[name]
    try:
        ours: dict[str, HeaderEntry] | None = parse_header(name, raw, size)
    except Exception:  # reported by the reader already
        ours = None
    with tempfile.TemporaryDirectory(prefix="shardsafe-verify-") as private:
        copy = os.path.join(private, "header.safetensors")
        with open(copy, "wb") as f:
            f.write(raw)
            f.truncate(size)  # a sparse data section: nothing is allocated for it
        try:
            with safe_open(copy, framework="pt") as f:
                slices = {t: f.get_slice(t) for t in f.keys()}  # noqa: SIM118 - not a dict
                found = {t: (s.get_dtype(), s.get_shape()) for t, s in slices.items()}
        except Exception as e:  # safetensors raises its own error types, mmap failures too
            if _OUT_OF_MEMORY in str(e):  # it maps the whole file: not the file's fault
                notes.append(
                    f"{name} was not cross-checked with safetensors.safe_open, which could not "
                    f"map its {size} bytes here ({e}); shardsafe's own checks, the same rules, "
                    "passed"
                )
                return []
            return [f"{name} cannot be opened by safetensors.safe_open: {e}"]
    return [] if ours is None else _differences(name, ours, found)


def _differences(
    name: str, ours: dict[str, HeaderEntry], found: dict[str, tuple[str, list[int]]]
) -> list[str]:
    from .. import dtypes

    problems = []
    for tname in sorted(found.keys() & ours.keys(), key=natural_key):
        code, shape = found[tname]
        entry = ours[tname]
        if code != dtypes.safetensors_code(entry.dtype) or tuple(shape) != entry.shape:
            problems.append(
                f"{name}: safetensors reads tensor {tname!r} as {code}{list(shape)}, "
                f"shardsafe as {dtypes.safetensors_code(entry.dtype)}{list(entry.shape)}"
            )
    if found.keys() != ours.keys():
        problems.append(
            f"{name}: safetensors and shardsafe list different tensors "
            f"({sorted(found.keys() ^ ours.keys())[:KEYS_SHOWN]})"
        )
    return problems


def _unique(lines: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(lines))
