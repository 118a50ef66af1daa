"""Checking a parsed manifest, field by field: the manifest is hostile input.

Refused (with :class:`CheckpointCorruptError`): anything that could make a reader touch a
file outside the checkpoint directory, allocate more than the data files hold, or
misinterpret bytes: path-like file names, negative or out-of-range shapes and offsets,
chunks that overlap or leave holes, two chunks naming the same stored tensor (which would
let a small file fill a huge tensor), unknown dtypes, a checksum that does not match.
Every check is one pass over the records, so checking is linear in the manifest's size.
"""

from __future__ import annotations

import math
import re
from typing import Any, NoReturn

import torch

from ... import dtypes
from ...errors import CheckpointCorruptError
from ...protocol import SavedValue
from . import geometry
from .crc import crc32
from .manifest_format import (
    COVERS,
    CRC_KEY,
    MAX_CHUNKS_PER_TENSOR,
    MAX_FILE_BYTES,
    MAX_NAME_CHARS,
    MAX_NDIM,
    ChunkRecord,
    TensorRecord,
    crc_block_count,
    valid_value_name,
)

_FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,200}\.safetensors", re.ASCII)
_TRAILER = re.compile(rb',\n "manifest_crc32": "([0-9a-f]{8})"\n\}\n')
_TRAILER_BYTES = len(b',\n "manifest_crc32": "00000000"\n}\n')


def verify_trailer(raw: bytes, where: str) -> bool:
    """Check the manifest's own CRC32 if it ends in one; True if it does."""
    start = len(raw) - _TRAILER_BYTES
    match = _TRAILER.fullmatch(raw, max(start, 0))
    if match is None:
        return False
    if crc32(memoryview(raw)[:start], 0) != int(match.group(1), 16):
        raise CheckpointCorruptError(
            f"{where} is damaged: its content does not match its CRC32 ('{CRC_KEY}'); the "
            "file was modified or corrupted after the save"
        )
    return True


def covers_of(doc: dict[str, Any], has_trailer: bool, where: str) -> frozenset[str]:
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
            f"{where} is damaged: its own checksum ('{CRC_KEY}', the last line) is missing "
            "or malformed"
        )
    if (CRC_KEY in doc) != ("manifest" in covers):
        raise CheckpointCorruptError(
            f"{where} is malformed: '{CRC_KEY}' and 'checksum.covers' disagree"
        )
    return covers


def _non_negative_ints(value: Any) -> bool:
    """A list of at most MAX_NDIM ints (not bools), none negative."""
    if type(value) is not list or len(value) > MAX_NDIM:
        return False
    return not value or (all(type(v) is int for v in value) and min(value) >= 0)


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class Checker:
    def __init__(self, where: str) -> None:
        self.where = where
        self.file_names: dict[str, str] = {}

    def require(self, ok: bool, problem: str) -> None:
        if not ok:
            raise CheckpointCorruptError(f"{self.where} is malformed: {problem}")

    def block_bytes(self, checksum: Any) -> int:
        self.require(
            isinstance(checksum, dict) and checksum.get("algorithm") == "crc32",
            "'checksum' does not declare crc32",
        )
        block = checksum.get("block_bytes")
        self.require(
            is_int(block) and 8 <= block <= MAX_FILE_BYTES and block % 8 == 0,
            "'checksum.block_bytes' is not a positive multiple of 8",
        )
        return int(block)

    def values(self, raw: Any) -> dict[str, SavedValue]:
        values = {}
        for name, rec in self.mapping(raw, "values").items():
            self.require(
                valid_value_name(name),
                f"value name {name!r} is not a state key save accepts (non-empty, no '/', "
                "not starting with '@')",
            )
            self.require(
                isinstance(rec, dict) and isinstance(rec.get("kind"), str) and "meta" in rec,
                f"value {name!r} lacks 'kind' or 'meta'",
            )
            values[name] = SavedValue(name, rec["kind"], rec["meta"])
        return values

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
                is_int(size) and 8 <= size <= MAX_FILE_BYTES, f"file {name!r} has no valid 'bytes'"
            )
            files[name] = int(size)
            self.file_names[name] = name
            crc: Any = rec.get("header_crc32")
            if needs_header_crc or crc is not None:
                self.require(
                    is_int(crc) and 0 <= crc < 1 << 32, f"file {name!r} has no valid header_crc32"
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
        """One tensor record of version 1, its chunks included."""
        dtype, shape = self.tensor_head(key, rec)
        raw_chunks = rec.get("chunks")
        if not (type(raw_chunks) is list and 0 < len(raw_chunks) <= MAX_CHUNKS_PER_TENSOR):
            self.fail(f"tensor {key!r} has no valid 'chunks' list")
        itemsize = dtypes.itemsize(dtype)
        chunks = tuple(self.chunk(key, c, shape, itemsize, files, block_bytes) for c in raw_chunks)
        if len(chunks) > 1 or chunks[0].offsets != (0,) * len(shape) or chunks[0].shape != shape:
            problem = geometry.tiling_problem(shape, [(c.offsets, c.shape) for c in chunks])
            if problem is not None:
                self.fail(f"the chunks of {key!r} {problem}")
        return TensorRecord(dtype, shape, chunks)

    def tensor_head(self, key: str, rec: Any) -> tuple[torch.dtype, tuple[int, ...]]:
        """A tensor record's key, dtype and shape, checked (every version has them; messages
        are formatted only on failure: this runs per tensor)."""
        if not (
            type(key) is str
            and 0 < len(key) <= MAX_NAME_CHARS
            and valid_value_name(key.split("/", 1)[0])
        ):
            self.fail(f"tensor key {key[:80]!r} is not a valid key")
        if type(rec) is not dict:
            self.fail(f"tensor {key!r} is not an object")
        dtype = dtypes.from_name(rec.get("dtype"))
        if dtype is None:
            self.fail(f"tensor {key!r} has unknown dtype {rec.get('dtype')!r}")
        raw_shape: Any = rec.get("shape")
        if not _non_negative_ints(raw_shape):
            self.fail(f"the shape of {key!r} is not a list of non-negative ints")
        shape = tuple(raw_shape)
        if math.prod(max(n, 1) for n in shape) >= 1 << 63:  # what torch.empty can make
            self.fail(f"the shape of {key!r} is too large for any tensor")
        return dtype, shape

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
        offsets: Any = c.get("offsets")
        cshape: Any = c.get("shape")
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
        crc: Any = c.get("crc32")
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
