"""The chunk table of a version 2 manifest: every chunk of every tensor, as columns.

Version 1 wrote one JSON object per chunk, repeating its keys and its file's name; at a
million chunks (1,024 FSDP2 ranks x 1,000 parameters) that is 124 MiB and ~27 s to parse
and check, most of it building and checking a Python object per number. Version 2 keeps
the tensors' own records small (``"chunks": <count>``) and puts the chunks in one
top-level table, in tensor order (a tensor's chunks are the next ``count`` rows)::

    "chunks": {
      "rows": 2,
      "names": ["model/w"],           # stored tensor names, each listed once
      "file": "u32:<base64>",         # per row: index into "files" (in their order)
      "name": "u32:<base64>",         # per row: index into "names"
      "offsets": "u32:<base64>",      # ndim per row (the tensor's ndim); or "i64:..."
      "shape": "u32:<base64>",        # ndim per row; or "i64:..."
      "crc32": "u32:<base64>"         # one per checksum block of each row
    }

Each column is its type (``u32``: unsigned 32-bit, ``i64``: signed 64-bit; offsets and
shapes are written as u32 when every value fits) and the base64 of its values,
little-endian. A column cannot hold anything but integers of its width, and it decodes
at C speed straight into a tensor, so the checks (``table_checks.py``) run on whole
columns at once. The table is part of
``manifest.json``, so the manifest's CRC32 covers it and the checkpoint still comes into
existence in the one rename of its manifest.

Records (:class:`~.manifest_format.ChunkRecord`) are built from the table only when a
tensor's chunks are first used (:class:`LazyChunks`).
"""

from __future__ import annotations

import array
import base64
import binascii
import sys
from collections.abc import Iterator, Sequence
from typing import Any, overload

import torch

from .manifest_format import ChunkRecord, TensorRecord

COLUMNS: dict[str, tuple[str, ...]] = {
    "file": ("u32",),
    "name": ("u32",),
    "offsets": ("u32", "i64"),
    "shape": ("u32", "i64"),
    "crc32": ("u32",),
}
"""Column name -> the types it may be written in (the writer picks the narrowest)."""
TABLE_KEYS = frozenset(COLUMNS) | {"rows", "names"}

_CODES = {"u32": "I", "i64": "q"}
"""A column type -> its ``array`` type code."""
_WIDTHS = {"u32": 4, "i64": 8}
assert array.array("I").itemsize == 4 and array.array("q").itemsize == 8


def encode_column(values: Sequence[int], types: tuple[str, ...]) -> str:
    """``"<type>:<base64 of little-endian values>"``, in the first of ``types`` that holds
    every value."""
    kind = types[0] if len(types) == 1 or not values or max(values) < 1 << 32 else types[1]
    arr = array.array(_CODES[kind], values)
    if sys.byteorder == "big":
        arr.byteswap()
    return f"{kind}:{base64.b64encode(arr.tobytes()).decode('ascii')}"


def decode_column(text: object, types: tuple[str, ...]) -> torch.Tensor | None:
    """A column's values as int64, or ``None`` if ``text`` is not one of ``types``
    followed by strict base64 of whole values of its width."""
    if type(text) is not str:
        return None
    kind, sep, data = text.partition(":")
    if not sep or kind not in types:
        return None
    try:
        raw = base64.b64decode(data, validate=True)  # strict: only the alphabet, padded
    except (binascii.Error, ValueError):
        return None
    if len(raw) % _WIDTHS[kind]:
        return None
    arr = array.array(_CODES[kind], raw)
    if sys.byteorder == "big":
        arr.byteswap()
    if not arr:
        return torch.zeros(0, dtype=torch.int64, device="cpu")
    if kind == "u32":
        return torch.frombuffer(arr, dtype=torch.int32).to(torch.int64) & 0xFFFFFFFF
    return torch.frombuffer(arr, dtype=torch.int64).clone()


def encode(tensors: dict[str, TensorRecord], files: Sequence[str]) -> dict[str, Any]:
    """The table of ``tensors`` (in their order), files indexed in the order ``files``."""
    file_index = {name: i for i, name in enumerate(files)}
    names: dict[str, int] = {}
    cols: dict[str, list[int]] = {name: [] for name in COLUMNS}
    for rec in tensors.values():
        for c in rec.chunks:
            cols["file"].append(file_index[c.file])
            cols["name"].append(names.setdefault(c.name, len(names)))
            cols["offsets"].extend(c.offsets)
            cols["shape"].extend(c.shape)
            cols["crc32"].extend(c.crc32)
    table: dict[str, Any] = {"rows": len(cols["file"]), "names": list(names)}
    table.update({name: encode_column(cols[name], types) for name, types in COLUMNS.items()})
    return table


class Columns:
    """A validated table's columns, as Python lists on first use (shared by the tensors)."""

    def __init__(
        self,
        files: list[str],
        names: list[str],
        columns: dict[str, torch.Tensor],
        crc_starts: torch.Tensor,
    ) -> None:
        self.files, self.names = files, names
        self._tensors: dict[str, torch.Tensor] | None = {**columns, "crc_starts": crc_starts}
        self._lists: dict[str, list[int]] = {}

    def lists(self) -> dict[str, list[int]]:
        tensors = self._tensors  # once: another thread may be converting them too
        if tensors is not None:
            self._lists = {k: v.tolist() for k, v in tensors.items()}
            self._tensors = None
        return self._lists


class LazyChunks(Sequence[ChunkRecord]):
    """The chunks of one tensor: rows ``[row, row + count)`` of a validated table, each
    ``ndim`` entries wide in the offsets and shape columns (from ``flat``)."""

    __slots__ = ("_columns", "_count", "_flat", "_ndim", "_records", "_row")

    def __init__(self, columns: Columns, row: int, count: int, flat: int, ndim: int) -> None:
        self._columns, self._row, self._count = columns, row, count
        self._flat, self._ndim = flat, ndim
        self._records: tuple[ChunkRecord, ...] | None = None

    def records(self) -> tuple[ChunkRecord, ...]:
        if self._records is None:
            self._records = tuple(self._build())
        return self._records

    def _build(self) -> Iterator[ChunkRecord]:
        cols, files, names = self._columns.lists(), self._columns.files, self._columns.names
        file, name, offsets = cols["file"], cols["name"], cols["offsets"]
        shape, crc, crc_starts = cols["shape"], cols["crc32"], cols["crc_starts"]
        d, flat = self._ndim, self._flat
        for i in range(self._row, self._row + self._count):
            lo, hi = crc_starts[i], crc_starts[i + 1]
            yield ChunkRecord(
                files[file[i]],
                names[name[i]],
                tuple(offsets[flat : flat + d]),
                tuple(shape[flat : flat + d]),
                tuple(crc[lo:hi]),
            )
            flat += d

    def files(self) -> list[str]:
        """Each chunk's file, without building its records."""
        if self._records is not None:
            return [c.file for c in self._records]
        files, index = self._columns.files, self._columns.lists()["file"]
        return [files[i] for i in index[self._row : self._row + self._count]]

    def __len__(self) -> int:
        return self._count

    @overload
    def __getitem__(self, index: int) -> ChunkRecord: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[ChunkRecord]: ...
    def __getitem__(self, index: int | slice) -> ChunkRecord | Sequence[ChunkRecord]:
        return self.records()[index]

    def __iter__(self) -> Iterator[ChunkRecord]:
        return iter(self.records())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Sequence):
            return self.records() == tuple(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"LazyChunks({self.records()!r})"


def chunk_files(chunks: Sequence[ChunkRecord]) -> list[str]:
    """The file of each chunk (of either version), building no record that is not built."""
    if isinstance(chunks, LazyChunks):
        return chunks.files()
    return [c.file for c in chunks]
