"""Hostile checkpoints made the way a forger would: checksums recomputed after each edit.

A CRC32 catches accidental damage, not a deliberate edit: anyone can recompute it. Tests
of the structural checks behind the checksums therefore edit a checkpoint *and* fix its
checksums, so that what must catch the problem is the validation, not the CRC. The
format is written out here independently of shardsafe's writer, pinning it:
``manifest.json`` ends with ``,\\n "manifest_crc32": "<8 hex digits>"\\n}\\n``, the CRC32
of every byte before that line; ``files[name]["header_crc32"]`` is the CRC32 of a data
file's 8-byte length prefix and JSON header.

Format version 2 keeps chunks in one table of base64 columns. :func:`read_manifest`
hands such a manifest over *expanded*: each tensor's ``"chunks"`` a list of version 1
chunk objects (``file``, ``name``, ``offsets``, ``shape``, ``crc32``), so that one edit
works on either version; :func:`manifest_bytes` packs an expanded version 2 document
back into its table (:func:`pack`; a chunk naming a file that ``files`` does not list
gets an index past the list's end). What the table's columns cannot hold (a string, a
float, a number out of range) can only be written as version 1: ``pack`` raises
:class:`Unpackable`, and a test that means such an edit sets ``"version": 1``.
"""

from __future__ import annotations

import base64
import json
import shutil
import struct
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

CRC_KEY = "manifest_crc32"


COLUMNS = {"file": "u32", "name": "u32", "offsets": "u32", "shape": "u32", "crc32": "u32"}
"""The type each column is packed in; offsets and shapes are "i64" when one needs it."""
CODES = {"u32": "I", "i64": "q"}


def unpack_column(text: str) -> list[int]:
    kind, data = text.split(":", 1)
    raw = base64.b64decode(data)
    code = CODES[kind]
    return list(struct.unpack(f"<{len(raw) // struct.calcsize(code)}{code}", raw))


def pack_column(values: list[int], kind: str) -> str:
    if kind == "u32" and values and not 0 <= min(values) <= max(values) < 1 << 32:
        kind = "i64"
    code = CODES[kind]
    return f"{kind}:" + base64.b64encode(struct.pack(f"<{len(values)}{code}", *values)).decode()


class Unpackable(ValueError):
    """An expanded version 2 document holds what version 2's columns cannot."""


def expanded(doc: dict[str, Any]) -> dict[str, Any]:
    """A version 2 document with its chunk table unpacked into the tensors' records."""
    table = doc.get("chunks")
    if doc.get("version") != 2 or not isinstance(table, dict):
        return doc
    cols = {name: unpack_column(table[name]) for name in COLUMNS}
    files, names = list(doc["files"]), table["names"]
    row = flat = crc = 0
    out = {k: v for k, v in doc.items() if k != "chunks"}
    out["tensors"] = {}
    for key, rec in doc["tensors"].items():
        d, chunks = len(rec["shape"]), []
        itemsize = _itemsize(rec["dtype"])
        for _ in range(rec["chunks"]):
            shape = cols["shape"][flat : flat + d]
            nbytes = _prod(shape) * itemsize
            blocks = max(1, -(-nbytes // doc["checksum"]["block_bytes"]))
            chunks.append(
                {
                    "file": files[cols["file"][row]],
                    "name": names[cols["name"][row]],
                    "offsets": cols["offsets"][flat : flat + d],
                    "shape": shape,
                    "crc32": cols["crc32"][crc : crc + blocks],
                }
            )
            row, flat, crc = row + 1, flat + d, crc + blocks
        out["tensors"][key] = {**rec, "chunks": chunks}
    return out


def pack(doc: dict[str, Any]) -> dict[str, Any]:
    """An expanded version 2 document (chunks as objects, no table) with its chunk table
    built; any other document as it is."""
    tensors = doc.get("tensors")
    if (
        doc.get("version") != 2
        or "chunks" in doc
        or not (
            isinstance(tensors, dict)
            and any(
                isinstance(r, dict) and isinstance(r.get("chunks"), list) for r in tensors.values()
            )
        )
    ):
        return doc
    files = {name: i for i, name in enumerate(doc["files"])}
    names: dict[str, int] = {}
    cols: dict[str, list[Any]] = {name: [] for name in COLUMNS}
    packed: dict[str, Any] = {}
    try:
        for key, rec in tensors.items():
            for c in rec["chunks"]:
                # A file 'files' does not list: an index past its end (v2's equivalent).
                cols["file"].append(files.setdefault(c["file"], len(files)))
                cols["name"].append(names.setdefault(c["name"], len(names)))
                cols["offsets"] += c["offsets"]
                cols["shape"] += c["shape"]
                cols["crc32"] += c["crc32"]
            packed[key] = {**rec, "chunks": len(rec["chunks"])}
        table: dict[str, Any] = {"rows": len(cols["file"]), "names": list(names)}
        for name, kind in COLUMNS.items():
            if not all(type(v) is int for v in cols[name]):  # struct would take a bool
                raise TypeError(f"a {name} value is not an int")
            table[name] = pack_column(cols[name], kind)
    except (KeyError, TypeError, struct.error) as e:
        raise Unpackable(f"version 2 cannot hold this edit ({e}); set 'version': 1") from e
    return {**doc, "tensors": packed, "chunks": table}


def _prod(values: list[int]) -> int:
    out = 1
    for v in values:
        out *= v
    return out


def _itemsize(dtype: str) -> int:
    import torch

    return int(getattr(torch, dtype).itemsize)  # the manifest's dtype names are torch's


def manifest_bytes(doc: dict[str, Any]) -> bytes:
    """``doc`` as a manifest whose own checksum matches (any old one is replaced); an
    expanded version 2 document is packed first."""
    doc = pack(doc)
    body = json.dumps({k: v for k, v in doc.items() if k != CRC_KEY}).encode()
    head = body[: -len(b"}")]
    return head + b',\n "%s": "%08x"\n}\n' % (CRC_KEY.encode(), zlib.crc32(head))


def sign(text: str) -> bytes:
    """A manifest's JSON text (an object, without a checksum) with its checksum appended."""
    head = text.rstrip().removesuffix("}").rstrip().encode()
    return head + b',\n "%s": "%08x"\n}\n' % (CRC_KEY.encode(), zlib.crc32(head))


def read_manifest(ckpt: Path) -> dict[str, Any]:
    """The manifest's document, a version 2 one expanded (see the module docstring)."""
    return expanded(json.loads((ckpt / "manifest.json").read_text()))


def write_manifest(ckpt: Path, doc: dict[str, Any]) -> None:
    (ckpt / "manifest.json").write_bytes(manifest_bytes(doc))


def header_crc(path: Path) -> int:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return zlib.crc32(raw[: 8 + n])


def resign_file(ckpt: Path, path: Path) -> None:
    """Record a data file's current size and header CRC32 in the manifest."""
    doc = read_manifest(ckpt)
    entry = doc["files"][path.name]
    entry["bytes"] = path.stat().st_size
    if "header_crc32" in entry:
        entry["header_crc32"] = header_crc(path)
    write_manifest(ckpt, doc)


def grid_doc(
    rows: int, cols: int, *, file_per_chunk: bool = False, block_bytes: int = 64
) -> dict[str, Any]:
    """A manifest of one float32 tensor [4 * rows, cols] cut into ``rows`` x ``cols``
    chunks of 4x1 elements (a valid grid), in one data file or one file per chunk."""
    files: dict[str, Any] = {}
    chunks = []
    n = rows * cols
    for r in range(rows):
        for c in range(cols):
            index = r * cols + c
            name = f"shard-{index if file_per_chunk else 0:05d}-of-{n:05d}.safetensors"
            files[name] = {"bytes": 4096, "header_crc32": 0}
            chunks.append(
                {
                    "file": name,
                    "name": f"model/w@{r * 4},{c}",
                    "offsets": [r * 4, c],
                    "shape": [4, 1],
                    "crc32": [index & 0xFFFFFFFF],
                }
            )
    return {
        "format": "shardsafe",
        "version": 1,
        "layout": "sharded",
        "world_size": len(files),
        "checksum": {
            "algorithm": "crc32",
            "block_bytes": block_bytes,
            "covers": ["data", "headers", "manifest"],
        },
        "info": {"shardsafe_version": "0.1.0"},
        "files": files,
        "values": {"model": {"kind": "module", "meta": {"tensors": ["w"], "extra": {}}}},
        "tensors": {"model/w": {"dtype": "float32", "shape": [4 * rows, cols], "chunks": chunks}},
    }


def wide_doc(n: int, shard: str = "shard-00000-of-00001.safetensors") -> dict[str, Any]:
    """A manifest of ``n`` values, each a 4-element tensor of its own in one data file
    (what a very wide state dict gives)."""
    doc = grid_doc(1, 1)
    doc["files"] = {shard: {"bytes": 16 * n + 4096, "header_crc32": 0}}
    doc["tensors"] = {
        f"v{i}": {
            "dtype": "float32",
            "shape": [4],
            "chunks": [
                {"file": shard, "name": f"v{i}", "offsets": [0], "shape": [4], "crc32": [i]}
            ],
        }
        for i in range(n)
    }
    doc["values"] = {f"v{i}": {"kind": "value", "meta": {"__tensor__": f"v{i}"}} for i in range(n)}
    return doc


def forged_copy(ckpt: Path, target: Path, edit: Callable[[dict[str, Any]], None]) -> Path:
    """A copy of ``ckpt`` at ``target`` whose manifest ``edit`` changed, checksums recomputed."""
    path = Path(shutil.copytree(ckpt, target))
    doc = read_manifest(path)
    edit(doc)
    write_manifest(path, doc)
    return path
