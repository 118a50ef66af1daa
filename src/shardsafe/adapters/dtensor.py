"""DTensor (FSDP2, tensor parallel) helpers: which box of the global tensor this rank holds.

Kept apart so that the rest of shardsafe does not import DTensor machinery, which moved
between torch releases (``torch.distributed._tensor`` before 2.5).

DTensor support is imported lazily: importing it costs half a second, and a value can only
be a DTensor if the user's program has imported it already.
"""

from __future__ import annotations

import functools
import math
import sys
from typing import Any

import torch

from ..errors import CheckpointError, CheckpointMismatchError
from ..protocol import Chunk

_DTENSOR_MODULES = ("torch.distributed.tensor._api", "torch.distributed._tensor.api")


_FOUND: list[Any] = []


def _dtensor_class() -> Any:
    """The DTensor class once the user's program has imported it, else ``None`` (kept once
    found: every tensor of every save asks)."""
    if _FOUND:
        return _FOUND[0]
    for name in _DTENSOR_MODULES:
        module = sys.modules.get(name)
        if module is not None and hasattr(module, "DTensor"):
            _FOUND.append(module.DTensor)
            return module.DTensor
    return None


def is_dtensor_imported() -> bool:
    """Whether the program has imported DTensor, so that any value may be one."""
    return _dtensor_class() is not None


def is_dtensor(value: object) -> bool:
    cls = _dtensor_class()
    return cls is not None and isinstance(value, cls)


def local_box(value: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(global offsets, local shape)`` of this rank's shard; on a rank outside the
    DTensor's mesh, the empty box at the origin (:func:`_outside_box`)."""
    mesh = value.device_mesh
    position = _position(mesh)
    if position is None:
        return _outside_box(value)
    box = _box(tuple(value.shape), mesh, tuple(value.placements), position)
    _check_local(value, box[1])
    return box


def outside_mesh(value: Any) -> bool:
    """Whether this process is outside the mesh of the DTensor ``value`` (one on ranks
    ``[0, 1]`` that ranks 2 and 3 hold too): torch gives such a rank an empty local tensor
    and computes nothing there; the ranks in the mesh hold all of the tensor."""
    return _position(value.device_mesh) is None


def _outside_box(value: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """What a rank outside the mesh asks for on load: an empty box at the origin (of a
    0-dim tensor, its one element, read and dropped), which needs no bytes and lies in
    any saved shape. torch's ``compute_local_shape_and_global_offset`` answers such a
    rank ``((0,), ())``, a box of another rank, which was offered as a shard or a whole
    copy on save ("manifest.json is malformed ... overlap or leave holes") and refused
    on load ("requested region lies outside the saved shape") (found in review)."""
    zeros = (0,) * len(value.shape)
    return zeros, zeros


def _check_local(value: Any, shape: tuple[int, ...]) -> None:
    """Refuse a local tensor that is not the piece its placements give this rank
    (``DTensor.from_local(..., shape=)`` with pieces of other sizes than torch's split):
    a save failed inside a reshape, and a load inside the module's own load, after
    restoring had begun (found in review)."""
    local = getattr(value, "_local_tensor", None)  # not detached: every save asks
    if not isinstance(local, torch.Tensor):
        local = value.to_local()
    if local.numel() != math.prod(shape):
        raise CheckpointMismatchError(
            f"a DTensor of shape {list(value.shape)} placed {list(value.placements)} holds "
            f"a local tensor of shape {list(local.shape)} on this rank, where its "
            f"placements give {list(shape)}: pieces of other sizes than torch's split "
            "(DTensor.from_local with shape=), which shardsafe does not save or load; "
            ".redistribute() it, or build it with torch's split (nothing was saved or "
            "restored)"
        )


def _position(mesh: Any) -> tuple[int, ...] | None:
    """This process's coordinate in ``mesh``, part of every cached answer's key (which
    depends on nothing else of the process): meshes compare equal whatever process asks,
    so a process that joined a new process group as another rank (an in-process
    restart) was given its old rank's shards, saved them under the other rank's box and
    loaded the other rank's rows (found in review). The mesh keeps the coordinate."""
    coordinate = mesh.get_coordinate()
    return None if coordinate is None else tuple(coordinate)


@functools.lru_cache(maxsize=4096)
def _box(
    shape: tuple[int, ...],
    mesh: Any,
    placements: tuple[Any, ...],
    position: tuple[int, ...] | None,
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Cached: torch's computation costs ~75 us a call, and a parameter, its gradient
    moments and every later save ask it again about the same geometry (it depends only on
    the global shape, the mesh and this rank's ``position`` in it, the placements)."""
    try:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    except ImportError:  # pragma: no cover - torch 2.4
        from torch.distributed._tensor._utils import (  # type: ignore[no-redef,import-not-found,unused-ignore]
            compute_local_shape_and_global_offset,
        )
    local, offsets = compute_local_shape_and_global_offset(shape, mesh, placements)
    if any(type(p).__name__ == "_StridedShard" for p in placements):
        _refuse_interleaved(shape, mesh, placements, tuple(local))
    return tuple(offsets), tuple(local)


def _refuse_interleaved(
    shape: tuple[int, ...], mesh: Any, placements: tuple[Any, ...], local: tuple[int, ...]
) -> None:
    """Refuse a shard whose rows along some dimension are not one block of the global
    tensor. torch gives a shard's first offset on each dimension, which is its box only if
    the rows are consecutive; under a ``_StridedShard`` they can be interleaved (torch
    makes one from ``.view()`` of a sharded tensor), and such a box read or wrote other
    rows in silence. FSDP2's and TP x FSDP2's strided shards are blocks, and pass."""
    rows = _rows(shape, mesh, placements)
    for dim, (index, size) in enumerate(zip(rows, local)):
        if (
            index is not None
            and size
            and index.tolist() != list(range(int(index[0]), int(index[0]) + size))
        ):
            raise CheckpointMismatchError(
                f"a DTensor of shape {list(shape)} placed {list(placements)} holds, on this "
                f"rank (mesh coordinate {mesh.get_coordinate()}), rows {index.tolist()[:8]}"
                f"{'...' if size > 8 else ''} of dimension {dim}: not one block of the "
                "tensor, which shardsafe saves and loads shards as; .redistribute() it to "
                "Shard or Replicate placements (nothing was saved or restored)"
            )


def _rows(shape: tuple[int, ...], mesh: Any, placements: tuple[Any, ...]) -> list[Any]:
    """Per dimension, the global indices this rank holds (``None``: all of them), as
    torch's own ``compute_local_shape_and_global_offset`` finds them before it keeps
    the first (its private helper; where a torch release lacks it, nothing is refused)."""
    try:
        from torch.distributed.tensor._utils import _get_shard_size_and_offsets
    except ImportError:  # pragma: no cover - other torch releases
        return [None] * len(shape)
    sizes, found = list(shape), [None] * len(shape)
    coordinate = mesh.get_coordinate()
    try:
        for mesh_dim, placement in enumerate(placements):
            if not hasattr(placement, "dim") or placement.is_replicate():
                continue
            dim = placement.dim
            sizes[dim], found[dim] = _get_shard_size_and_offsets(
                sizes[dim], mesh.size(mesh_dim), coordinate[mesh_dim], placement, found[dim],
                shape[dim], False,
            )  # fmt: skip
    except Exception:  # pragma: no cover - its signature changed: nothing is refused
        return [None] * len(shape)
    return found


Geometry = tuple[str, tuple[int, ...], tuple[int, ...]]
"""``(role, global offsets, local shape)``; role is "replicated", "shard", "partial"
(unsavable) or "outside" (this rank is outside the mesh and holds none of it: it offers
nothing on save and asks for the empty box of :func:`_outside_box` on load). A shard may
have copies: the ranks that differ from this one only on a ``Replicate`` dimension of the
mesh (HSDP's replicas) hold the same box. Each offers it, and the save plan stores it
once, spreading such shards over their holders (``save_plan.copies_of``)."""

_GEOMETRY: dict[Any, Geometry] = {}
_GEOMETRY_LIMIT = 4096


def geometry(value: Any) -> Geometry:
    """What this rank holds of the DTensor ``value``, cached by its sharding spec.

    An asynchronous save stalls training for as long as this runs on every DTensor
    (parameters and both Adam moments), so the answer is kept by the spec: torch's
    ``DTensorSpec`` hashes (once, cached) and compares by mesh, placements, shape, stride
    and dtype, which is all the answer depends on; the global shape is part of the key
    too, in case a spec carries no tensor metadata. A value without a spec (older torch)
    is keyed by its mesh, placements and shape."""
    spec = getattr(value, "_spec", None)
    if spec is None:
        spec = (value.device_mesh, tuple(value.placements))
    key = (spec, value.shape, _position(value.device_mesh))
    found = _GEOMETRY.get(key)
    if found is None:
        found = _geometry(value)
        if len(_GEOMETRY) >= _GEOMETRY_LIMIT:
            _GEOMETRY.clear()
        _GEOMETRY[key] = found
    elif found[0] == "shard":
        _check_local(value, found[2])
    return found


def _geometry(value: Any) -> Geometry:
    placements = tuple(value.placements)
    if any(p.is_partial() for p in placements):
        return "partial", (), ()
    shape = tuple(value.shape)
    if outside_mesh(value):
        return "outside", *_outside_box(value)
    if all(p.is_replicate() for p in placements):
        return "replicated", (0,) * len(shape), shape
    offsets, local = local_box(value)
    return "shard", offsets, local


def refuse_partial_target(key: str, value: Any) -> None:
    """Refuse to load into a DTensor with a Partial placement, before anything is restored:
    each rank would take the whole value as its share, and the DTensor's value, their sum,
    would be world-size times the saved one (no error)."""
    if is_dtensor(value) and geometry(value)[0] == "partial":
        raise CheckpointMismatchError(
            f"{key!r} is loaded into a DTensor with a Partial placement, whose value is the "
            "sum of every rank's share; redistribute it to Shard or Replicate placements "
            "before loading (nothing was restored)"
        )


def local_chunks(key: str, value: Any) -> list[Chunk]:
    """The chunk this rank offers for a DTensor: none outside its mesh, where the ranks
    in the mesh hold all of it."""
    role, offsets, shape = geometry(value)
    if role == "partial":
        raise CheckpointError(
            f"{key!r} is a DTensor with a Partial placement; reduce it "
            "(e.g. .redistribute() to Shard/Replicate) before saving"
        )
    if role == "outside":
        return []
    local = _local_tensor(value)
    global_shape = tuple(value.shape)
    if role == "replicated":
        return [Chunk(key, local, global_shape, offsets, replicated=True)]
    if local.shape != shape:
        local = local.reshape(shape)
    return [Chunk(key, local, global_shape, offsets, replicated=False, copies_allowed=True)]


def _local_tensor(value: Any) -> torch.Tensor:
    """This rank's shard, detached. ``_local_tensor`` is what ``to_local()`` returns,
    without its trip through autograd (~25 us a call, three calls per parameter)."""
    local = getattr(value, "_local_tensor", None)
    if not isinstance(local, torch.Tensor):
        local = value.to_local()
    return local.detach()


def chunks_of(key: str, tensor: torch.Tensor, *, replicated: bool) -> list[Chunk]:
    """What this rank offers for ``tensor``: its DTensor shard (nothing outside the
    DTensor's mesh), else the whole tensor, ``replicated`` if every rank holds the same
    copy."""
    if is_dtensor(tensor):
        return local_chunks(key, tensor)
    refuse_nested(key, tensor)
    return [Chunk.whole(key, tensor.detach(), replicated=replicated)]


def refuse_nested(key: str, tensor: torch.Tensor) -> None:
    """A strided nested tensor has no shape to plan by: refused, with the way out."""
    if tensor.is_nested and tensor.layout == torch.strided:
        raise CheckpointError(
            f"cannot save {key!r}: it is a nested tensor (torch.strided layout), whose bytes "
            "are not one array; save its components (tensor.unbind()) or its padded form "
            "(tensor.to_padded_tensor(0))"
        )


def local_of(value: torch.Tensor) -> torch.Tensor:
    """The tensor holding this rank's bytes of ``value``: its local shard for a DTensor.
    Outside the DTensor's mesh, its empty local tensor shaped as the box asked for there
    (:func:`_outside_box`), so that the empty read lands in it, or is copied into it,
    as any shard's does (torch's is 1-dimensional whatever the tensor's dimensions)."""
    if not is_dtensor(value):
        return value
    local: torch.Tensor = value.to_local()  # type: ignore[attr-defined]
    if local.numel() == 0 and outside_mesh(value):
        return local.view(_outside_box(value)[1]) if value.dim() else local
    return local


def like(template: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` shaped as ``template``: wrapped as a DTensor with its placements if needed."""
    if not is_dtensor(template):
        return local
    t: Any = template
    if outside_mesh(template):
        return _empty_like(template)
    own = _local_tensor(template)  # not local_of: to_local's autograd trip, per tensor
    if (
        local.data_ptr() == own.data_ptr()
        and local.shape == own.shape
        and local.device == own.device
    ):
        # Read in place: the template itself. Wrapped anew, its local would be a view of
        # the same memory with other strides (from_local makes them contiguous), which
        # torch's copy_ refuses as an overlap (a (1, 3) weight split on dim 1).
        detached: torch.Tensor = template.detach()
        return detached
    wrapped: torch.Tensor = _dtensor_class().from_local(
        local.to(t.device_mesh.device_type),
        t.device_mesh,
        t.placements,
        shape=t.shape,
        stride=t.stride(),
    )
    return wrapped


def _empty_like(template: Any) -> torch.Tensor:
    """A DTensor placed like ``template`` on a rank outside its mesh: an empty local
    tensor, as torch gives such a rank (what was read for it there is an empty box, or a
    0-dim tensor's one element, which no rank outside the mesh keeps). A 0-dim one is
    made from a 0-dim local tensor without ``shape=``: ``from_local`` takes an empty
    ``shape`` for none given and computed the shape ``[0]`` from torch's empty local."""
    own = _local_tensor(template)
    mesh, placements = template.device_mesh, template.placements
    if template.dim() == 0:  # only Replicate (or Partial, refused) places a 0-dim tensor
        scalar: torch.Tensor = _dtensor_class().from_local(own.new_empty(()), mesh, placements)
        return scalar
    wrapped: torch.Tensor = _dtensor_class().from_local(
        own.new_empty(0), mesh, placements, shape=template.shape, stride=template.stride()
    )
    return wrapped
