"""Checking a version 2 chunk table (``chunk_table.py``): hostile input, whole columns at once.

The same promises as version 1's per-chunk checks (``manifest_checks.py``), over columns:
every index names a listed file and stored name; every chunk lies inside its tensor;
no chunk needs more bytes than its file holds; every chunk has exactly one CRC32 per
checksum block; no two chunks name the same stored tensor of a file; and each tensor's
chunks tile it exactly once. Each check is a few tensor operations over a column (or a
pass over the tensors), so checking is linear in the manifest's size; integer overflow
is ruled out by checking each bound before the arithmetic that relies on it.
"""

from __future__ import annotations

import bisect
import itertools
import math
from typing import Any

import torch

from .. import dtypes
from . import geometry
from .chunk_table import COLUMNS, TABLE_KEYS, Columns, LazyChunks, decode_column
from .manifest_checks import Checker
from .manifest_format import MAX_CHUNKS_PER_TENSOR, MAX_NAME_CHARS, TensorRecord

GRID_VECTOR_MIN = 32
"""Tensors with at least this many chunks have their tiling checked with tensor operations;
fewer are checked by ``geometry`` in Python, which is faster for them."""

_I64 = torch.int64


class _Heads:
    """The tensors' own records (key, dtype, shape, chunk count), in order."""

    def __init__(self, check: Checker, raw: dict[str, Any]) -> None:
        self.keys: list[str] = []
        self.dtypes: list[torch.dtype] = []
        self.shapes: list[tuple[int, ...]] = []
        self.counts: list[int] = []
        for key, rec in raw.items():
            dtype, shape = check.tensor_head(key, rec)
            count = rec.get("chunks")
            if not (type(count) is int and 0 < count <= MAX_CHUNKS_PER_TENSOR):
                check.fail(f"tensor {key!r} has no valid chunk count ('chunks')")
            self.keys.append(key)
            self.dtypes.append(dtype)
            self.shapes.append(shape)
            self.counts.append(count)
        self.ndims = [len(s) for s in self.shapes]
        self.row_starts = [0, *itertools.accumulate(self.counts)]
        widths = [n * d for n, d in zip(self.counts, self.ndims)]
        self.flat_starts = [0, *itertools.accumulate(widths)]

    def of_row(self, row: int) -> str:
        return self.keys[bisect.bisect_right(self.row_starts, row) - 1]

    def of_flat(self, index: int) -> str:
        return self.keys[bisect.bisect_right(self.flat_starts, index) - 1]


class _Layout:
    """Where each entry of the offsets/shape columns belongs: its row (chunk), its dim, and
    its tensor's extent in that dim. Computed once, from the tensors' records alone."""

    def __init__(self, heads: _Heads) -> None:
        counts = torch.tensor(heads.counts, dtype=_I64)
        ndims = torch.tensor(heads.ndims, dtype=_I64)
        self.rows = heads.row_starts[-1]
        self.counts = counts
        self.row_ndims = torch.repeat_interleave(ndims, counts)
        self.row_of = torch.repeat_interleave(torch.arange(self.rows), self.row_ndims)
        flat = self.row_of.numel()
        row_flat_starts = torch.cumsum(self.row_ndims, 0) - self.row_ndims
        dim = torch.arange(flat) - row_flat_starts[self.row_of]
        shapes = torch.tensor([n for s in heads.shapes for n in s], dtype=_I64)
        row_shape_starts = torch.repeat_interleave(torch.cumsum(ndims, 0) - ndims, counts)
        self.extents = shapes[row_shape_starts[self.row_of] + dim] if flat else dim


def check_table(
    check: Checker, raw_tensors: Any, raw_table: Any, files: dict[str, int], block_bytes: int
) -> dict[str, TensorRecord]:
    """The validated tensors of a version 2 manifest (see the module docstring)."""
    heads = _Heads(check, check.mapping(raw_tensors, "tensors"))
    table = check.mapping(raw_table, "chunks")
    if set(table) != TABLE_KEYS:
        check.fail(f"'chunks' has keys {sorted(table)[:10]}, not {sorted(TABLE_KEYS)}")
    names = _names(check, table["names"])
    rows, flat = heads.row_starts[-1], heads.flat_starts[-1]
    if type(table["rows"]) is not int or table["rows"] != rows:
        check.fail(f"'chunks.rows' is {table['rows']!r}, but the tensors have {rows} chunks")
    cols = {name: _column(check, table, name, types) for name, types in COLUMNS.items()}
    for name, expected in (("file", rows), ("name", rows), ("offsets", flat), ("shape", flat)):
        if cols[name].numel() != expected:
            check.fail(
                f"'chunks.{name}' holds {cols[name].numel()} values, not the {expected} "
                "the tensors' chunk counts and shapes need"
            )
    if rows and not (int(cols["file"].max()) < len(files) and int(cols["name"].max()) < len(names)):
        bad = int(torch.nonzero((cols["file"] >= len(files)) | (cols["name"] >= len(names)))[0])
        check.fail(
            f"a chunk of {heads.of_row(bad)!r} names a file or stored name that 'files' or "
            "'chunks.names' does not list (index out of range)"
        )
    layout = _Layout(heads)
    _check_bounds(check, heads, cols["offsets"], cols["shape"], layout.extents)
    crc_starts = _check_sizes(check, heads, layout, cols, files, block_bytes)
    file_names = list(files)
    _check_tiling(check, heads, layout, cols["offsets"], cols["shape"])
    _check_unique(check, heads, cols["file"], cols["name"], file_names, names)
    columns = Columns(file_names, names, cols, crc_starts)
    return {
        key: TensorRecord(
            heads.dtypes[i],
            heads.shapes[i],
            LazyChunks(
                columns, heads.row_starts[i], heads.counts[i], heads.flat_starts[i], heads.ndims[i]
            ),
        )
        for i, key in enumerate(heads.keys)
    }


def _names(check: Checker, raw: Any) -> list[str]:
    if type(raw) is not list or not all(
        type(n) is str and 0 < len(n) <= MAX_NAME_CHARS for n in raw
    ):
        check.fail("'chunks.names' is not a list of valid stored tensor names")
    names: list[str] = raw
    if len(set(names)) != len(names):
        seen: set[str] = set()
        for n in names:
            if n in seen:
                check.fail(f"'chunks.names' lists {n[:80]!r} twice")
            seen.add(n)
    return names


def _column(
    check: Checker, table: dict[str, Any], name: str, types: tuple[str, ...]
) -> torch.Tensor:
    col = decode_column(table[name], types)
    if col is None:
        check.fail(
            f"'chunks.{name}' is not one of {list(types)}, a ':' and strict base64 of whole "
            "little-endian values"
        )
    return col


def _check_bounds(
    check: Checker, heads: _Heads, offsets: torch.Tensor, shape: torch.Tensor, extents: torch.Tensor
) -> None:
    # In this order, so that no subtraction can overflow: 0 <= shape <= extent first.
    bad = (offsets < 0) | (shape < 0) | (shape > extents)
    bad |= offsets > extents - torch.where(bad, 0, shape)
    if bool(bad.any()):
        key = heads.of_flat(int(torch.nonzero(bad)[0]))
        i = heads.keys.index(key)
        check.fail(f"a chunk of {key!r} lies outside the tensor's shape {list(heads.shapes[i])}")


def _check_sizes(
    check: Checker,
    heads: _Heads,
    layout: _Layout,
    cols: dict[str, torch.Tensor],
    files: dict[str, int],
    block_bytes: int,
) -> torch.Tensor:
    """No chunk larger than its file; one CRC32 per block of each. Returns where each
    chunk's CRC32s start in their column (and, last, the column's length)."""
    numel = torch.ones(layout.rows, dtype=_I64)
    if cols["shape"].numel():
        # Exact: each chunk lies inside its tensor, whose element count is below 2**63.
        numel.scatter_reduce_(0, layout.row_of, cols["shape"], "prod")
    sizes = [dtypes.itemsize(d) for d in heads.dtypes]
    itemsize = torch.repeat_interleave(torch.tensor(sizes, dtype=_I64), layout.counts)
    file_bytes = torch.tensor(list(files.values()), dtype=_I64)[cols["file"]]
    too_big = numel > file_bytes // itemsize
    if bool(too_big.any()):
        row = int(torch.nonzero(too_big)[0])
        file = list(files)[int(cols["file"][row])]
        check.fail(f"a chunk of {heads.of_row(row)!r} is larger than file {file!r}")
    nbytes = numel * itemsize  # at most a file's size: no overflow
    blocks = torch.clamp(-torch.div(-nbytes, block_bytes, rounding_mode="floor"), min=1)
    crcs = cols["crc32"].numel()
    # Each count is checked against the column before they are summed (no overflow).
    if layout.rows and (int(blocks.max()) > crcs or int(blocks.sum()) != crcs):
        check.fail(f"'chunks.crc32' holds {crcs} values, not one per checksum block of every chunk")
    return torch.cat([torch.zeros(1, dtype=_I64), torch.cumsum(blocks, 0)])


def _check_unique(
    check: Checker,
    heads: _Heads,
    file: torch.Tensor,
    name: torch.Tensor,
    file_names: list[str],
    names: list[str],
) -> None:
    """No two chunks name the same stored tensor of a file (a small file filling a huge
    tensor many times over)."""
    if file.numel() < 2:
        return
    pairs = file * len(names) + name  # both indices are below the input's size
    ordered, order = torch.sort(pairs)
    same = ordered[1:] == ordered[:-1]
    if bool(same.any()):
        row = int(order[int(torch.nonzero(same)[0]) + 1])
        check.fail(
            f"a chunk of {heads.of_row(row)!r} names the stored tensor "
            f"{names[int(name[row])]!r} of {file_names[int(file[row])]}, which another chunk "
            "names too"
        )


def _check_tiling(
    check: Checker, heads: _Heads, layout: _Layout, offsets: torch.Tensor, shape: torch.Tensor
) -> None:
    """Each tensor's chunks cover it exactly once (see ``geometry.tiling_problem``)."""
    if offsets.numel():
        # A tensor of one chunk: that chunk must be all of it (unless it has no elements).
        partial_flat = (offsets != 0) | (shape != layout.extents)
        partial = torch.zeros(layout.rows, dtype=torch.bool)
        partial[layout.row_of[partial_flat]] = True
        single = torch.repeat_interleave(layout.counts == 1, layout.counts)
        for row in torch.nonzero(partial & single).flatten().tolist():
            i = bisect.bisect_right(heads.row_starts, row) - 1
            if math.prod(heads.shapes[i]):
                check.fail(f"the chunks of {heads.keys[i]!r} overlap or leave holes")
    lists: tuple[list[int], list[int]] | None = None
    for i in torch.nonzero(layout.counts > 1).flatten().tolist():
        n, d, lo = heads.counts[i], heads.ndims[i], heads.flat_starts[i]
        hi = heads.flat_starts[i + 1]
        if (
            n >= GRID_VECTOR_MIN
            and d
            and _is_grid(heads.shapes[i], offsets[lo:hi].view(n, d), shape[lo:hi].view(n, d))
        ):
            continue
        if lists is None:
            lists = offsets.tolist(), shape.tolist()
        offs, shps = lists
        boxes = (
            [(tuple(offs[j : j + d]), tuple(shps[j : j + d])) for j in range(lo, hi, d)]
            if d
            else [((), ())] * n
        )
        problem = geometry.tiling_problem(heads.shapes[i], boxes)
        if problem is not None:
            check.fail(f"the chunks of {heads.keys[i]!r} {problem}")


def _is_grid(extents: tuple[int, ...], offsets: torch.Tensor, shape: torch.Tensor) -> bool:
    """True if the non-empty boxes are exactly the cells of a grid over ``extents`` (what
    any sharding produces): ``geometry._is_grid`` with tensor operations."""
    keep = (shape > 0).all(1)
    if not bool(keep.all()):
        offsets, shape = offsets[keep], shape[keep]
    n = offsets.shape[0]
    if n == 0:
        return math.prod(extents) == 0
    cell: torch.Tensor | None = None
    cells, split = 1, 0
    for dim, extent in enumerate(extents):
        starts, lengths = offsets[:, dim], shape[:, dim]
        if bool((starts == 0).all()) and bool((lengths == extent).all()):
            continue  # not split along this dim: one interval, every box's
        starts, lengths, index = _intervals(starts, lengths, extent)
        ends = starts + lengths
        if int(starts[0]) != 0 or int(ends[-1]) != extent:
            return False
        if bool((starts[1:] != ends[:-1]).any()):
            return False
        cells *= starts.numel()
        if cells > n:
            return False
        cell = index if cell is None else cell * starts.numel() + index
        split += 1
    if cells != n:
        return False
    # Split along one dim, the n boxes hold n distinct intervals: n distinct cells.
    return split <= 1 or torch.unique(cell).numel() == n


def _intervals(
    starts: torch.Tensor, lengths: torch.Tensor, extent: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The distinct ``(start, length)`` pairs, sorted, and each box's index among them."""
    if extent < 1 << 31:  # start * (extent + 1) + length stays below 2**63
        keys, index = torch.unique(starts * (extent + 1) + lengths, return_inverse=True)
        return keys // (extent + 1), keys % (extent + 1), index
    pairs, index = torch.unique(torch.stack([starts, lengths], 1), dim=0, return_inverse=True)
    return pairs[:, 0], pairs[:, 1], index
