"""Checking that each tensor's chunks in a version 2 table tile it exactly once.

The same decision as version 1's ``geometry.tiling_problem`` (per tensor: a grid of any
size is accepted, other arrangements only up to ``geometry.PAIRWISE_LIMIT`` chunks,
checked pair by pair), reached faster for what sharding writes:

* one chunk: it must be the whole tensor (or the tensor has no elements);
* chunks split along one dim, in order (FSDP and ZeRO shards, as saved): the rows of
  the whole table are checked at once, each chunk starting where the previous one ends;
* a tensor of at least :data:`GRID_VECTOR_MIN` chunks otherwise: a grid check with
  tensor operations (:func:`_is_grid`);
* anything else, or anything these do not accept: ``geometry`` itself, which decides.

Every path but the last only ever accepts exact tilings, so the decision is version 1's.
"""

from __future__ import annotations

import math

import torch

from . import geometry
from .manifest_checks import Checker
from .table_layout import I64, Heads, Layout, runs

GRID_VECTOR_MIN = 32
"""Tensors with at least this many chunks have their grid checked with tensor operations;
fewer go to ``geometry`` in Python, which is faster for them."""


def check_tiling(
    check: Checker, heads: Heads, layout: Layout, offsets: torch.Tensor, shape: torch.Tensor
) -> None:
    """Refuse the first tensor whose chunks do not tile it exactly once."""
    partial = (offsets != 0) | (shape != layout.extents)
    """Entries where a chunk does not span its tensor's whole dim."""
    partial_rows = torch.bincount(layout.row_of[partial], minlength=layout.rows) > 0
    single = (layout.counts == 1)[layout.tensor_of_row]
    for row in torch.nonzero(partial_rows & single).flatten().tolist():
        i = heads.index_of_row(row)
        if math.prod(heads.shapes[i]):
            check.fail(f"the chunks of {heads.keys[i]!r} overlap or leave holes")
    multi = torch.nonzero(layout.counts > 1).flatten()
    if not multi.numel():
        return
    chained = _chained(layout, offsets, shape, partial)
    lists: tuple[list[int], list[int]] | None = None
    for i in multi[~chained[multi]].tolist():
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


def _chained(
    layout: Layout, offsets: torch.Tensor, shape: torch.Tensor, partial: torch.Tensor
) -> torch.Tensor:
    """For each tensor: True if its chunks span every dim but one, and along that one each
    (non-empty) chunk starts where the previous row's ends, the first at 0 and the last
    ending at the extent: an exact tiling. False means "not shown", not "refused"."""
    tensors = layout.counts.numel()
    groups = layout.shapes.numel()
    if not groups:
        return torch.zeros(tensors, dtype=torch.bool, device="cpu")
    split = torch.bincount(layout.group[partial], minlength=groups) > 0
    """(tensor, dim) pairs along which some chunk does not span the whole dim."""
    tensor_of_group = runs(layout.ndims, groups)
    dim_of_group = torch.arange(groups, device="cpu") - layout.shape_starts[tensor_of_group]
    one_split = torch.bincount(tensor_of_group[split], minlength=tensors) == 1
    along = torch.zeros(tensors, dtype=I64, device="cpu")
    along[tensor_of_group[split]] = dim_of_group[split]
    candidate = one_split & (layout.counts > 1)
    rows = torch.nonzero(candidate[layout.tensor_of_row]).flatten()
    if not rows.numel():
        return candidate
    tensor = layout.tensor_of_row[rows]
    entry = layout.row_flat_starts[rows] + along[tensor]
    start, length = offsets[entry], shape[entry]
    extent = layout.shapes[layout.shape_starts[tensor] + along[tensor]]
    first = torch.ones(rows.numel(), dtype=torch.bool, device="cpu")
    first[1:] = tensor[1:] != tensor[:-1]
    last = torch.ones(rows.numel(), dtype=torch.bool, device="cpu")
    last[:-1] = first[1:]
    ends = start + length  # each at most its extent (bounds were checked): no overflow
    follows = torch.zeros(rows.numel(), dtype=torch.bool, device="cpu")
    follows[1:] = start[1:] == ends[:-1]
    ok = (length > 0) & torch.where(first, start == 0, follows) & (~last | (ends == extent))
    broken = torch.bincount(tensor[~ok], minlength=tensors) > 0
    return candidate & ~broken


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
