"""Where everything in a version 2 chunk table belongs, from the tensors' records alone.

The table (``manifest_table.py``) lists every tensor's chunks in tensor order, and each
chunk's offsets and shape as its tensor's ndim values. :class:`Heads` holds the tensors'
own records, checked; :class:`Layout` the index arrays the column checks share: for each
row (chunk) its tensor, for each offsets/shape entry its row, dim and its tensor's extent
in that dim. Built with a few tensor operations, linear in the table's size.
"""

from __future__ import annotations

import bisect
import itertools
from typing import Any

import torch

from .manifest_checks import Checker
from .manifest_format import MAX_CHUNKS_PER_TENSOR

I64 = torch.int64
SMALL = 1 << 15
"""Below this many elements an index is built in Python: torch's repeat_interleave costs
milliseconds however small its input (its CPU kernel wakes the intra-op thread pool),
which a small save, whose manifest is parsed before it commits, would pay every time."""


def runs(counts: torch.Tensor, total: int) -> torch.Tensor:
    """``i`` repeated ``counts[i]`` times, for each ``i`` (``total`` is their sum)."""
    if total <= SMALL:
        return torch.tensor(
            list(
                itertools.chain.from_iterable(
                    itertools.repeat(i, n) for i, n in enumerate(counts.tolist())
                )
            ),
            dtype=I64,
            device="cpu",
        )
    return torch.repeat_interleave(
        torch.arange(counts.numel(), device="cpu"), counts, output_size=total
    )


class Heads:
    """The tensors' own records (key, dtype, shape, chunk count), in order, checked."""

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

    def index_of_row(self, row: int) -> int:
        return bisect.bisect_right(self.row_starts, row) - 1

    def of_row(self, row: int) -> str:
        return self.keys[self.index_of_row(row)]

    def of_flat(self, index: int) -> str:
        return self.keys[bisect.bisect_right(self.flat_starts, index) - 1]


class Layout:
    """Index arrays over the table (see the module docstring)."""

    def __init__(self, heads: Heads) -> None:
        self.counts = torch.tensor(heads.counts, dtype=I64, device="cpu")
        self.ndims = torch.tensor(heads.ndims, dtype=I64, device="cpu")
        self.shapes = torch.tensor([n for s in heads.shapes for n in s], dtype=I64, device="cpu")
        """Every tensor's shape, concatenated; ``shape_starts`` is where each begins."""
        self.shape_starts = torch.cumsum(self.ndims, 0) - self.ndims
        self.rows = heads.row_starts[-1]
        self.tensor_of_row = runs(self.counts, self.rows)
        self.row_ndims = self.ndims[self.tensor_of_row]
        self.row_flat_starts = torch.cumsum(self.row_ndims, 0) - self.row_ndims
        flat = heads.flat_starts[-1]
        self.row_of = runs(self.row_ndims, flat)
        """For each offsets/shape entry, its row."""
        self.dim = torch.arange(flat, device="cpu") - self.row_flat_starts[self.row_of]
        self.group = self.shape_starts[self.tensor_of_row][self.row_of] + self.dim
        """For each entry, its (tensor, dim): an index into ``shapes``."""
        self.extents = self.shapes[self.group] if flat else self.dim
