"""``manifest.json``: the one file whose presence makes a directory a checkpoint.

The manifest is parsed as hostile input: a checkpoint may come from anywhere. Parsing
rejects (with :class:`CheckpointCorruptError`) anything that could make a reader touch a
file outside the checkpoint directory, allocate more than the data files hold, or
misinterpret bytes: path-like file names, negative or out-of-range shapes and offsets,
chunks that overlap or leave holes, two chunks naming the same stored tensor (which would
let a small file fill a huge tensor), unknown dtypes, duplicate JSON keys, non-UTF-8
text, absurd nesting. Everything downstream may trust a :class:`Manifest`.

Checksums (see ``README.md``, Guarantees): the manifest's own bytes end in a CRC32 of
everything before it (``"manifest_crc32"``, always the last key), every data file's
safetensors header has a CRC32 in ``files``, and every block of tensor data has one in
its chunk. ``checksum.covers`` lists what a manifest's checksums cover, so that one
written before a kind was checked (format version 1 as first released: data only) still
loads, while a newer one that lost its manifest checksum is refused. A CRC32 detects
accidental damage (bit flips, truncation, a partial copy); it does not stop a deliberate
forger, who can recompute it: that is what the structural checks here are for.

Costs are linear in the manifest's size: every check here is a pass over the records
(the tiling check accepts any number of chunks that form a grid, the only shape
sharding produces, and checks other arrangements pairwise only up to a small count).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, NoReturn

import torch

from ..errors import CheckpointCorruptError, CheckpointVersionError
from . import dtypes, geometry
from .crc import crc32
from .entries import SavedValue

FORMAT = "shardsafe"
VERSION = 1
MANIFEST_NAME = "manifest.json"
MAX_MANIFEST_BYTES = 1 << 30
MAX_NDIM = 64
MAX_CHUNKS_PER_TENSOR = 1 << 16
MAX_DEPTH = 100
"""Deepest JSON nesting accepted; decoding values recurses, and real state is shallow."""
MAX_NAME_CHARS = 4096
"""Longest tensor key and stored-tensor name accepted (``save`` refuses longer keys)."""
MAX_FILE_BYTES = 1 << 62
LAYOUTS = ("sharded", "consolidated")
COVERS = ("data", "headers", "manifest")
"""What the checksums of a manifest written by this shardsafe cover."""
_FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,200}\.safetensors", re.ASCII)
_CRC_KEY = "manifest_crc32"
_TRAILER = re.compile(rb',\n "manifest_crc32": "([0-9a-f]{8})"\n\}\n')
_TRAILER_BYTES = len(b',\n "manifest_crc32": "00000000"\n}\n')


def valid_value_name(name: object) -> bool:
    """A state key ``save`` accepts: non-empty, no ``/``, not starting with ``@``."""
    return isinstance(name, str) and bool(name) and "/" not in name and not name.startswith("@")


@dataclass(frozen=True, slots=True)
class ChunkRecord:
    """Where one piece of a tensor lives: a named tensor inside a data file."""

    file: str
    name: str
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    crc32: tuple[int, ...]


@dataclass(frozen=True, slots=True)
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
    header_crc32: dict[str, int] = field(default_factory=dict)
    """CRC32 of each data file's safetensors header (length prefix and JSON)."""
    version: int = field(default=VERSION, compare=False)
    covers: frozenset[str] = field(default=frozenset(COVERS), compare=False)
    """What this manifest's checksums cover (older ones: ``{"data"}`` only)."""
    manifest_bytes: int = field(default=0, compare=False)
    """Size of the ``manifest.json`` it was parsed from (0 if built in memory)."""

    def to_json(self) -> bytes:
        """The manifest's bytes, ending in the CRC32 of everything before it."""
        covers = [c for c in COVERS if c != "headers" or set(self.header_crc32) == set(self.files)]
        doc = {
            "format": FORMAT,
            "version": VERSION,
            "layout": self.layout,
            "world_size": self.world_size,
            "checksum": {"algorithm": "crc32", "block_bytes": self.block_bytes, "covers": covers},
            "info": self.info,
            "files": {name: self._file_json(name) for name in sorted(self.files)},
            "values": {v.name: {"kind": v.kind, "meta": v.meta} for v in self.values.values()},
            "tensors": {key: _tensor_to_json(rec) for key, rec in sorted(self.tensors.items())},
        }
        body = json.dumps(doc, indent=1, allow_nan=False).encode("utf-8")
        head = body[: -len(b"\n}")]
        return head + f',\n "{_CRC_KEY}": "{crc32(memoryview(head), 0):08x}"\n}}\n'.encode()

    def _file_json(self, name: str) -> dict[str, int]:
        out = {"bytes": self.files[name]}
        if name in self.header_crc32:
            out["header_crc32"] = self.header_crc32[name]
        return out

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
    if len(raw) > MAX_MANIFEST_BYTES:
        raise CheckpointCorruptError(f"{where} is {len(raw)} bytes, larger than any real manifest")
    has_trailer = _verify_trailer(raw, where)
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
    covers = _covers(doc, has_trailer, where)
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
        _is_int(block_bytes) and 8 <= block_bytes <= MAX_FILE_BYTES and block_bytes % 8 == 0,
        "'checksum.block_bytes' is not a positive multiple of 8",
    )
    files, header_crcs = p.files(doc.get("files"), needs_header_crc="headers" in covers)
    tensors = {
        key: p.tensor(key, rec, files, block_bytes)
        for key, rec in p.mapping(doc.get("tensors"), "tensors").items()
    }
    p.unique_stored_tensors(tensors)
    values = {}
    for name, rec in p.mapping(doc.get("values"), "values").items():
        p.require(
            valid_value_name(name),
            f"value name {name!r} is not a state key save accepts (non-empty, no '/', "
            "not starting with '@')",
        )
        p.require(
            isinstance(rec, dict) and isinstance(rec.get("kind"), str) and "meta" in rec,
            f"value {name!r} lacks 'kind' or 'meta'",
        )
        values[name] = SavedValue(name, rec["kind"], rec["meta"])
    info = doc.get("info", {})
    p.require(isinstance(info, dict), "'info' is not an object")
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


def _verify_trailer(raw: bytes, where: str) -> bool:
    """Check the manifest's own CRC32 if it ends in one; True if it does."""
    start = len(raw) - _TRAILER_BYTES
    match = _TRAILER.fullmatch(raw, max(start, 0))
    if match is None:
        return False
    if crc32(memoryview(raw)[:start], 0) != int(match.group(1), 16):
        raise CheckpointCorruptError(
            f"{where} is damaged: its content does not match its CRC32 ('{_CRC_KEY}'); the "
            "file was modified or corrupted after the save"
        )
    return True


def _covers(doc: dict[str, Any], has_trailer: bool, where: str) -> frozenset[str]:
    """What the manifest's checksums cover; its own CRC32 must be there if it says so."""
    checksum = doc.get("checksum")
    declared = checksum.get("covers", ["data"]) if isinstance(checksum, dict) else ["data"]
    if not (
        isinstance(declared, list)
        and "data" in declared
        and all(isinstance(c, str) and c in COVERS for c in declared)
    ):
        raise CheckpointCorruptError(f"{where} is malformed: 'checksum.covers' is {declared!r}")
    covers = frozenset(declared)
    if "manifest" in covers and not has_trailer:
        raise CheckpointCorruptError(
            f"{where} is damaged: its own checksum ('{_CRC_KEY}', the last line) is missing "
            "or malformed"
        )
    if (_CRC_KEY in doc) != ("manifest" in covers):
        raise CheckpointCorruptError(
            f"{where} is malformed: '{_CRC_KEY}' and 'checksum.covers' disagree"
        )
    return covers


def _load_json(raw: bytes, where: str) -> Any:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CheckpointCorruptError(
            f"{where} is not valid UTF-8 ({e.reason} at byte {e.start}); the file is damaged"
        ) from None
    return load_json(text, where, deep_keys=("values", "info"))


def load_json(text: str, where: str, *, deep_keys: tuple[str, ...] | None = None) -> Any:
    """Strict JSON: no duplicate keys, no NaN/Infinity (nor ``1e999``), bounded nesting.

    ``deep_keys``: only these top-level entries can nest freely (the rest is checked
    field by field by its parser, never recursed into), so only they are measured.
    """
    too_deep = CheckpointCorruptError(f"{where} is nested too deeply to be a manifest")
    try:
        doc = json.loads(
            text,
            object_pairs_hook=_no_duplicates,
            parse_constant=_no_constant,
            parse_float=_finite_float,
        )
    except RecursionError:
        raise too_deep from None
    except ValueError as e:
        raise CheckpointCorruptError(f"{where} is not valid JSON: {e}") from None
    if deep_keys is None or not isinstance(doc, dict):
        deepest = depth(doc)
    else:
        deepest = 1 + max((depth(doc.get(k)) for k in deep_keys), default=0)
    if deepest > MAX_DEPTH:
        raise too_deep
    return doc


def depth(doc: Any) -> int:
    """Nesting depth of parsed JSON, without recursion and in memory bounded by the depth."""
    deepest = 0
    stack: list[Iterator[Any]] = [iter((doc,))]
    while stack:
        node = next(stack[-1], _END)
        if node is _END:
            stack.pop()
            continue
        if isinstance(node, dict):
            node = node.values()
        elif not isinstance(node, list):
            continue
        stack.append(iter(node))
        deepest = max(deepest, len(stack) - 1)
    return deepest


_END = object()


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:40]} is out of range")
    return value


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        duplicate = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise ValueError(f"duplicate key {duplicate!r}")
    return out


def _no_constant(name: str) -> Any:
    raise ValueError(f"non-standard constant {name}")


def _non_negative_ints(value: Any) -> bool:
    """A list of at most MAX_NDIM ints (not bools), none negative."""
    if type(value) is not list or len(value) > MAX_NDIM:
        return False
    return not value or (all(type(v) is int for v in value) and min(value) >= 0)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class _Parser:
    def __init__(self, where: str) -> None:
        self.where = where
        self.file_names: dict[str, str] = {}

    def require(self, ok: bool, problem: str) -> None:
        if not ok:
            raise CheckpointCorruptError(f"{self.where} is malformed: {problem}")

    def mapping(self, value: Any, name: str) -> dict[str, Any]:
        self.require(isinstance(value, dict), f"'{name}' is not an object")
        return value  # type: ignore[no-any-return]

    def files(self, value: Any, *, needs_header_crc: bool) -> tuple[dict[str, int], dict[str, int]]:
        files, crcs = {}, {}
        for name, rec in self.mapping(value, "files").items():
            self.require(
                _FILE_NAME.fullmatch(name) is not None and ".." not in name,
                f"data file name {name!r} is not a plain '*.safetensors' name inside the "
                "checkpoint directory (paths, '..' and absolute names are refused)",
            )
            size: Any = rec.get("bytes") if isinstance(rec, dict) else None
            self.require(
                _is_int(size) and 8 <= size <= MAX_FILE_BYTES, f"file {name!r} has no valid 'bytes'"
            )
            files[name] = int(size)
            self.file_names[name] = name
            crc: Any = rec.get("header_crc32")
            if needs_header_crc or crc is not None:
                self.require(
                    _is_int(crc) and 0 <= crc < 1 << 32, f"file {name!r} has no valid header_crc32"
                )
                crcs[name] = crc
        return files, crcs

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
        if not _non_negative_ints(value):
            self.fail(f"{what} is not a list of non-negative ints")
        return tuple(value)

    def fail(self, problem: str) -> NoReturn:
        raise CheckpointCorruptError(f"{self.where} is malformed: {problem}")

    def tensor(self, key: str, rec: Any, files: dict[str, int], block_bytes: int) -> TensorRecord:
        self.require(
            isinstance(key, str)
            and 0 < len(key) <= MAX_NAME_CHARS
            and valid_value_name(key.split("/", 1)[0]),
            f"tensor key {key[:80]!r} is not a valid key",
        )
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
        itemsize = dtypes.itemsize(dtype)
        chunks = tuple(self.chunk(key, c, shape, itemsize, files, block_bytes) for c in raw_chunks)
        problem = geometry.tiling_problem(shape, [(c.offsets, c.shape) for c in chunks])
        self.require(problem is None, f"the chunks of {key!r} {problem}")
        return TensorRecord(dtype, shape, chunks)

    def chunk(
        self,
        key: str,
        c: Any,
        shape: tuple[int, ...],
        itemsize: int,
        files: dict[str, int],
        block_bytes: int,
    ) -> ChunkRecord:
        """One chunk record. Runs once per chunk (a million in a large run), so each check
        is a plain condition and a message is only formatted for a failure."""
        if type(c) is not dict:
            self.fail(f"a chunk of {key!r} is not an object")
        file, name = c.get("file"), c.get("name")
        if type(file) is not str or file not in files:
            self.fail(f"a chunk of {key!r} names file {file!r}, which 'files' does not list")
        if type(name) is not str or not 0 < len(name) <= MAX_NAME_CHARS:
            self.fail(f"a chunk of {key!r} has no valid 'name'")
        file = self.file_names[file]  # one string object for all its chunks
        offsets, cshape = c.get("offsets"), c.get("shape")
        if not _non_negative_ints(offsets):
            self.fail(f"the offsets of a chunk of {key!r} is not a list of non-negative ints")
        if not _non_negative_ints(cshape):
            self.fail(f"the shape of a chunk of {key!r} is not a list of non-negative ints")
        if not (
            len(offsets) == len(shape) == len(cshape)
            and all(o + n <= s for o, n, s in zip(offsets, cshape, shape))
        ):
            self.fail(f"a chunk of {key!r} lies outside the tensor's shape {list(shape)}")
        nbytes = math.prod(cshape) * itemsize
        if nbytes > files[file]:
            self.fail(f"a chunk of {key!r} is larger than file {file!r}")
        crc = c.get("crc32")
        if not (
            type(crc) is list
            and len(crc) == crc_block_count(nbytes, block_bytes)
            and all(type(v) is int for v in crc)
            and min(crc) >= 0
            and max(crc) < 1 << 32
        ):
            self.fail(f"a chunk of {key!r} has no valid 'crc32' list")
        offsets, cshape = tuple(offsets), tuple(cshape)
        return ChunkRecord(file, name, offsets, cshape, tuple(crc))
