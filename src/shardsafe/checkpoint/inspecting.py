"""``shardsafe.inspect(path)``: what a checkpoint holds, read from its manifest alone.

No data file is opened, so this is instant even for a checkpoint of hundreds of GB, and
works on a checkpoint whose data files are damaged (``verify`` checks those).

Byte counts of data files are those the manifest recorded at save time. A file's writer
is read from its name: under layout "sharded" rank ``r`` of ``n`` writes
``shard-<r>-of-<n>.safetensors`` (a replicated tensor, a pipeline stage's or a buffer, is
in the file of the one rank that wrote it; a tiered manager's rank checkpoint also has
``small-<r>-of-<n>``, its small pieces); under "consolidated" rank 0 writes every file.
A file whose name says nothing (a manifest from elsewhere) has writer ``None``; so has a
tiered rank checkpoint's ``part-<i>-of-<n>``, written by the ``i``-th rank of a node that
the manifest does not name (``tiers/node_share.py``).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from .. import dtypes
from .._text import natural_key
from ..protocol import SavedValue
from .finding import manifest_at
from .format.manifest import Manifest, TensorRecord
from .format.manifest_format import Layout
from .format.manifest_table import chunk_files
from .storage.locations import is_url, local_path, open_storage, path_text, store_errors_of

_SHARD_NAME = re.compile(r"(?:shard|small)-([0-9]{5,12})-of-([0-9]{5,12})\.safetensors")


@dataclass(frozen=True, slots=True)
class ValueSummary:
    """One saved state value (a top-level name of the ``state`` that was saved)."""

    name: str
    kind: str
    """The adapter that saved it: ``"module"``, ``"optimizer"``, ``"rng"``, ``"value"``..."""
    tensors: int
    tensor_bytes: int
    value: Any = None
    """The saved JSON data, for kind ``"value"`` only (else ``None``)."""


@dataclass(frozen=True, slots=True)
class TensorSummary:
    """One saved tensor, whole: its key, type, global shape and where its pieces are."""

    key: str
    value: str | None
    """The state value it belongs to (its key's first segment), or ``None``."""
    dtype: str
    """``"float32"``, ``"bfloat16"``...: torch's name without ``torch.``."""
    shape: tuple[int, ...]
    numel: int
    bytes: int
    chunks: int
    """Saved pieces (one per writing rank's shard, or one for a whole tensor)."""
    files: tuple[str, ...]
    """The data files holding its pieces, in the order of the pieces."""
    writers: tuple[int | None, ...]
    """The ranks that wrote its pieces, sorted (``None``, last: a file naming no rank)."""


@dataclass(frozen=True, slots=True)
class FileSummary:
    """One data file."""

    name: str
    bytes: int
    tensors: int
    """Tensor pieces stored in it."""
    writer: int | None
    """The rank that wrote it, or ``None`` if its name does not say."""


@dataclass(frozen=True, slots=True)
class WriterSummary:
    """One rank that wrote data files (how evenly a save spread its writing)."""

    rank: int | None
    files: tuple[str, ...]
    bytes: int
    tensors: int
    """Keys with a piece in its files."""


@dataclass(frozen=True, slots=True)
class Totals:
    data_files: int
    data_bytes: int
    """Sum of the data files' sizes."""
    manifest_bytes: int
    bytes: int
    """``data_bytes + manifest_bytes``: the checkpoint on disk."""
    tensors: int
    tensor_bytes: int
    """Sum of the tensors' sizes."""
    values: int


@dataclass(frozen=True, kw_only=True)
class InspectReport:
    """What :func:`inspect` read from a checkpoint's manifest. Lists are sorted for a
    reader: values and files by name, tensors by key, numbers in natural order
    (``layers.2`` before ``layers.10``), writers by rank (``None`` last)."""

    path: str
    """The checkpoint directory, absolute (a URL as given)."""
    format: str
    format_version: int
    layout: Layout
    world_size: int
    """Ranks that saved it."""
    created_unix: float | None
    created: str | None
    """``created_unix`` as ISO 8601 in UTC (``"2025-01-31T12:00:00+00:00"``)."""
    shardsafe_version: str | None
    torch_version: str | None
    checksum_algorithm: str
    checksum_block_bytes: int
    values: tuple[ValueSummary, ...]
    tensors: tuple[TensorSummary, ...]
    files: tuple[FileSummary, ...]
    writers: tuple[WriterSummary, ...]
    totals: Totals

    def to_dict(self) -> dict[str, Any]:
        """The report as one JSON-able document (``shardsafe inspect --json`` prints it):
        the fields above by the same names, tuples as lists, ``checksum`` as
        ``{"algorithm", "block_bytes"}``, and a value's ``value`` present only for kind
        ``"value"``. Stable: new fields may be added, existing ones keep their name and
        meaning."""
        return {
            "path": self.path,
            "format": self.format,
            "format_version": self.format_version,
            "layout": self.layout,
            "world_size": self.world_size,
            "created_unix": self.created_unix,
            "created": self.created,
            "shardsafe_version": self.shardsafe_version,
            "torch_version": self.torch_version,
            "checksum": {
                "algorithm": self.checksum_algorithm,
                "block_bytes": self.checksum_block_bytes,
            },
            "values": [_value_doc(v) for v in self.values],
            "tensors": [_tensor_doc(t) for t in self.tensors],
            "files": [
                {"name": f.name, "bytes": f.bytes, "tensors": f.tensors, "writer": f.writer}
                for f in self.files
            ],
            "writers": [
                {"rank": w.rank, "files": list(w.files), "bytes": w.bytes, "tensors": w.tensors}
                for w in self.writers
            ],
            "totals": {
                "data_files": self.totals.data_files,
                "data_bytes": self.totals.data_bytes,
                "manifest_bytes": self.totals.manifest_bytes,
                "bytes": self.totals.bytes,
                "tensors": self.totals.tensors,
                "tensor_bytes": self.totals.tensor_bytes,
                "values": self.totals.values,
            },
        }


def inspect(
    path: str | os.PathLike[str], *, storage_options: Mapping[str, Any] | None = None
) -> InspectReport:
    """What the checkpoint at ``path`` holds (a directory or an object-store URL, with
    fsspec's ``storage_options`` as ``load`` takes them), from its manifest alone.

    Raises :class:`~shardsafe.CheckpointNotFoundError` when ``path`` holds no committed
    checkpoint (naming the newest one if ``path`` is a checkpoint root) and
    :class:`~shardsafe.CheckpointCorruptError` for a manifest that cannot be trusted.
    """
    text = path_text(path)
    with store_errors_of(text), open_storage(text, storage_options=storage_options) as storage:
        manifest = manifest_at(text, storage)  # read once; everything below comes from it
    return report(text if is_url(text) else os.path.abspath(local_path(text)), manifest)


def report(path: str, manifest: Manifest) -> InspectReport:
    """The report of an already parsed ``manifest``, for the checkpoint at ``path``."""
    names = sorted(manifest.values, key=natural_key)
    writer = {name: _writer(name, manifest.layout) for name in manifest.files}
    file_names = sorted(manifest.files, key=natural_key)  # sorted once: there may be many
    tensors = [_tensor(key, rec, manifest.values, writer) for key, rec in manifest.tensors.items()]
    tensors.sort(key=lambda t: natural_key(t.key))
    by_value: dict[str, list[TensorSummary]] = {name: [] for name in names}
    for t in tensors:
        if t.value is not None:
            by_value[t.value].append(t)
    pieces: dict[str, int] = dict.fromkeys(manifest.files, 0)
    for rec in manifest.tensors.values():
        for file in chunk_files(rec.chunks):
            pieces[file] += 1
    created = _number(manifest.info.get("created_unix"))
    data_bytes = manifest.total_bytes
    return InspectReport(
        path=path,
        format="shardsafe",
        format_version=manifest.version,
        layout=manifest.layout,
        world_size=manifest.world_size,
        created_unix=created,
        created=_iso(created),
        shardsafe_version=_string(manifest.info.get("shardsafe_version")),
        torch_version=_string(manifest.info.get("torch_version")),
        checksum_algorithm="crc32",
        checksum_block_bytes=manifest.block_bytes,
        values=tuple(_value(manifest.values[n], by_value[n]) for n in names),
        tensors=tuple(tensors),
        files=tuple(
            FileSummary(name, manifest.files[name], pieces[name], writer[name])
            for name in file_names
        ),
        writers=_writers(file_names, manifest.files, writer, tensors),
        totals=Totals(
            data_files=len(manifest.files),
            data_bytes=data_bytes,
            manifest_bytes=manifest.manifest_bytes,
            bytes=data_bytes + manifest.manifest_bytes,
            tensors=len(tensors),
            tensor_bytes=sum(t.bytes for t in tensors),
            values=len(names),
        ),
    )


def _owner(key: str, values: Mapping[str, SavedValue]) -> str | None:
    """The state value a tensor key belongs to: its first segment (value names hold no
    ``/``), if the manifest has such a value."""
    name = key.split("/", 1)[0]
    return name if name in values else None


def _writer(name: str, layout: str) -> int | None:
    """The rank that wrote data file ``name``: the ``r`` of ``shard-<r>-of-<n>`` under
    layout "sharded", rank 0 under "consolidated"; None if the name does not say."""
    if layout == "consolidated":
        return 0
    match = _SHARD_NAME.fullmatch(name)
    if match is None or int(match[1]) >= int(match[2]):
        return None
    return int(match[1])


def _writers(
    names: list[str],
    files: Mapping[str, int],
    writer: Mapping[str, int | None],
    tensors: list[TensorSummary],
) -> tuple[WriterSummary, ...]:
    """Per writing rank: its files, their bytes and the number of keys stored in them
    (one pass over the files and one over the tensors)."""
    by_rank: dict[int | None, list[str]] = {}
    for name in names:
        by_rank.setdefault(writer[name], []).append(name)
    keys: dict[int | None, int] = dict.fromkeys(by_rank, 0)
    for t in tensors:
        for rank in {writer[f] for f in t.files}:
            keys[rank] += 1
    ranks = sorted(by_rank, key=lambda r: (r is None, r or 0))
    return tuple(
        WriterSummary(rank, tuple(by_rank[rank]), sum(files[f] for f in by_rank[rank]), keys[rank])
        for rank in ranks
    )


def _tensor(
    key: str,
    rec: TensorRecord,
    values: Mapping[str, SavedValue],
    writer: Mapping[str, int | None],
) -> TensorSummary:
    files = tuple(dict.fromkeys(chunk_files(rec.chunks)))
    ranks = {writer[f] for f in files}
    return TensorSummary(
        key=key,
        value=_owner(key, values),
        dtype=dtypes.dtype_name(rec.dtype),
        shape=tuple(rec.shape),
        numel=math.prod(rec.shape),
        bytes=rec.nbytes,
        chunks=len(rec.chunks),
        files=files,
        writers=tuple(sorted(r for r in ranks if r is not None))
        + ((None,) if None in ranks else ()),
    )


def _value(saved: SavedValue, mine: list[TensorSummary]) -> ValueSummary:
    return ValueSummary(
        name=saved.name,
        kind=saved.kind,
        tensors=len(mine),
        tensor_bytes=sum(t.bytes for t in mine),
        value=saved.meta if saved.kind == "value" else None,
    )


def _value_doc(v: ValueSummary) -> dict[str, Any]:
    out: dict[str, Any] = {
        "name": v.name,
        "kind": v.kind,
        "tensors": v.tensors,
        "tensor_bytes": v.tensor_bytes,
    }
    if v.kind == "value":
        out["value"] = v.value
    return out


def _tensor_doc(t: TensorSummary) -> dict[str, Any]:
    return {
        "key": t.key,
        "value": t.value,
        "dtype": t.dtype,
        "shape": list(t.shape),
        "numel": t.numel,
        "bytes": t.bytes,
        "chunks": t.chunks,
        "files": list(t.files),
        "writers": list(t.writers),
    }


def _number(value: object) -> float | None:
    """``value`` as a float, if it is a number a float holds (not ``10**400``)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    try:
        number = float(value)
    except OverflowError:  # an int beyond the float range: valid JSON, no time
        return None
    return number if math.isfinite(number) else None


def _string(value: object) -> str | None:
    return value if isinstance(value, str) else None


def _iso(unix: float | None) -> str | None:
    if unix is None:
        return None
    try:
        return datetime.fromtimestamp(unix, tz=timezone.utc).isoformat(timespec="seconds")
    except (OverflowError, OSError, ValueError):  # a manifest from anywhere: absurd times
        return None
