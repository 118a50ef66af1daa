"""What a converter may allocate: the bytes its input really holds, plus a bounded allowance.

Writing a tensor materializes it (``contiguous()``, or ``torch.empty`` of a tensor
assembled from chunks). For what a file really holds that costs no more than the file:
a dense tensor of a ``torch.save`` file, a DCP chunk and a safetensors entry each occupy
their bytes in it. Two things break that, and would let a file of a few kilobytes make a
conversion allocate terabytes:

* a view whose elements overlap (``torch.zeros(1).expand(2**31)``: stride 0):
  ``torch.save`` stores its one element, the view declares 2**31 of them;
* a DCP chunk whose metadata declares more bytes than the byte range it is stored in.

Such a tensor is *unbacked* (:class:`~.source.Unbacked`): only the file vouches for its
size. The bytes of the unbacked tensors a conversion writes, summed, may be at most
``untrusted_bytes_limit`` (the name and default, 1 GiB, of ``shardsafe.load``'s); a
conversion asking for more is refused before anything is read or written
(:func:`check_allocation`). So every allocation is a tensor or chunk no larger than its
bytes in the input, or within that limit.

Sizes are checked before any of this (:func:`check_shape`): a shape whose element or byte
count overflows int64 is refused as corrupt, not left to torch's ``RuntimeError``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import torch

from .. import dtypes
from ..checkpoint.format.manifest_format import shape_problem
from ..errors import CheckpointCorruptError, CheckpointError
from .source import Source, SourceTensor, Unbacked, one_chunk


def check_shape(where: str, key: str, dtype: torch.dtype, shape: Sequence[int]) -> None:
    """Refuse a tensor no torch tensor can be (the engine's limits: ``shape_problem``)."""
    problem = shape_problem(shape, dtypes.itemsize(dtype))
    if problem is not None:
        raise CheckpointCorruptError(
            f"{where}: tensor {key!r} ({dtypes.dtype_name(dtype)}) {problem}"
        )


def view_span(tensor: torch.Tensor) -> tuple[int, int]:
    """``[first, end)``: the bytes of its storage that a strided tensor's elements lie
    in, counted from the storage's start (torch strides are never negative); ``(0, 0)``
    for an empty tensor. An overlapping view spans fewer bytes than it has."""
    if tensor.numel() == 0:
        return 0, 0
    itemsize = tensor.element_size()
    first = int(tensor.storage_offset())
    last = first + sum((int(n) - 1) * int(s) for n, s in zip(tensor.shape, tensor.stride()))
    return first * itemsize, (last + 1) * itemsize


def require_dense(where: str, key: str, tensor: torch.Tensor) -> None:
    """Refuse a tensor that is not an array of bytes in memory: a meta tensor holds no
    data (and may declare any size), a sparse one is not written by any converter."""
    if tensor.layout != torch.strided or tensor.device.type != "cpu":
        raise CheckpointError(
            f"{where}: {key!r} is a {str(tensor.layout).removeprefix('torch.')} tensor on "
            f"{tensor.device.type}; converters convert dense tensors whose data is in the file"
        )


def resolved(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s values with any pending conjugation or negation applied.
    ``torch.save`` keeps those bits (``x.conj()`` is its storage plus ``{"conj": True}``),
    so a loaded tensor may be such a view, whose bytes are not its values (and which
    torch will not view as bytes): its values are written, as a new tensor."""
    if tensor.is_conj() or tensor.is_neg():
        return tensor.resolve_conj().resolve_neg()
    return tensor


def loaded(
    where: str, key: str, tensor: torch.Tensor, release: Callable[[], None] | None = None
) -> SourceTensor:
    """A tensor ``torch.load`` made, handed out as it is: refused unless dense and of a
    size torch can count; unbacked if its view spans fewer bytes of the file than it has
    (its storage lies in the file, or was read whole from it)."""
    require_dense(where, key, tensor)
    shape = tuple(tensor.shape)
    check_shape(where, key, tensor.dtype, shape)
    first, end = view_span(tensor)
    unbacked = None
    if tensor.numel() * tensor.element_size() > end - first:
        unbacked = Unbacked(tensor.numel(), end - first, where)
    return one_chunk(key, tensor.dtype, shape, lambda: resolved(tensor), release, unbacked)


ALIASES_FREE = 2
"""How many times a ``torch.save`` file's storage may be written out, summed over the
tensors viewing it, before the rest counts as unbacked: a tensor and one alias (tied
weights, as a language model's embedding and output layer) cost nothing beyond the file."""


def aliased(where: str, tensors: dict[str, SourceTensor], viewed: dict[str, torch.Tensor]) -> None:
    """Count against ``untrusted_bytes_limit`` what the views of one storage materialize
    beyond :data:`ALIASES_FREE` copies of it (in ``tensors``, replaced in place).

    Each view alone spans its bytes of the file, so each was backed; but every view is
    written out whole, and a few kilobytes of file naming one storage thousands of times
    (``{f"w{i}": base for i in range(20000)}``) made a conversion write tens of
    gigabytes. ``viewed``: the loaded tensor of each key."""
    groups: dict[tuple[int, int], list[str]] = {}
    for key, tensor in viewed.items():
        source = tensors.get(key)
        if source is None or source.unbacked is not None or tensor.numel() == 0:
            continue  # an overlapping view is counted whole already
        storage = tensor.untyped_storage()
        groups.setdefault((storage.data_ptr(), storage.nbytes()), []).append(key)
    for (_, storage_bytes), keys in groups.items():
        free, spent = ALIASES_FREE * storage_bytes, 0
        for key in keys:
            source = tensors[key]
            spent += source.nbytes
            if spent > free:
                extra = Unbacked(math.prod(source.shape), storage_bytes, where)
                tensors[key] = dataclasses.replace(source, unbacked=extra)


def check_allocation(source: Source, limit: int) -> None:
    """Refuse, before anything is read or written, a conversion of ``source`` whose
    unbacked tensors would take more than ``limit`` bytes (module docstring)."""
    unbacked = [t for t in source.tensors.values() if t.unbacked is not None]
    total = sum(t.untrusted_bytes for t in unbacked)
    if total <= limit:
        return
    largest = sorted(unbacked, key=lambda t: t.untrusted_bytes, reverse=True)[:3]
    raise CheckpointCorruptError(
        f"{source.where}: converting it would allocate {total} bytes ({_gib(total)}) for "
        "tensors whose size only the file gives, beyond the bytes it holds of them "
        f"(largest: {', '.join(map(_described, largest))}), more than "
        f"untrusted_bytes_limit={limit} ({_gib(limit)}). Such a tensor is an expanded or "
        "overlapping view (torch.save of tensor.expand(...)), one of more than "
        f"{ALIASES_FREE} tensors viewing one storage (each is written whole), or a DCP "
        "chunk declared larger than its bytes in the file, and converting it materializes "
        "it in full. If the "
        "file is trusted, pass a larger untrusted_bytes_limit to shardsafe.convert "
        "(--untrusted-bytes-limit on the command line)."
    )


def _described(t: SourceTensor) -> str:
    assert t.unbacked is not None
    return (
        f"{t.key!r}: {dtypes.dtype_name(t.dtype)}{list(t.shape)}, {t.untrusted_bytes} bytes "
        f"made from {t.unbacked.held_bytes} bytes of {t.unbacked.file}"
    )


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"
