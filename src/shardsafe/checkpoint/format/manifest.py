"""``manifest.json``: the one file whose presence makes a directory a checkpoint.

This module writes it (:meth:`Manifest.to_json`; a save assembles it, ``saving.py``) and reads it
(:func:`parse`, with ``strict_json`` and ``manifest_checks`` doing the checking).

The manifest is parsed as hostile input: a checkpoint may come from anywhere. Parsing
rejects (with :class:`CheckpointCorruptError`) anything that could make a reader touch a
file outside the checkpoint directory, allocate more than the data files hold, or
misinterpret bytes: path-like file names, negative or out-of-range shapes and offsets,
chunks that overlap or leave holes, two chunks naming the same stored tensor (which would
let a small file fill a huge tensor), unknown dtypes, duplicate JSON keys, non-UTF-8
text, absurd nesting. Everything downstream may trust a :class:`Manifest`.

Checksums (see ``docs/guarantees.md``): the manifest's own bytes end in a CRC32 of
everything before it (``"manifest_crc32"``, always the last key), every data file's
safetensors header has a CRC32 in ``files``, and every block of tensor data has one in
its chunk. ``checksum.covers`` lists what a manifest's checksums cover, so that one
written before a kind was checked (format version 1 as first released: data only) still
loads, while a newer one that lost its manifest checksum is refused. A CRC32 detects
accidental damage (bit flips, truncation, a partial copy); it does not stop a deliberate
forger, who can recompute it: that is what the structural checks here are for.

Versions (``manifest_format.VERSION``): 1 holds each chunk as a JSON object inside its
tensor's record; 2 (written since) holds every chunk in one table of binary columns
(``manifest_table.py``, checked by ``table_checks.py``). Both are read; a newer version is
refused with :class:`CheckpointVersionError`, before any field it may have changed.

Costs are linear in the manifest's size: every check here is a pass over the records
or the columns (the tiling check accepts any number of chunks that form a grid, the only
shape sharding produces, and checks other arrangements pairwise only up to a small count).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ... import dtypes
from ...errors import CheckpointCorruptError, CheckpointVersionError
from ...protocol import SavedValue
from . import manifest_table
from .crc import crc32
from .gc_pause import paused
from .manifest_checks import Checker, covers_of, is_int, verify_trailer
from .manifest_format import (
    COVERS,
    CRC_KEY,
    FORMAT,
    LAYOUTS,
    MANIFEST_NAME,
    MAX_CHUNKS_PER_TENSOR,
    MAX_DEPTH,
    MAX_FILE_BYTES,
    MAX_MANIFEST_BYTES,
    MAX_NAME_CHARS,
    MAX_NDIM,
    VERSION,
    ChunkRecord,
    Layout,
    TensorRecord,
    crc_block_count,
)
from .strict_json import load_manifest_json
from .table_checks import check_table

__all__ = [
    "COVERS",
    "FORMAT",
    "LAYOUTS",
    "MANIFEST_NAME",
    "MAX_CHUNKS_PER_TENSOR",
    "MAX_DEPTH",
    "MAX_FILE_BYTES",
    "MAX_MANIFEST_BYTES",
    "MAX_NAME_CHARS",
    "MAX_NDIM",
    "VERSION",
    "ChunkRecord",
    "Manifest",
    "TensorRecord",
    "crc_block_count",
    "parse",
]


@dataclass(frozen=True)
class Manifest:
    layout: Layout
    world_size: int
    block_bytes: int
    values: dict[str, SavedValue]
    tensors: dict[str, TensorRecord]
    files: dict[str, int]
    info: dict[str, Any]
    header_crc32: dict[str, int] = field(default_factory=dict)
    """CRC32 of each data file's safetensors header (length prefix and JSON)."""
    version: int = field(default=VERSION, compare=False)
    covers: frozenset[str] = field(default=frozenset(COVERS), compare=False)
    """What this manifest's checksums cover (older ones: ``{"data"}`` only)."""
    manifest_bytes: int = field(default=0, compare=False)
    """Size of the ``manifest.json`` it was parsed from (0 if built in memory)."""

    def to_json(self, version: int = VERSION) -> bytes:
        """The manifest's bytes, ending in the CRC32 of everything before it (``version``
        1 only to make checkpoints for older readers and tests of reading them)."""
        covers = [c for c in COVERS if c != "headers" or set(self.header_crc32) == set(self.files)]
        files = sorted(self.files)
        tensors = dict(sorted(self.tensors.items()))
        doc: dict[str, Any] = {
            "format": FORMAT,
            "version": version,
            "layout": self.layout,
            "world_size": self.world_size,
            "checksum": {"algorithm": "crc32", "block_bytes": self.block_bytes, "covers": covers},
            "info": self.info,
            "files": {name: self._file_json(name) for name in files},
            "values": {v.name: {"kind": v.kind, "meta": v.meta} for v in self.values.values()},
        }
        if version == 1:
            doc["tensors"] = {key: _tensor_to_json(rec) for key, rec in tensors.items()}
        elif version == VERSION:
            doc["tensors"] = {key: _tensor_head_json(rec) for key, rec in tensors.items()}
            doc["chunks"] = manifest_table.encode(tensors, files)
        else:
            raise ValueError(f"version is {version}; shardsafe writes versions 1 and {VERSION}")
        # Compact: json's C encoder (an indent would run its pure-Python one, 10x slower).
        body = json.dumps(doc, separators=(",", ":"), allow_nan=False).encode("utf-8")
        head = body[: -len(b"}")]
        return head + f',\n "{CRC_KEY}": "{crc32(memoryview(head), 0):08x}"\n}}\n'.encode()

    def _file_json(self, name: str) -> dict[str, int]:
        out = {"bytes": self.files[name]}
        if name in self.header_crc32:
            out["header_crc32"] = self.header_crc32[name]
        return out

    @property
    def total_bytes(self) -> int:
        return sum(self.files.values())


def _tensor_head_json(rec: TensorRecord) -> dict[str, Any]:
    return {
        "dtype": dtypes.dtype_name(rec.dtype),
        "shape": list(rec.shape),
        "chunks": len(rec.chunks),
    }


def _tensor_to_json(rec: TensorRecord) -> dict[str, Any]:
    return {
        "dtype": dtypes.dtype_name(rec.dtype),
        "shape": list(rec.shape),
        "chunks": [
            {
                "file": c.file,
                "name": c.name,
                "offsets": list(c.offsets),
                "shape": list(c.shape),
                "crc32": list(c.crc32),
            }
            for c in rec.chunks
        ],
    }


def parse(raw: bytes, where: str = MANIFEST_NAME) -> Manifest:
    """Parse and validate manifest bytes; raise :class:`CheckpointCorruptError` on anything
    off. The garbage collector is paused meanwhile (``gc_pause``: the document has no cycles)."""
    with paused():
        return _parse(raw, where)


def _parse(raw: bytes, where: str) -> Manifest:
    if len(raw) > MAX_MANIFEST_BYTES:
        raise CheckpointCorruptError(f"{where} is {len(raw)} bytes, larger than any real manifest")
    has_trailer = verify_trailer(raw, where)
    doc = load_manifest_json(raw, where)
    check = Checker(where)
    check.require(isinstance(doc, dict), "the top level is not a JSON object")
    version = _version(doc, check, where)
    covers = covers_of(doc, has_trailer, where)
    # Only version 1, as first released, was written without the manifest's own CRC32.
    check.require(version == 1 or "manifest" in covers, "'checksum.covers' lacks 'manifest'")
    layout = doc.get("layout")
    check.require(layout in LAYOUTS, f"'layout' is {layout!r}, not one of {LAYOUTS}")
    world_size = doc.get("world_size")
    check.require(is_int(world_size) and world_size >= 1, "'world_size' is not a positive int")
    block_bytes = check.block_bytes(doc.get("checksum"))
    files, header_crcs = check.files(doc.get("files"), needs_header_crc="headers" in covers)
    if version == 1:
        tensors = {
            key: check.tensor(key, rec, files, block_bytes)
            for key, rec in check.mapping(doc.get("tensors"), "tensors").items()
        }
        check.unique_stored_tensors(tensors)
    else:
        tensors = check_table(check, doc.get("tensors"), doc.get("chunks"), files, block_bytes)
    values = check.values(doc.get("values"))
    info = doc.get("info", {})
    check.require(isinstance(info, dict), "'info' is not an object")
    return Manifest(
        layout,
        world_size,
        block_bytes,
        values,
        tensors,
        files,
        info,
        header_crcs,
        version,
        covers,
        len(raw),
    )


def _version(doc: dict[str, Any], check: Checker, where: str) -> int:
    check.require(doc.get("format") == FORMAT, f"'format' is {doc.get('format')!r}, not {FORMAT!r}")
    version: Any = doc.get("version")
    check.require(is_int(version) and version >= 1, f"'version' is {version!r}, not a positive int")
    if version > VERSION:
        raise CheckpointVersionError(
            f"{where} declares format version {version}, but this shardsafe reads versions up "
            f"to {VERSION}. Upgrade shardsafe (pip install -U shardsafe) to load it."
        )
    return int(version)
