"""shardsafe: correct, fast, crash-safe checkpoints for PyTorch, however the state is sharded.

Public API (everything else is private and may change)::

    shardsafe.save(path, state, layout="sharded" | "consolidated")
    shardsafe.async_save(path, state) -> SaveHandle (staged now, written in the background)
    shardsafe.load(path, state, strict=True) -> dict of plain values
    shardsafe.read_manifest(path) -> what a checkpoint holds, without reading data
    shardsafe.verify(path) -> VerifyReport: every byte against its checksum
    shardsafe.inspect(path) -> InspectReport: values, tensors, files, writers, sizes
    shardsafe.CheckpointManager(root, keep_last=k)
    shardsafe.TieredCheckpointManager(persistent, local, local_every=.., persist_every=..)
    shardsafe.RNGState()
    shardsafe.Trainer(strategy=..., devices=N, ...).fit(shardsafe.TrainingModule subclass)
    shardsafe.register_adapter(adapter) / shardsafe.Adapter
    shardsafe.convert(src, dst, to="shardsafe" | "dcp" | "hf" | "torch") -> Conversion
    shardsafe.CheckpointError and its children
"""

from __future__ import annotations

from ._version import __version__
from .adapters import Adapter, RNGState, register_adapter
from .checkpoint.api import SaveHandle, async_save, load, read_manifest, save
from .checkpoint.inspecting import InspectReport, inspect
from .checkpoint.manager import CheckpointManager
from .checkpoint.verifying import VerifyReport, verify
from .converters import convert
from .errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointVersionError,
)
from .tiers import TieredCheckpointManager
from .trainer import Trainer, TrainingModule

__all__ = [
    "Adapter",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointManager",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "CheckpointVersionError",
    "InspectReport",
    "RNGState",
    "SaveHandle",
    "TieredCheckpointManager",
    "Trainer",
    "TrainingModule",
    "VerifyReport",
    "__version__",
    "async_save",
    "convert",
    "inspect",
    "load",
    "read_manifest",
    "register_adapter",
    "save",
    "verify",
]
