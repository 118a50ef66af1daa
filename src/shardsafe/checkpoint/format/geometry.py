"""Boxes inside N-d tensors: overlap, tiling, and the byte span a box occupies in a chunk.

Pure functions, shared by the manifest validator, the save planner and the reader.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

Box = tuple[tuple[int, ...], tuple[int, ...]]
"""``(offsets, shape)``."""


def intersect(a: Box, b: Box) -> Box | None:
    """The common part of two boxes of the same rank, or ``None`` if they do not meet."""
    (ao, asz), (bo, bsz) = a, b
    lo = tuple(max(x, y) for x, y in zip(ao, bo))
    hi = tuple(min(x + n, y + m) for x, n, y, m in zip(ao, asz, bo, bsz))
    if any(h <= low for low, h in zip(lo, hi)):
        return None
    return lo, tuple(h - low for low, h in zip(lo, hi))


PAIRWISE_LIMIT = 64
"""Most boxes checked for overlap pair by pair when they do not form a grid."""


def tiles(shape: Sequence[int], boxes: Iterable[Box]) -> bool:
    """True if ``boxes`` cover a tensor of ``shape`` exactly once (no overlap, no hole)."""
    return tiling_problem(shape, boxes) is None


def tiling_problem(shape: Sequence[int], boxes: Iterable[Box]) -> str | None:
    """Why ``boxes`` do not tile ``shape`` exactly once, or ``None`` if they do.

    Near-linear in the number of boxes: boxes that form a grid (per dimension, the
    distinct intervals partition it, and every combination occurs once: what any
    sharding of a tensor produces) are accepted after one pass. Other arrangements are
    checked pair by pair, so only up to :data:`PAIRWISE_LIMIT` boxes are accepted.
    """
    boxes = [b for b in boxes if math.prod(b[1]) > 0]
    if sum(math.prod(size) for _, size in boxes) != math.prod(shape):
        return "overlap or leave holes"
    if not shape:
        return None if len(boxes) == 1 else "overlap or leave holes"
    if _is_grid(shape, boxes):
        return None
    if len(boxes) > PAIRWISE_LIMIT:
        return (
            f"do not form a grid, and {len(boxes)} chunks in another arrangement are more "
            f"than the {PAIRWISE_LIMIT} that are checked"
        )
    for i, a in enumerate(boxes):
        if any(intersect(a, b) is not None for b in boxes[i + 1 :]):
            return "overlap or leave holes"
    return None


def _is_grid(shape: Sequence[int], boxes: list[Box]) -> bool:
    """True if the boxes are exactly the cells of a grid over ``shape``."""
    cells = 1
    for dim, extent in enumerate(shape):
        intervals = sorted({(off[dim], size[dim]) for off, size in boxes})
        end = 0
        for start, length in intervals:
            if start != end:
                return False
            end = start + length
        if end != extent:
            return False
        cells *= len(intervals)
        if cells > len(boxes):
            return False
    return cells == len(boxes) == len(set(boxes))


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def element_span(chunk_shape: Sequence[int], box: Box) -> tuple[int, int]:
    """``[first, last + 1)`` element indices a box occupies inside a C-contiguous chunk."""
    (off, size), strides = box, contiguous_strides(chunk_shape)
    first = sum(o * s for o, s in zip(off, strides))
    last = sum((o + n - 1) * s for o, n, s in zip(off, size, strides))
    return first, last + 1


def splits_on_dim0_only(global_shape: Sequence[int], boxes: Iterable[Box]) -> bool:
    """True if every box spans all dims but the first: their bytes then concatenate in order."""
    return all(tuple(size[1:]) == tuple(global_shape[1:]) for _, size in boxes)
