"""Plain values (tensors and JSON-able data) and generic stateful objects (LR schedulers).

Both are assumed identical on every rank, as they are in data-parallel training: rank 0's
metadata is recorded and each tensor is written once.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .. import _tree, dtypes
from ..protocol import (
    Adapter,
    Chunk,
    LoadContext,
    LoadRequests,
    ReadRequest,
    SaveContext,
    SavedValue,
    SaveItem,
)
from . import dtensor

_PLAIN = (type(None), bool, int, float, str, list, tuple, dict, torch.Tensor)


def encode_replicated(value: Any, ctx: SaveContext, kind: str) -> SaveItem:
    """Encode a tree whose tensors are the same on every rank (DTensors: their shards)."""
    chunks: list[Chunk] = []

    def sink(path: tuple[str, ...], tensor: torch.Tensor) -> str:
        key = ctx.key(*path)
        chunks.extend(dtensor.chunks_of(key, tensor, replicated=True))
        return key

    meta = _tree.encode(value, f"state[{ctx.name!r}]", sink)
    return SaveItem(kind, meta, chunks)


def full_requests(saved: SavedValue) -> LoadRequests:
    """Every tensor the saved tree refers to, whole; the tree's structure checked first."""
    _tree.check_structure(saved.meta, f"the manifest entry for {saved.name!r}")
    return LoadRequests(requests=[ReadRequest(ref) for ref in _tree.tensor_refs(saved.meta)])


class PlainDataAdapter(Adapter):
    """Tensors and JSON-able values (kind ``"value"``). Load returns them, even unasked; a
    live tensor is also filled in place."""

    kind = "value"
    returns_value = True

    def handles(self, obj: object) -> bool:
        return isinstance(obj, _PLAIN)

    def save(self, obj: Any, ctx: SaveContext) -> SaveItem:
        return encode_replicated(obj, ctx, self.kind)

    def plan_load(self, obj: Any, saved: SavedValue, ctx: LoadContext) -> LoadRequests:
        plan = full_requests(saved)
        if not isinstance(obj, torch.Tensor):
            return plan
        meta = saved.meta
        ref = meta.get("__tensor__") if isinstance(meta, dict) and len(meta) == 1 else None
        if not isinstance(ref, str):
            plan.requests = []
            plan.mismatched.append(
                f"state[{ctx.name!r}] is a live tensor {dtypes.dtype_name(obj.dtype)}"
                f"{list(obj.shape)}, but the checkpoint holds a {_tree.describe(saved.meta)} "
                "for it"
            )
            return plan
        # Whatever key the metadata names, it must fit the live tensor it is copied into.
        plan.requests = [ReadRequest(ref, dtype=obj.dtype, global_shape=tuple(obj.shape))]
        return plan

    def validate(
        self, obj: Any, saved: SavedValue, tensors: Mapping[str, torch.Tensor], ctx: LoadContext
    ) -> None:
        _tree.decode(saved.meta, tensors)

    def restore(
        self, obj: Any, saved: SavedValue, tensors: Mapping[str, torch.Tensor], ctx: LoadContext
    ) -> Any:
        value = _tree.decode(saved.meta, tensors)
        if isinstance(obj, torch.Tensor) and isinstance(value, torch.Tensor):
            with torch.no_grad():
                obj.copy_(value)
        return value


class StatefulAdapter(Adapter):
    """Anything with ``state_dict()``/``load_state_dict()``: LR schedulers, samplers, ..."""

    kind = "stateful"

    def handles(self, obj: object) -> bool:
        return callable(getattr(obj, "state_dict", None)) and callable(
            getattr(obj, "load_state_dict", None)
        )

    def save(self, obj: Any, ctx: SaveContext) -> SaveItem:
        return encode_replicated(obj.state_dict(), ctx, self.kind)

    def plan_load(self, obj: Any, saved: SavedValue, ctx: LoadContext) -> LoadRequests:
        return full_requests(saved)

    def validate(
        self, obj: Any, saved: SavedValue, tensors: Mapping[str, torch.Tensor], ctx: LoadContext
    ) -> None:
        _tree.decode(saved.meta, tensors)

    def restore(
        self, obj: Any, saved: SavedValue, tensors: Mapping[str, torch.Tensor], ctx: LoadContext
    ) -> None:
        obj.load_state_dict(_tree.decode(saved.meta, tensors))
