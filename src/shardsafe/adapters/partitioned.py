"""Optimizers that partition their state across ranks: ZeRO and fairscale's OSS.

Both keep the global param groups (hyperparameters for every parameter) on every rank
and a local optimizer (``.optim``) holding state only for the parameters this rank owns.
shardsafe reads that local optimizer directly, so the user never calls
``consolidate_state_dict()`` or ``state_dict()`` on the wrapper, and nothing is pickled:

* save: each rank offers the state of the parameters it owns, keyed by name;
* load: each rank asks only for the parameters it owns *now* (at any world size, since
  ownership is by name), and loads them into its local optimizer. Hyperparameters go
  to the global groups and are synced to the local optimizer, as the wrappers do.

Supporting another partitioned optimizer with the same shape takes a subclass naming
its type (``docs/saving-and-loading.md``, "ZeRO, OSS and your own sharded optimizer").
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import torch

from ..errors import CheckpointError
from ..protocol import JSON, Adapter, LoadContext, LoadRequests, SaveContext, SavedValue, SaveItem
from .optimizer import (
    check_adoptable,
    export_state,
    import_state,
    live_targets,
    plan_import,
    state_dict_for,
)
from .optimizer_merge import merge_optimizer_metas


class PartitionedOptimizerAdapter(Adapter):
    """Base for wrappers with global ``param_groups`` and a local optimizer in ``.optim``.

    Set ``wrapper_type`` to the class, or ``wrapper_path`` to ``("module", "Class")`` to
    match without importing the module (an object can only be an instance of a class
    whose module its program has imported).
    """

    kind = "optimizer"
    wrapper_type: type | None = None
    wrapper_path: tuple[str, str] | None = None

    def handles(self, obj: object) -> bool:
        cls = self.wrapper_type
        if cls is None and self.wrapper_path is not None:
            module = sys.modules.get(self.wrapper_path[0])
            cls = getattr(module, self.wrapper_path[1], None)
        return cls is not None and isinstance(obj, cls)

    def local(self, obj: Any) -> torch.optim.Optimizer:
        """The optimizer that holds this rank's share of the state."""
        return obj.optim  # type: ignore[no-any-return]

    def sync_groups(self, source: list[dict[str, Any]], destination: list[dict[str, Any]]) -> None:
        for src, dst in zip(source, destination):
            for key, value in src.items():
                if key != "params":
                    dst[key] = value

    def save(self, obj: Any, ctx: SaveContext) -> SaveItem:
        # A scheduler may have changed the global groups since the last step.
        local = self.local(obj)
        self.sync_groups(obj.param_groups, local.param_groups)
        groups = _completed(obj.param_groups, local)
        return export_state(groups, local, ctx, replicated=False, copies=True)

    def merge(self, metas: list[JSON]) -> JSON:
        return merge_optimizer_metas(metas)

    def plan_load(self, obj: Any, saved: SavedValue, ctx: LoadContext) -> LoadRequests:
        return plan_import(obj.param_groups, self.local(obj), saved, ctx)

    def targets(self, obj: Any, saved: SavedValue, ctx: LoadContext) -> dict[str, torch.Tensor]:
        return live_targets(obj.param_groups, self.local(obj), saved, ctx)

    def validate(
        self, obj: Any, saved: SavedValue, tensors: Mapping[str, torch.Tensor], ctx: LoadContext
    ) -> None:
        local = self.local(obj)
        check_adoptable(local, state_dict_for(obj.param_groups, local, saved, tensors, ctx), saved)

    def restore(
        self, obj: Any, saved: SavedValue, tensors: Mapping[str, torch.Tensor], ctx: LoadContext
    ) -> None:
        local = self.local(obj)
        import_state(obj.param_groups, local, saved, tensors, ctx)
        self.sync_groups(local.param_groups, obj.param_groups)


class ZeroAdapter(PartitionedOptimizerAdapter):
    """``torch.distributed.optim.ZeroRedundancyOptimizer``."""

    wrapper_path = ("torch.distributed.optim.zero_redundancy_optimizer", "ZeroRedundancyOptimizer")

    def local(self, obj: Any) -> torch.optim.Optimizer:
        # With overlap_with_ddp=True, ZeRO builds its local optimizer only in its DDP
        # communication hook, during the first training steps: before that there is no
        # ``.optim`` (an AttributeError from deep inside a save or load).
        # Even after them, that optimizer is torch's functional one (``_FunctionalAdam``),
        # no torch.optim.Optimizer: the advice to save after the first steps never worked
        # (found in review).
        local = getattr(obj, "optim", None)
        if not isinstance(local, torch.optim.Optimizer):
            built = (
                "has no local optimizer yet" if local is None else "holds no torch.optim optimizer"
            )
            raise CheckpointError(
                f"this ZeroRedundancyOptimizer {built}: with overlap_with_ddp=True its local "
                "optimizer is torch's functional one, built in its DDP communication hook "
                "during the first training steps, which neither torch's own state_dict() "
                "nor shardsafe can save or load. Build it with overlap_with_ddp=False to "
                "checkpoint it"
            )
        return local


class OSSAdapter(PartitionedOptimizerAdapter):
    """``fairscale.optim.OSS``; fairscale is never imported by shardsafe itself."""

    wrapper_path = ("fairscale.optim.oss", "OSS")


def _completed(groups: list[dict[str, Any]], local: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """The global ``groups`` with the hyperparameters only their local counterparts hold
    (position by position): ZeRO's and OSS's ``add_param_group`` fill the optimizer's
    defaults (``betas``, ``eps``, ...) into the local group alone, until the next step
    copies them up. Saved before that step, the group lacked them, and the resumed run's
    first step failed inside torch (``KeyError: 'betas'``)."""
    return [
        {**{k: v for k, v in mirror.items() if k != "params"}, **group}
        for group, mirror in zip(groups, local.param_groups)
    ] + groups[len(local.param_groups) :]
