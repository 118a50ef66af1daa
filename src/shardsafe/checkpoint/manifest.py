"""``manifest.json``: the one file whose presence makes a directory a checkpoint.

The manifest is parsed as hostile input: a checkpoint may come from anywhere. Parsing
rejects (with :class:`CheckpointCorruptError`) anything that could make a reader touch a
file outside the checkpoint directory, allocate more than the data files hold, or
misinterpret bytes: path-like file names, negative or out-of-range shapes and offsets,
chunks that overlap or leave holes, two chunks naming the same stored tensor (which would
let a small file fill a huge tensor), unknown dtypes, duplicate JSON keys, non-UTF-8
text, absurd nesting. Everything downstream may trust a :class:`Manifest`.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import CheckpointCorruptError, CheckpointVersionError
from . import dtypes, geometry
from .entries import SavedValue

FORMAT = "shardsafe"
VERSION = 1
MANIFEST_NAME = "manifest.json"
MAX_MANIFEST_BYTES = 1 << 30
MAX_NDIM = 64
MAX_CHUNKS_PER_TENSOR = 1 << 16
MAX_DEPTH = 100
"""Deepest JSON nesting accepted; decoding values recurses, and real state is shallow."""
LAYOUTS = ("sharded", "consolidated")
_FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,200}\.safetensors")


@dataclass(frozen=True)
class ChunkRecord:
    """Where one piece of a tensor lives: a named tensor inside a data file."""

    file: str
    name: str
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    crc32: tuple[int, ...]


@dataclass(frozen=True)
class TensorRecord:
    dtype: torch.dtype
    shape: tuple[int, ...]
    chunks: tuple[ChunkRecord, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * dtypes.itemsize(self.dtype)


@dataclass(frozen=True)
class Manifest:
    layout: str
    world_size: int
    block_bytes: int
    values: dict[str, SavedValue]
    tensors: dict[str, TensorRecord]
    files: dict[str, int]
    info: dict[str, Any]

    def to_json(self) -> bytes:
        doc = {
            "format": FORMAT,
            "version": VERSION,
            "layout": self.layout,
            "world_size": self.world_size,
            "checksum": {"algorithm": "crc32", "block_bytes": self.block_bytes},
            "info": self.info,
            "files": {name: {"bytes": size} for name, size in sorted(self.files.items())},
            "values": {v.name: {"kind": v.kind, "meta": v.meta} for v in self.values.values()},
            "tensors": {key: _tensor_to_json(rec) for key, rec in sorted(self.tensors.items())},
        }
        return json.dumps(doc, indent=1, allow_nan=False).encode("utf-8")

    @property
    def total_bytes(self) -> int:
        return sum(self.files.values())


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


def crc_block_count(nbytes: int, block_bytes: int) -> int:
    """How many CRC32 values a chunk of ``nbytes`` carries (one per block, at least one)."""
    return max(1, -(-nbytes // block_bytes))


# ---------------------------------------------------------------------------- parsing


def parse(raw: bytes, where: str = MANIFEST_NAME) -> Manifest:
    """Parse and validate manifest bytes; raise :class:`CheckpointCorruptError` on anything off."""
    doc = _load_json(raw, where)
    p = _Parser(where)
    p.require(isinstance(doc, dict), "the top level is not a JSON object")
    p.require(doc.get("format") == FORMAT, f"'format' is {doc.get('format')!r}, not {FORMAT!r}")
    version = doc.get("version")
    p.require(_is_int(version) and version >= 1, f"'version' is {version!r}, not a positive int")
    if version > VERSION:
        raise CheckpointVersionError(
            f"{where} declares format version {version}, but this shardsafe reads versions up "
            f"to {VERSION}. Upgrade shardsafe (pip install -U shardsafe) to load it."
        )
    layout = doc.get("layout")
    p.require(layout in LAYOUTS, f"'layout' is {layout!r}, not one of {LAYOUTS}")
    world_size = doc.get("world_size")
    p.require(_is_int(world_size) and world_size >= 1, "'world_size' is not a positive int")
    checksum = doc.get("checksum")
    p.require(
        isinstance(checksum, dict) and checksum.get("algorithm") == "crc32",
        "'checksum' does not declare crc32",
    )
    block_bytes = checksum.get("block_bytes")
    p.require(
        _is_int(block_bytes) and block_bytes >= 8 and block_bytes % 8 == 0,
        "'checksum.block_bytes' is not a positive multiple of 8",
    )
    files = p.files(doc.get("files"))
    tensors = {
        key: p.tensor(key, rec, files, block_bytes)
        for key, rec in p.mapping(doc.get("tensors"), "tensors").items()
    }
    p.unique_stored_tensors(tensors)
    values = {}
    for name, rec in p.mapping(doc.get("values"), "values").items():
        p.require(
            isinstance(rec, dict) and isinstance(rec.get("kind"), str) and "meta" in rec,
            f"value {name!r} lacks 'kind' or 'meta'",
        )
        values[name] = SavedValue(name, rec["kind"], rec["meta"])
    info = doc.get("info", {})
    p.require(isinstance(info, dict), "'info' is not an object")
    return Manifest(layout, world_size, block_bytes, values, tensors, files, info)


def _load_json(raw: bytes, where: str) -> Any:
    if len(raw) > MAX_MANIFEST_BYTES:
        raise CheckpointCorruptError(f"{where} is {len(raw)} bytes, larger than any real manifest")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CheckpointCorruptError(
            f"{where} is not valid UTF-8 ({e.reason} at byte {e.start}); the file is damaged"
        ) from None
    too_deep = CheckpointCorruptError(f"{where} is nested too deeply to be a manifest")
    try:
        doc = json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constant)
    except RecursionError:
        raise too_deep from None
    except ValueError as e:
        raise CheckpointCorruptError(f"{where} is not valid JSON: {e}") from None
    if _depth(doc) > MAX_DEPTH:
        raise too_deep
    return doc


def _depth(doc: Any) -> int:
    """Nesting depth of parsed JSON, without recursion."""
    deepest, stack = 0, [(doc, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            node = list(node.values())
        if isinstance(node, list):
            deepest = max(deepest, depth)
            stack.extend((v, depth + 1) for v in node)
    return deepest


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _no_constant(name: str) -> Any:
    raise ValueError(f"non-standard constant {name}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class _Parser:
    def __init__(self, where: str) -> None:
        self.where = where

    def require(self, ok: bool, problem: str) -> None:
        if not ok:
            raise CheckpointCorruptError(f"{self.where} is malformed: {problem}")

    def mapping(self, value: Any, name: str) -> dict[str, Any]:
        self.require(isinstance(value, dict), f"'{name}' is not an object")
        return value  # type: ignore[no-any-return]

    def files(self, value: Any) -> dict[str, int]:
        files = {}
        for name, rec in self.mapping(value, "files").items():
            self.require(
                _FILE_NAME.fullmatch(name) is not None and ".." not in name,
                f"data file name {name!r} is not a plain '*.safetensors' name inside the "
                "checkpoint directory (paths, '..' and absolute names are refused)",
            )
            size: Any = rec.get("bytes") if isinstance(rec, dict) else None
            self.require(_is_int(size) and size >= 8, f"file {name!r} has no valid 'bytes'")
            files[name] = int(size)
        return files

    def unique_stored_tensors(self, tensors: dict[str, TensorRecord]) -> None:
        stored: set[tuple[str, str]] = set()
        for key, rec in tensors.items():
            for c in rec.chunks:
                self.require(
                    (c.file, c.name) not in stored,
                    f"a chunk of {key!r} names the stored tensor {c.name!r} of {c.file}, "
                    "which another chunk names too",
                )
                stored.add((c.file, c.name))

    def ints(self, value: Any, what: str) -> tuple[int, ...]:
        self.require(
            isinstance(value, list)
            and len(value) <= MAX_NDIM
            and all(_is_int(v) and v >= 0 for v in value),
            f"{what} is not a list of non-negative ints",
        )
        return tuple(value)

    def tensor(self, key: str, rec: Any, files: dict[str, int], block_bytes: int) -> TensorRecord:
        self.require(isinstance(rec, dict), f"tensor {key!r} is not an object")
        dtype = dtypes.from_name(rec.get("dtype"))
        self.require(dtype is not None, f"tensor {key!r} has unknown dtype {rec.get('dtype')!r}")
        assert dtype is not None
        shape = self.ints(rec.get("shape"), f"the shape of {key!r}")
        self.require(  # what torch.empty can make, even with a zero dim (bytes: see chunk())
            math.prod(max(n, 1) for n in shape) < 1 << 63,
            f"the shape of {key!r} is too large for any tensor",
        )
        raw_chunks = rec.get("chunks")
        self.require(
            isinstance(raw_chunks, list) and 0 < len(raw_chunks) <= MAX_CHUNKS_PER_TENSOR,
            f"tensor {key!r} has no valid 'chunks' list",
        )
        chunks = tuple(self.chunk(key, c, shape, dtype, files, block_bytes) for c in raw_chunks)
        self.require(
            geometry.tiles(shape, [(c.offsets, c.shape) for c in chunks]),
            f"the chunks of {key!r} overlap or leave holes",
        )
        return TensorRecord(dtype, shape, chunks)

    def chunk(
        self,
        key: str,
        c: Any,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        files: dict[str, int],
        block_bytes: int,
    ) -> ChunkRecord:
        self.require(isinstance(c, dict), f"a chunk of {key!r} is not an object")
        file, name = c.get("file"), c.get("name")
        self.require(
            isinstance(file, str) and file in files,
            f"a chunk of {key!r} names file {file!r}, which 'files' does not list",
        )
        self.require(
            isinstance(name, str) and 0 < len(name) <= 4096,
            f"a chunk of {key!r} has no valid 'name'",
        )
        offsets = self.ints(c.get("offsets"), f"the offsets of a chunk of {key!r}")
        cshape = self.ints(c.get("shape"), f"the shape of a chunk of {key!r}")
        self.require(
            len(offsets) == len(shape) == len(cshape)
            and all(o + n <= s for o, n, s in zip(offsets, cshape, shape)),
            f"a chunk of {key!r} lies outside the tensor's shape {list(shape)}",
        )
        nbytes = math.prod(cshape) * dtypes.itemsize(dtype)
        self.require(nbytes <= files[file], f"a chunk of {key!r} is larger than file {file!r}")
        crc = c.get("crc32")
        self.require(
            isinstance(crc, list)
            and len(crc) == crc_block_count(nbytes, block_bytes)
            and all(_is_int(v) and 0 <= v < 1 << 32 for v in crc),
            f"a chunk of {key!r} has no valid 'crc32' list",
        )
        return ChunkRecord(file, name, offsets, cshape, tuple(crc))
