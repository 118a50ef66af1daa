"""Hostile checkpoints made the way a forger would: checksums recomputed after each edit.

A CRC32 catches accidental damage, not a deliberate edit: anyone can recompute it. Tests
of the structural checks behind the checksums therefore edit a checkpoint *and* fix its
checksums, so that what must catch the problem is the validation, not the CRC. The
format is written out here independently of shardsafe's writer, pinning it:
``manifest.json`` ends with ``,\\n "manifest_crc32": "<8 hex digits>"\\n}\\n``, the CRC32
of every byte before that line; ``files[name]["header_crc32"]`` is the CRC32 of a data
file's 8-byte length prefix and JSON header.
"""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path
from typing import Any

CRC_KEY = "manifest_crc32"


def manifest_bytes(doc: dict[str, Any]) -> bytes:
    """``doc`` as a manifest whose own checksum matches (any old one is replaced)."""
    body = json.dumps({k: v for k, v in doc.items() if k != CRC_KEY}).encode()
    head = body[: -len(b"}")]
    return head + b',\n "%s": "%08x"\n}\n' % (CRC_KEY.encode(), zlib.crc32(head))


def sign(text: str) -> bytes:
    """A manifest's JSON text (an object, without a checksum) with its checksum appended."""
    head = text.rstrip().removesuffix("}").rstrip().encode()
    return head + b',\n "%s": "%08x"\n}\n' % (CRC_KEY.encode(), zlib.crc32(head))


def read_manifest(ckpt: Path) -> dict[str, Any]:
    return json.loads((ckpt / "manifest.json").read_text())  # type: ignore[no-any-return]


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
