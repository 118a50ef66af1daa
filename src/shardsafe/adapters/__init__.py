"""Adapters turn each kind of training state into checkpoint entries and back.

The built-in ones are registered here, most specific first; user adapters registered
later with :func:`register_adapter` take precedence over all of them.
"""

from __future__ import annotations

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
from .module import ModuleAdapter
from .optimizer import OptimizerAdapter
from .partitioned import OSSAdapter, PartitionedOptimizerAdapter, ZeroAdapter
from .registry import find_adapter, register_adapter
from .rng import RNGAdapter, RNGState
from .unknown import UnknownShardedOptimizer
from .values import PlainDataAdapter, StatefulAdapter


def _register_builtins() -> None:
    builtins: list[Adapter] = [
        ModuleAdapter(),
        ZeroAdapter(),
        OSSAdapter(),
        UnknownShardedOptimizer(),
        OptimizerAdapter(),
        RNGAdapter(),
        StatefulAdapter(),
        PlainDataAdapter(),
    ]
    for adapter in reversed(builtins):
        register_adapter(adapter)


_register_builtins()

__all__ = [
    "Adapter",
    "Chunk",
    "LoadContext",
    "LoadRequests",
    "PartitionedOptimizerAdapter",
    "RNGState",
    "ReadRequest",
    "SaveContext",
    "SaveItem",
    "SavedValue",
    "find_adapter",
    "register_adapter",
]
