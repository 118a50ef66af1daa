"""What every converter reads into and writes from: a checkpoint described, not loaded.

A :class:`Source` is shardsafe's own model of a checkpoint (see ``manifest.py``): state
entries (``values``: a name, a kind - ``module``, ``optimizer`` or ``value`` - and JSON
metadata that refers to tensors by key) and tensors (``model/fc.weight``,
``optimizer/fc.weight/exp_avg``), each a list of chunks that tile it. A chunk's data is
read only when ``load`` is called, so a converter holds one tensor at a time, whatever the
checkpoint's size. Every reader (shardsafe, DCP, Hugging Face, ``torch.save``) produces
one, every writer consumes one: N formats need N readers and N writers, not N^2 paths.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Container
from dataclasses import dataclass, field, replace
from typing import Any, Literal, get_args

import torch

from .. import _tree, dtypes
from ..adapters.values import module_tensor_keys, representative
from ..errors import CheckpointCorruptError, CheckpointError
from ..protocol import SavedValue

Format = Literal["shardsafe", "dcp", "hf", "torch"]
"""A checkpoint format ``convert`` reads and writes (see ``shardsafe.convert``)."""
FORMATS: tuple[Format, ...] = get_args(Format)


@dataclass(frozen=True)
class SourceChunk:
    """A box of a tensor, stored as one piece in the source; ``load()`` reads it."""

    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    load: Callable[[], torch.Tensor]
    release: Callable[[], None] | None = None
    """Called once the data ``load`` returned is no longer needed (a memory-mapped
    source drops its pages from this process)."""

    def done(self) -> None:
        if self.release is not None:
            self.release()


@dataclass(frozen=True)
class Unbacked:
    """The part of a tensor whose size only the input vouches for: elements that the
    input does not hold byte for byte (see ``bounds.py``), so that materializing them
    allocates more than the input holds."""

    elements: int
    """Elements to be materialized: every element of an overlapping view, or of a chunk
    declared larger than its bytes in the file."""
    held_bytes: int
    """The bytes of the input they are made from."""
    file: str
    """The file holding those bytes (for the refusal's message)."""


@dataclass(frozen=True)
class SourceTensor:
    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    chunks: tuple[SourceChunk, ...]
    whole: Callable[[], torch.Tensor] | None = None
    """Reads the whole tensor straight into one new tensor (a reader that assembles
    chunks itself, through a small buffer); ``None``: assembled here, chunk by chunk."""
    unbacked: Unbacked | None = None
    """What of it the input does not hold (``None``: all of it is in the input); its
    bytes count against ``untrusted_bytes_limit``."""

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * dtypes.itemsize(self.dtype)

    @property
    def untrusted_bytes(self) -> int:
        """What materializing :attr:`unbacked` allocates, in this tensor's dtype (a cast
        materializes it in the new one)."""
        if self.unbacked is None:
            return 0
        return self.unbacked.elements * dtypes.itemsize(self.dtype)

    def done(self) -> None:
        """The whole tensor was used: release what its chunks hold (see ``SourceChunk``)."""
        for chunk in self.chunks:
            chunk.done()

    def load_whole(self) -> torch.Tensor:
        """The whole tensor: its one chunk as read, or its chunks copied into place (the
        tensor plus one chunk in memory, unless the source reads it whole itself)."""
        if self.whole is not None:
            return checked(self.key, self.whole(), self.dtype, self.shape)
        if len(self.chunks) == 1 and self.chunks[0].shape == self.shape:
            return checked(self.key, self.chunks[0].load(), self.dtype, self.shape)
        out = torch.empty(self.shape, dtype=self.dtype, device="cpu")
        for chunk in self.chunks:
            box = tuple(slice(o, o + n) for o, n in zip(chunk.offsets, chunk.shape))
            out[box] = checked(self.key, chunk.load(), self.dtype, chunk.shape)
        return out


def checked(
    key: str, tensor: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]
) -> torch.Tensor:
    """``tensor`` if it has the dtype and shape the source's metadata declared."""
    if tensor.dtype != dtype or tuple(tensor.shape) != tuple(shape):
        raise CheckpointError(
            f"{key!r}: the source's data is {dtypes.dtype_name(tensor.dtype)}"
            f"{list(tensor.shape)} but its metadata declares {dtypes.dtype_name(dtype)}"
            f"{list(shape)}; the source checkpoint is damaged"
        )
    return tensor


@dataclass
class Source:
    """A checkpoint of some format, described (see the module docstring)."""

    format: Format
    where: str
    values: dict[str, SavedValue]
    tensors: dict[str, SourceTensor]
    closers: list[Callable[[], None]] = field(default_factory=list)
    refused: dict[str, list[str]] = field(default_factory=dict)
    """Entries a load refuses, with why (a shardsafe source whose entries' metadata was
    forged): a conversion that takes one is refused before reading it (:func:`select`),
    one that leaves it out (``only``) goes on, as a load of the other entries does."""

    def close(self) -> None:
        for close in reversed(self.closers):
            close()
        self.closers.clear()

    def __enter__(self) -> Source:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def largest_tensor_bytes(self) -> int:
        return max((t.nbytes for t in self.tensors.values()), default=0)


class TensorRef:
    """Stands for a tensor of the source in a decoded tree (see :func:`decoded`)."""

    __slots__ = ("key",)

    def __init__(self, key: str) -> None:
        self.key = key

    def __repr__(self) -> str:
        return f"TensorRef({self.key!r})"


class _Refs(dict[str, Any]):
    def __missing__(self, key: str) -> TensorRef:
        return TensorRef(key)

    def __contains__(self, key: object) -> bool:
        return True


def decoded(meta: Any, name: str = "") -> Any:
    """An entry's metadata as Python values, its tensors as :class:`TensorRef` s.

    State recorded per rank (``adapters.values.merge_per_rank``: one scheduler per
    pipeline stage) has no single value in another format: refused, naming the entry;
    but where the ranks differ only in their own copies of small tensors (a per-rank
    generator), saving rank 0's record is the value, as a load at another world size
    restores it."""
    return _tree.decode(single_value(meta, name), _Refs())


def single_value(meta: Any, name: str) -> Any:
    """An entry's one record (see :func:`decoded`), or the refusal naming it."""
    meta = representative(meta, name)
    if isinstance(meta, dict) and len(meta) == 1 and _tree.PER_RANK in meta:
        raise CheckpointError(
            f"state entry {name!r} was saved with a different value on each rank (e.g. one "
            "scheduler per pipeline stage); other formats hold one value per entry. Convert "
            f"the other entries with --only, leaving {name!r} out"
        )
    return meta


def single_values(source: Source) -> Source:
    """``source`` with saving rank 0's record of each entry recorded with per-rank copies
    (``adapters.values.representative``) and only the tensors the entries use: what a
    conversion writes, counts and sizes (the other ranks' own copies are left behind).
    Entries recorded per rank otherwise (one scheduler per stage) stay as they are: a
    writer that needs their value refuses them by name (:func:`single_value`)."""
    values = {
        name: replace(value, meta=representative(value.meta, name))
        for name, value in source.values.items()
    }
    if all(values[name].meta is source.values[name].meta for name in values):
        return source
    keys = {ref for v in values.values() for ref in referenced(v, source.tensors)}
    tensors = {k: t for k, t in source.tensors.items() if k in keys}
    return replace(source, values=values, tensors=tensors)


def select(source: Source, only: list[str] | None) -> Source:
    """``source`` with only the entries named in ``only`` (all if ``None``); refused if
    one of them is an entry a load refuses (:attr:`Source.refused`)."""
    if not only:
        _refuse_refused(source, list(source.values))
        return source
    unknown = [name for name in only if name not in source.values]
    if unknown:
        raise CheckpointError(
            f"--only {', '.join(unknown)}: {source.where} holds no such entry; it holds "
            f"{', '.join(sorted(source.values)) or 'nothing'}"
        )
    _refuse_refused(source, only)
    values = {name: source.values[name] for name in only}
    keys = {ref for v in values.values() for ref in referenced(v, source.tensors)}
    tensors = {k: t for k, t in source.tensors.items() if k in keys}
    return replace(source, values=values, tensors=tensors)


def _refuse_refused(source: Source, names: list[str]) -> None:
    """Refuse to convert ``names`` if a load would refuse one of them: such an entry
    reached the writers of other formats, which indexed its metadata as written and
    failed with ``KeyError``/``TypeError`` (found in review)."""
    problems = [line for name in names for line in source.refused.get(name, [])]
    if not problems:
        return
    shown = "; ".join(problems[:3])
    more = f"; and {len(problems) - 3} more" if len(problems) > 3 else ""
    raise CheckpointCorruptError(
        f"refusing to convert {source.where}: a load would refuse it: {shown}{more} "
        f"(shardsafe verify {source.where} lists every problem)"
    )


def referenced(value: SavedValue, stored: Container[str]) -> list[str]:
    """The tensor keys an entry uses (``stored``: every tensor key of its checkpoint)."""
    if value.kind == "module":
        return module_tensor_keys(value, stored)
    # An entry recorded with per-rank copies: the keys of the record a conversion writes.
    return _tree.tensor_refs(representative(value.meta, value.name))


def cast(source: Source, dtype: torch.dtype | None) -> Source:
    """``source`` with the floating-point tensors of its modules (the weights) read as
    ``dtype``. Optimizer state and plain values keep theirs: Adam's ``step`` in bfloat16
    would stop counting at 256."""
    if dtype is None:
        return source
    weights = {
        k
        for v in source.values.values()
        if v.kind == "module"
        for k in referenced(v, source.tensors)
    }
    tensors = {}
    for key, t in source.tensors.items():
        if key not in weights or not t.dtype.is_floating_point or t.dtype == dtype:
            tensors[key] = t
            continue
        chunks = tuple(
            SourceChunk(c.offsets, c.shape, _casting(c.load, dtype), c.release) for c in t.chunks
        )
        whole = None if t.whole is None else _casting(t.whole, dtype)
        tensors[key] = replace(t, dtype=dtype, chunks=chunks, whole=whole)
    return replace(source, tensors=tensors)


def _casting(load: Callable[[], torch.Tensor], dtype: torch.dtype) -> Callable[[], torch.Tensor]:
    return lambda: load().to(dtype)


def one_chunk(
    key: str,
    dtype: torch.dtype,
    shape: tuple[int, ...],
    load: Callable[[], torch.Tensor],
    release: Callable[[], None] | None = None,
    unbacked: Unbacked | None = None,
) -> SourceTensor:
    """A tensor stored whole."""
    chunk = SourceChunk((0,) * len(shape), shape, load, release)
    return SourceTensor(key, dtype, shape, (chunk,), unbacked=unbacked)
