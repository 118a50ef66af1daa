"""The collect phase of a save: every state entry, through its adapter, into save items.

Refuses here, before anything is written, what ``load`` would refuse (a dtype
safetensors cannot hold, a tensor key too long, too many dimensions).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .. import dtypes
from ..adapters.registry import find_adapter
from ..errors import CheckpointError
from ..protocol import Adapter, Chunk, SaveContext, SaveItem, param_names
from .manifest_format import MAX_NAME_CHARS, MAX_NDIM, valid_value_name

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
    names = param_names(state)
    items: Collected = {}
    for name, obj in state.items():
        adapter = find_adapter(obj, name)
        ctx = SaveContext(name=name, rank=rank, world_size=world_size, param_names=names)
        item = adapter.save(obj, ctx)
        for chunk in item.chunks:
            _check_chunk(chunk, name)
        items[name] = (adapter, item)
    return items


def _check_chunk(chunk: Chunk, name: str) -> None:
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
