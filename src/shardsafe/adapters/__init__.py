"""Adapters turn each kind of training state into checkpoint entries and back.

The built-in ones are registered here, most specific first; user adapters registered
later with :func:`register_adapter` take precedence over all of them.
"""

from __future__ import annotations

from typing import Any

from ..checkpoint.entries import Chunk, LoadPlan, ReadRequest, SavedValue, SaveItem
from ..errors import CheckpointError
from .base import Adapter, Context, find_adapter, register_adapter
from .module import ModuleAdapter
from .optimizer import OptimizerAdapter
from .partitioned import OSSAdapter, PartitionedOptimizerAdapter, ZeroAdapter
from .rng import RNGAdapter, RNGState
from .values import StatefulAdapter, ValueAdapter


class UnknownShardedOptimizer(Adapter):
    """Refuses optimizers that look sharded but that no adapter understands.

    Saving one as a plain optimizer would either record only this rank's shard or call
    its ``state_dict()``, which for such optimizers raises on most ranks or needs a
    collective that would hang. A clear error, agreed on every rank, is better.
    """

    kind = "optimizer"

    def handles(self, obj: object) -> bool:
        return callable(getattr(obj, "consolidate_state_dict", None))

    def _refuse(self, obj: object, ctx: Context) -> CheckpointError:
        return CheckpointError(
            f"state[{ctx.name!r}] is a {type(obj).__qualname__}, which looks like a sharded "
            "optimizer (it has consolidate_state_dict()), but no shardsafe adapter handles "
            "it, and saving it as a plain optimizer would lose the other ranks' state. "
            "Register one: subclass shardsafe.adapters.PartitionedOptimizerAdapter with "
            "wrapper_type set to its class and call shardsafe.register_adapter() "
            "(README: 'ZeRO, OSS and your own sharded optimizer')."
        )

    def save(self, obj: Any, ctx: Context) -> SaveItem:
        raise self._refuse(obj, ctx)

    def plan_load(self, obj: Any, saved: SavedValue, ctx: Context) -> LoadPlan:
        raise self._refuse(obj, ctx)

    def restore(self, obj: Any, saved: SavedValue, tensors: Any, ctx: Context) -> None:
        raise self._refuse(obj, ctx)


def _register_builtins() -> None:
    builtins: list[Adapter] = [
        ModuleAdapter(),
        ZeroAdapter(),
        OSSAdapter(),
        UnknownShardedOptimizer(),
        OptimizerAdapter(),
        RNGAdapter(),
        StatefulAdapter(),
        ValueAdapter(),
    ]
    for adapter in reversed(builtins):
        register_adapter(adapter)


_register_builtins()

__all__ = [
    "Adapter",
    "Chunk",
    "Context",
    "LoadPlan",
    "PartitionedOptimizerAdapter",
    "RNGState",
    "ReadRequest",
    "SaveItem",
    "SavedValue",
    "find_adapter",
    "register_adapter",
]
