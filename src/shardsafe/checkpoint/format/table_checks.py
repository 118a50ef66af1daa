"""Checking a version 2 chunk table (``manifest_table.py``): hostile input, whole columns at once.

The same promises as version 1's per-chunk checks (``manifest_checks.py``), over columns:
every index names a listed file and stored name; every chunk lies inside its tensor;
no chunk needs more bytes than its file holds; every chunk has exactly one CRC32 per
checksum block; no two chunks name the same stored tensor of a file; and each tensor's
chunks tile it exactly once. Each check is a few tensor operations over a column (or a
pass over the tensors), so checking is linear in the manifest's size; integer overflow
is ruled out by checking each bound before the arithmetic that relies on it.
"""

from __future__ import annotations

from typing import Any

import torch

from ... import dtypes
from .manifest_checks import Checker
from .manifest_format import MAX_NAME_CHARS, TensorRecord
from .manifest_table import COLUMNS, TABLE_KEYS, Columns, LazyChunks, decode_column
from .table_layout import I64, Heads, Layout
from .table_tiling import check_tiling


def check_table(
    check: Checker, raw_tensors: Any, raw_table: Any, files: dict[str, int], block_bytes: int
) -> dict[str, TensorRecord]:
    """The validated tensors of a version 2 manifest (see the module docstring)."""
    heads = Heads(check, check.mapping(raw_tensors, "tensors"))
    table = check.mapping(raw_table, "chunks")
    if set(table) != TABLE_KEYS:
        keys = [k[:40] for k in sorted(table)[:10]]
        check.fail(f"'chunks' has keys {keys}, not {sorted(TABLE_KEYS)}")
    names = _names(check, table["names"])
    rows, flat = heads.row_starts[-1], heads.flat_starts[-1]
    if type(table["rows"]) is not int or table["rows"] != rows:
        check.fail(
            f"'chunks.rows' is {repr(table['rows'])[:40]}, but the tensors have {rows} chunks"
        )
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
    layout = Layout(heads)
    _check_bounds(check, heads, cols["offsets"], cols["shape"], layout.extents)
    crc_starts = _check_sizes(check, heads, layout, cols, files, block_bytes)
    file_names = list(files)
    check_tiling(check, heads, layout, cols["offsets"], cols["shape"])
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
    check: Checker, heads: Heads, offsets: torch.Tensor, shape: torch.Tensor, extents: torch.Tensor
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
    heads: Heads,
    layout: Layout,
    cols: dict[str, torch.Tensor],
    files: dict[str, int],
    block_bytes: int,
) -> torch.Tensor:
    """No chunk larger than its file; one CRC32 per block of each. Returns where each
    chunk's CRC32s start in their column (and, last, the column's length)."""
    numel = torch.ones(layout.rows, dtype=I64, device="cpu")
    if cols["shape"].numel():
        # Exact: each chunk lies inside its tensor, whose element count is below 2**63.
        numel.scatter_reduce_(0, layout.row_of, cols["shape"], "prod")
    sizes = [dtypes.itemsize(d) for d in heads.dtypes]
    itemsize = torch.tensor(sizes, dtype=I64, device="cpu")[layout.tensor_of_row]
    file_bytes = torch.tensor(list(files.values()), dtype=I64, device="cpu")[cols["file"]]
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
    return torch.cat([torch.zeros(1, dtype=I64, device="cpu"), torch.cumsum(blocks, 0)])


def _check_unique(
    check: Checker,
    heads: Heads,
    file: torch.Tensor,
    name: torch.Tensor,
    file_names: list[str],
    names: list[str],
) -> None:
    """No two chunks name the same stored tensor of a file (a small file filling a huge
    tensor many times over)."""
    rows = file.numel()
    if rows < 2:
        return
    pairs = file * len(names) + name  # both indices are below the input's size
    space = len(file_names) * len(names)
    if space <= 4 * rows:  # a count per possible pair: linear, and faster than sorting
        seen = torch.bincount(pairs, minlength=space)
        if not bool((seen > 1).any()):
            return
        twice = int(torch.nonzero(seen > 1)[0])
    else:
        ordered = torch.sort(pairs).values
        same = ordered[1:] == ordered[:-1]
        if not bool(same.any()):
            return
        twice = int(ordered[int(torch.nonzero(same)[0])])
    row = int(torch.nonzero(pairs == twice)[1])
    check.fail(
        f"a chunk of {heads.of_row(row)!r} names the stored tensor "
        f"{names[int(name[row])]!r} of {file_names[int(file[row])]}, which another chunk "
        "names too"
    )
