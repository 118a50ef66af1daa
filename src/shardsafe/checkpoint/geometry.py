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


def tiles(shape: Sequence[int], boxes: Iterable[Box]) -> bool:
    """True if ``boxes`` cover a tensor of ``shape`` exactly once (no overlap, no hole)."""
    boxes = [b for b in boxes if math.prod(b[1]) > 0]
    if sum(math.prod(size) for _, size in boxes) != math.prod(shape):
        return False
    if not shape:
        return len(boxes) == 1
    active: list[Box] = []
    for off, size in sorted(boxes):
        active = [(o, s) for o, s in active if o[0] + s[0] > off[0]]
        if any(intersect((off, size), b) is not None for b in active):
            return False
        active.append((off, size))
    return True


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
