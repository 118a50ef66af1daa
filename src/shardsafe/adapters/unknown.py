"""Refusing, clearly, an optimizer that looks sharded but that no adapter understands."""

from __future__ import annotations

from typing import Any

from ..errors import CheckpointError
from ..protocol import Adapter, LoadContext, LoadRequests, SaveContext, SavedValue, SaveItem


class UnknownShardedOptimizer(Adapter):
    """Refuses optimizers that look sharded but that no adapter understands.

    Saving one as a plain optimizer would either record only this rank's shard or call
    its ``state_dict()``, which for such optimizers raises on most ranks or needs a
    collective that would hang. A clear error, agreed on every rank, is better.
    """

    kind = "optimizer"

    def handles(self, obj: object) -> bool:
        return callable(getattr(obj, "consolidate_state_dict", None))

    def _refuse(self, obj: object, ctx: SaveContext) -> CheckpointError:
        return CheckpointError(
            f"state[{ctx.name!r}] is a {type(obj).__qualname__}, which looks like a sharded "
            "optimizer (it has consolidate_state_dict()), but no shardsafe adapter handles "
            "it, and saving it as a plain optimizer would lose the other ranks' state. "
            "Register one: subclass shardsafe.adapters.PartitionedOptimizerAdapter with "
            "wrapper_type set to its class and call shardsafe.register_adapter() "
            "(README: 'ZeRO, OSS and your own sharded optimizer')."
        )

    def save(self, obj: Any, ctx: SaveContext) -> SaveItem:
        raise self._refuse(obj, ctx)

    def plan_load(self, obj: Any, saved: SavedValue, ctx: LoadContext) -> LoadRequests:
        raise self._refuse(obj, ctx)

    def restore(self, obj: Any, saved: SavedValue, tensors: Any, ctx: LoadContext) -> None:
        raise self._refuse(obj, ctx)
