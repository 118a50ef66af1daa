"""Objects registered with ``accelerator.register_for_checkpointing``: the main process's
copy is saved, and every process loads it, as Accelerate's own ``save_state`` does (only
the main process writes ``custom_checkpoint_<i>.pkl``; every process loads that file).

shardsafe's built-in adapters take a module's parameters, and a stateful object's larger
tensors, to be the same on every process (DDP keeps them so) and spread their writing
over the processes; a registered object is often each process's own (statistics kept
per process), and was then saved as a mix of the processes' tensors, which every process
loaded back without a word. Here each of its tensors is the lowest rank's copy
(``Chunk.lowest_rank_wins``, as shardsafe saves a module's buffers) and its metadata
rank 0's; the entries keep the kinds and layout of the built-in adapters, so checkpoints
written before load as they did, and these load with ``shardsafe.load`` too.

A registered module stays the module in the state (not a wrapper), so its parameters
keep naming an optimizer's state as before: it is recognised by identity
(:func:`main_process_copy`). Any other object is wrapped in :class:`MainProcessCopy`.
An object whose adapter is not a built-in one (a user's ``register_adapter``) is left
to it.
"""

from __future__ import annotations

import weakref
from dataclasses import replace
from typing import Any

from torch import nn

from .. import _tree
from ..adapters import find_adapter, register_adapter
from ..adapters.module import ModuleAdapter
from ..adapters.values import StatefulAdapter, encode_replicated
from ..errors import CheckpointError
from ..protocol import JSON, SaveContext, SaveItem

_MAIN_COPY_MODULES: weakref.WeakValueDictionary[int, nn.Module] = weakref.WeakValueDictionary()
"""The registered modules saved as the main process's copy, by ``id`` (a module of a
user's class may define ``__eq__`` and so not be hashable)."""


class MainProcessCopy:
    """A registered object that is not a module, saved as the main process's copy; its
    ``state_dict``/``load_state_dict`` are the object's, so it loads as any stateful
    object does."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def state_dict(self) -> Any:
        return self.obj.state_dict()

    def load_state_dict(self, state: Any) -> Any:
        return self.obj.load_state_dict(state)


def main_process_copy(obj: Any, name: str) -> Any:
    """``obj`` (``state[name]``), registered with the accelerator, as the state holds it
    to be saved as the main process's copy: a module marked (kept itself), another
    object that the built-in stateful adapter saves wrapped; anything else as it is."""
    try:
        adapter = find_adapter(obj, name)
    except CheckpointError:  # refused by the save or load, in its own words
        return obj
    if isinstance(obj, nn.Module) and type(adapter) in (ModuleAdapter, _MainCopyModuleAdapter):
        _MAIN_COPY_MODULES[id(obj)] = obj
        return obj
    if type(adapter) is StatefulAdapter:
        return MainProcessCopy(obj)
    return obj


def _lowest_rank_wins(item: SaveItem) -> SaveItem:
    """``item`` with each tensor the lowest holding rank's copy (DTensor shards, which
    are no copies, as they are)."""
    item.chunks = [
        replace(c, lowest_rank_wins=True) if c.replicated and not c.lowest_rank_wins else c
        for c in item.chunks
    ]
    return item


class _MainCopyModuleAdapter(ModuleAdapter):
    """A registered module (:func:`main_process_copy`): the lowest rank's copy of each
    tensor, and of each non-tensor state-dict value (which the built-in adapter refuses
    when the processes differ: one record cannot give each its own)."""

    def handles(self, obj: object) -> bool:
        return isinstance(obj, nn.Module) and _MAIN_COPY_MODULES.get(id(obj)) is obj

    def save(self, obj: nn.Module, ctx: SaveContext) -> SaveItem:
        return _lowest_rank_wins(super().save(obj, ctx))

    def merge(self, metas: list[JSON]) -> JSON:
        names: dict[str, None] = {}
        extra: dict[str, Any] = {}
        for meta in metas:
            names.update(dict.fromkeys(meta["tensors"]))
            for name, value in meta["extra"].items():
                extra.setdefault(name, value)
        return super().merge([{"tensors": list(names), "extra": extra}])


class _MainCopyStatefulAdapter(StatefulAdapter):
    """A registered object that is not a module (:class:`MainProcessCopy`): rank 0's
    ``state_dict()``, its tensors included (the built-in adapter keeps a small tensor
    that differs per process as each process's own, and a larger one as any process's)."""

    def handles(self, obj: object) -> bool:
        return isinstance(obj, MainProcessCopy)

    def save(self, obj: Any, ctx: SaveContext) -> SaveItem:
        return encode_replicated(obj.state_dict(), ctx, self.kind, "rank 0's")

    def merge(self, metas: list[JSON]) -> JSON:
        """Rank 0's record; refused where another rank's names other tensors, whose
        copies rank 0's record would leave in the checkpoint unread."""
        tensors = sorted(_tree.tensor_refs(metas[0]))
        for rank, meta in enumerate(metas[1:], start=1):
            if sorted(_tree.tensor_refs(meta)) != tensors:
                raise CheckpointError(
                    f"its state_dict() holds other tensors on rank {rank} than on rank 0. "
                    "An object registered with accelerator.register_for_checkpointing is "
                    "saved as the main process's copy, as Accelerate saves it, which needs "
                    "the same keys on every process: give them to it (nothing was written)"
                )
        return metas[0]


register_adapter(_MainCopyStatefulAdapter())
register_adapter(_MainCopyModuleAdapter())
