"""The collect phase of a save: every state entry, through its adapter, into save items.

Refuses here, before anything is written, what ``load`` would refuse (a dtype
safetensors cannot hold, a tensor key too long, too many dimensions) and what it could
not give back (one key given to two tensors).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ... import _names, dtypes
from ...adapters.registry import adapter_for
from ...errors import CheckpointError
from ...protocol import Adapter, Chunk, SaveContext, SaveItem, load_names
from ..format import geometry
from ..format.manifest_format import MAX_NAME_CHARS, MAX_NDIM, valid_value_name
from ..format.tensor_bytes import byte_view, has_memory

MAX_KEY_CHARS = MAX_NAME_CHARS - 1024
"""Longest tensor key ``save`` takes: room is left for the offsets a chunk name adds."""

Collected = dict[str, tuple[Adapter, SaveItem]]
"""Each state entry's adapter and what it made of the entry on this rank."""


def check_state(state: Mapping[str, Any]) -> None:
    if not isinstance(state, Mapping) or not state:
        raise ValueError(
            "state must be a non-empty dict of name -> value, e.g. "
            "{'model': model, 'optimizer': optimizer}"
        )
    for name in state:
        if not valid_value_name(name):
            raise ValueError(
                f"state key {name!r} must be a non-empty string without '/' "
                "that does not start with '@'"
            )


def collect(state: Mapping[str, Any], rank: int, world_size: int) -> Collected:
    """What every entry of ``state`` becomes on this rank."""
    names, _, unqualified = load_names(state)  # one walk: names, and those an EMA qualifies
    items: Collected = {}
    for name, obj in state.items():
        adapter, obj = adapter_for(obj, name)
        ctx = SaveContext(
            name=name,
            rank=rank,
            world_size=world_size,
            param_names=names,
            param_unqualified=unqualified,
        )
        item = adapter.save(obj, ctx)
        for chunk in item.chunks:
            _check_chunk(chunk, name)
        _check_distinct(item.chunks, ctx)
        items[name] = (adapter, item)
    return items


def _check_distinct(chunks: list[Chunk], ctx: SaveContext) -> None:
    """Refuse one key given to two tensors on this rank: two of its chunks that overlap or
    disagree about the tensor they are part of.

    ``ctx.key`` refuses a key made for two paths as it is made; this catches an adapter
    that builds keys by hand, before anything is written (the planner would keep one of
    two replicated copies and drop the other without a word). Most keys have one chunk
    per rank, so this is a dict insert per chunk.
    """
    by_key: dict[str, list[Chunk]] = {}
    for chunk in chunks:
        by_key.setdefault(chunk.key, []).append(chunk)
    for key, same in by_key.items():
        problem = _clash(same) if len(same) > 1 else None
        if problem is not None:
            path = ctx.claims.path_of(key)
            known = f" (one is state[{ctx.name!r}]{_names.show(path)})" if path else ""
            raise CheckpointError(
                f"state[{ctx.name!r}] gives two different tensors the key {key!r}{known}: "
                f"{problem}, so one would be lost. Each tensor needs a key of its own: make "
                "keys with ctx.key(*path) (nothing was written)"
            )


def _clash(chunks: list[Chunk]) -> str | None:
    """Why chunks of one key on one rank cannot be pieces of one tensor, or ``None``."""
    first = chunks[0]
    for c in chunks[1:]:
        if (c.tensor.dtype, c.global_shape) != (first.tensor.dtype, first.global_shape):
            return (
                f"one is {dtypes.dtype_name(first.tensor.dtype)}{list(first.global_shape)}, "
                f"the other {dtypes.dtype_name(c.tensor.dtype)}{list(c.global_shape)}"
            )
    boxes = [(c.offsets, tuple(c.tensor.shape)) for c in chunks]
    if len(set(boxes)) < len(boxes):
        return "two of its pieces cover the same region"
    if len(boxes) <= geometry.PAIRWISE_LIMIT:
        for i, a in enumerate(boxes):
            if any(geometry.intersect(a, b) is not None for b in boxes[i + 1 :]):
                return "two of its pieces overlap"
    return None


def _check_chunk(chunk: Chunk, name: str) -> None:
    not_plain = _not_plain(chunk.tensor)
    if not_plain is not None:
        what, fix = not_plain
        raise CheckpointError(
            f"tensor {chunk.key!r} of state[{name!r}] is {what}: a checkpoint holds dense "
            f"tensors with memory of their own (on the CPU or a GPU) and DTensors; {fix} "
            "(nothing was written)"
        )
    if not dtypes.is_supported(chunk.tensor.dtype):
        raise CheckpointError(
            f"tensor {chunk.key!r} has dtype {chunk.tensor.dtype}, which safetensors cannot store"
        )
    if len(chunk.key) > MAX_KEY_CHARS:
        raise CheckpointError(
            f"tensor key {chunk.key[:60]!r}... of state[{name!r}] is {len(chunk.key)} "
            f"characters long; a checkpoint holds keys of at most {MAX_KEY_CHARS}"
        )
    if chunk.key != name and not chunk.key.startswith(name + "/"):
        raise CheckpointError(
            f"an adapter gave state[{name!r}] a tensor key {chunk.key!r} outside its own "
            f"namespace; keys must be {name!r} or start with {name + '/'!r} (use ctx.key())"
        )
    if chunk.tensor.dim() > MAX_NDIM:
        raise CheckpointError(
            f"tensor {chunk.key!r} has {chunk.tensor.dim()} dimensions; a checkpoint holds at "
            f"most {MAX_NDIM}"
        )


def _not_plain(tensor: torch.Tensor) -> tuple[str, str] | None:
    """What ``tensor`` is, and how to save it, if its bytes cannot be read as they are."""
    if tensor.is_nested:  # torch.jagged: to_dense() refuses it
        how = (
            "save its components (tensor.unbind()) or its padded form (tensor.to_padded_tensor(0))"
        )
        return f"a {tensor.layout} tensor", how
    if tensor.layout != torch.strided:
        return f"a {tensor.layout} tensor", "save its dense form (tensor.to_dense())"
    if tensor.device.type == "meta":
        return "on the meta device, with no data", "materialize it before saving"
    if tensor.is_conj() or tensor.is_neg():
        return (
            "a view with a pending conjugation or negation",
            "save tensor.resolve_conj().resolve_neg()",
        )
    if has_memory(tensor):
        return None
    # A wrapper subclass: fine if the writer's own view of its bytes (``chunk_bytes``) is
    # a plain tensor (torchao's float8 weight wrappers unwrap so); else reading it as
    # if it had memory crashed the interpreter (a TwoTensor, say).
    try:
        flat = byte_view(tensor.detach().contiguous())
    except Exception:  # torch raises what the subclass's dispatch raises
        flat = None
    if type(flat) is torch.Tensor and (flat.device.type != "cpu" or has_memory(flat)):
        return None
    return (
        f"a {type(tensor).__name__}, a tensor subclass whose bytes are not those of a plain tensor",
        "save the plain tensors it stands for (dequantized, or the tensors it wraps)",
    )
