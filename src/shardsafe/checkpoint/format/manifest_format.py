"""The manifest's format: its version, limits and the records of where tensor bytes live.

Shared by the writer (``manifest.py``), the hostile-input checks (``manifest_checks.py``)
and ``save``, which refuses up front what these limits would make ``load`` refuse.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, get_args

import torch

from ... import dtypes

FORMAT = "shardsafe"
VERSION = 2
"""The version ``save`` writes. 1: one JSON object per chunk. 2: the chunks of every tensor
in one table of binary columns (``manifest_table.py``), about 4x smaller and 30x faster to
parse at a million chunks. Readers accept every version up to this one."""
MANIFEST_NAME = "manifest.json"
CRC_BLOCK_BYTES = 16 << 20
"""Tensor bytes carry one CRC32 per block of this size, so a partial read checks little."""
MAX_MANIFEST_BYTES = 1 << 30
MAX_NDIM = 64
MAX_CHUNKS_PER_TENSOR = 1 << 16
MAX_DEPTH = 100
"""Deepest JSON nesting accepted; decoding values recurses, and real state is shallow."""
MAX_NAME_CHARS = 4096
"""Longest tensor key and stored-tensor name accepted (``save`` refuses longer keys)."""
MAX_FILE_BYTES = 1 << 62
Layout = Literal["sharded", "consolidated"]
"""How a checkpoint's data files are split: one per writing rank, or one per state entry
written by rank 0 (see ``shardsafe.save``)."""
LAYOUTS: tuple[Layout, ...] = get_args(Layout)
COVERS = ("data", "headers", "manifest")
CRC_KEY = "manifest_crc32"
"""The manifest's last key: the CRC32 of every byte before its line."""
"""What the checksums of a manifest written by this shardsafe cover."""


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
    """A tensor's dtype, global shape and chunks. ``chunks`` is a tuple, or (parsed from a
    version 2 manifest) a validated sequence whose records are built on first use: a
    rank that reads a few tensors of a million-chunk manifest builds only theirs."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    chunks: Sequence[ChunkRecord]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * dtypes.itemsize(self.dtype)


def shape_problem(shape: Sequence[int], itemsize: int) -> str | None:
    """Why no tensor can have ``shape`` (of non-negative ints) with items of ``itemsize``
    bytes, or ``None``. torch counts elements and bytes in int64, and so must anything
    that sizes a tensor from a file: more than :data:`MAX_NDIM` dimensions, or an element
    count (each dimension at least 1, as torch's own storage arithmetic counts them) or a
    byte count that reaches 2**63, describes no tensor, only an overflow."""
    if len(shape) > MAX_NDIM:
        return f"has {len(shape)} dimensions, more than the {MAX_NDIM} a checkpoint may have"
    if math.prod(max(n, 1) for n in shape) * max(itemsize, 1) >= 1 << 63:
        return f"has shape {list(shape)}, too large for any tensor (its size overflows int64)"
    return None


def crc_block_count(nbytes: int, block_bytes: int) -> int:
    """How many CRC32 values a chunk of ``nbytes`` carries (one per block, at least one)."""
    return max(1, -(-nbytes // block_bytes))
